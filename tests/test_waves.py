"""The wave model of the masked kernels (``distlab.cp.waves``): its list scheduler on cases worked by hand, and
a ring of one rank that must equal one call exactly."""

import pytest
import torch

from distlab.cp.waves import Kernel, block_costs, chain, layout_row, per_sm_units, simulate


def test_equal_programs_take_whole_waves():
    assert simulate([Kernel("k", [1.0] * 10)], sms=4) == 3.0        # 4 + 4 + 2
    assert simulate([Kernel("k", [1.0] * 10, units=1)], sms=4) == 2.0   # two a SM: 8 + 2
    assert simulate([Kernel("k", [])], sms=4) == 0.0


def test_a_kernel_waits_for_the_kernels_before_it_and_its_gap():
    a, b = Kernel("a", [1.0] * 5), Kernel("b", [2.0] * 3, after=(0,))
    assert simulate([a, b], sms=4) == 2.0 + 2.0 and (a.end, b.end) == (2.0, 4.0)
    assert simulate([Kernel("a", [1.0] * 5), Kernel("b", [2.0] * 3, after=(0,))], sms=4, gap=0.5) == 4.5
    # independent: b's programs fill the SMs a leaves free, and the partial waves overlap
    assert simulate([Kernel("a", [1.0] * 5), Kernel("b", [2.0] * 3)], sms=4) == 3.0
    with pytest.raises(ValueError, match="cycle"):
        simulate([Kernel("a", [1.0], after=(1,)), Kernel("b", [1.0], after=(0,))], sms=2)


def test_a_programmatic_dependent_starts_early_and_waits_before_its_epilogue():
    # one program an SM, two SMs: a's last program runs 1..4; b (one program) starts beside it at 1 under
    # PDL, ends its loop at 2 and holds its SM until a ends (4); as a plain launch it runs 4..5 (+ the gap)
    a = [1.0, 1.0, 3.0]
    assert simulate([Kernel("a", a, 1), Kernel("b", [1.0], 1, after=(0,))], sms=2, capacity=1, gap=0.5) == 5.5
    ks = [Kernel("a", a, 1), Kernel("b", [1.0], 1, pdl=(0,)), Kernel("c", [1.0], 1, pdl=(1,))]
    assert simulate(ks, sms=2, capacity=1, gap=0.5) == 5.0 and [k.end for k in ks] == [4.0, 4.0, 5.0]
    # c follows b: it starts once b's one program is placed, but finds no SM free until a ends


def test_longest_first_shortens_the_last_wave():
    assert simulate([Kernel("k", [1, 1, 1, 1, 4])], sms=2) == 6.0
    assert simulate([Kernel("k", [4, 1, 1, 1, 1])], sms=2) == 4.0


def test_a_launch_that_finds_no_room_holds_back_the_launches_after_it():
    # one SM: a holds half of it for 5; b needs all of it, so c (half) waits behind b rather than beside a
    ks = [Kernel("a", [5.0], units=1), Kernel("b", [1.0]), Kernel("c", [1.0], units=1)]
    assert simulate(ks, sms=1) == 7.0 and ks[2].end == 7.0


def test_streams_of_each_schedule():
    cost = {"fwd": [1.0], "dkv": [1.0], "dq": [1.0]}
    blocks = [(0, cost), (1, cost), (2, cost)]
    one = chain(blocks, "lpt")
    assert [k.name for k in one] == ["fwd"] * 3 + ["dkv", "dq"] * 3
    assert [k.after for k in one] == [(), (0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)]
    dq = chain(blocks, "lpt+dq")   # dQ after its dK/dV and the dQ before; dK/dV after the dK/dV before
    assert [k.after for k in dq][3:] == [(2,), (3,), (3,), (4, 5), (5,), (6, 7)]
    four = chain(blocks, "bwd4")   # one forward stream; dK/dV on two streams in turn, each after the forward
    assert [k.name for k in four] == ["fwd"] * 3 + ["dkv", "dq"] * 3
    assert [k.after for k in four] == [(), (0,), (1,), (2,), (3,), (2,), (4, 5), (3,), (6, 7)]
    both = chain(blocks, "fwd2+bwd4")   # forward steps 1, 2 beside step 0; a merge; dK/dV on two streams in turn
    assert [k.name for k in both][:4] == ["fwd", "fwd", "fwd", "merge"]
    assert [k.after for k in both] == [(), (), (1,), (0, 2), (3,), (4,), (3,), (5, 6), (4,), (7, 8)]
    assert all(not k.after for k in chain(blocks, "no barrier"))
    pdl = chain(blocks, "lpt+dq pdl")   # each kernel follows the one before it on its stream; events stay waits
    assert [k.pdl for k in pdl] == [(), (0,), (1,), (2,), (), (3,), (4,), (5,), (6,)]
    assert [k.after for k in pdl] == [(), (), (), (), (3,), (), (5,), (), (7,)]
    # the later steps' dQ in one launch, queued when the last step's K/V arrive (before step 2's dK/dV), after
    # the caller's stream (its dK/dV so far) and the dQ stream (step 0's dQ)
    once = chain(blocks, "dq once", later_dq=[5.0], world=3)
    assert [k.name for k in once][3:] == ["dkv", "dq", "dkv", "dq once", "dkv"]
    assert [k.after for k in once][3:] == [(2,), (3,), (3,), (4, 5), (5,)]
    # the forward's step groups (W=3: 0 | 1 2) one launch each, longest programs first; then lpt+dq
    groups = chain([(0, cost), (1, cost), (2, {"fwd": [1.0, 3.0], "dkv": [1.0], "dq": [1.0]})], "fwd groups",
                   world=3)
    assert [k.name for k in groups] == ["fwd", "fwd", "dkv", "dq", "dkv", "dq", "dkv", "dq"]
    assert groups[1].costs == [3.0, 1.0, 1.0] and [k.after for k in groups] == [(), (0,), (1,), (2,), (2,), (3, 4),
                                                                               (4,), (5, 6)]
    assert per_sm_units(1, 2) == (2, 2, 1) and per_sm_units(2, 3) == (6, 3, 2)


def test_one_rank_is_one_call():
    """At W=1 the rank runs the one call's kernels (its dK/dV over the keys its rows see: all of them), so the
    one-stream row-order schedule is exactly 100%; a pack, a window, GQA."""
    from distlab.cp.documents import Documents

    docs = Documents.from_args(2048, torch.tensor([0, 700, 1500, 2048]), True, 300)
    row = layout_row(docs, [torch.arange(2048)], 8, 2, 16, 1.5, 4.0, gap_us=5.0, tile_us=1.0, per_sm=(1, 2))
    assert row["rows"]["fwd"] == pytest.approx(1.0) and row["rows"]["fb"] == pytest.approx(1.0)
    costs = block_costs(docs.mask(torch.arange(2048), torch.arange(2048)), 8, 2, False, False, 0.0)
    assert len(costs["fwd"]) == 8 * 16 and len(costs["dkv"]) == 2 * 32 and len(costs["dq"]) == 8 * 32


def test_split_loops_cut_the_rank_kernels_only():
    """``--split``: a loop of 20 tiles at cap 8 becomes three programs of 20/3 tiles plus the merge; short loops
    stay; the one call keeps its kernel (its time unchanged), and at W=1 a split rank pays the parts' cost."""
    from distlab.cp.documents import Documents
    from distlab.cp.waves import SPLIT_MERGE, _split

    assert _split(torch.tensor([3, 20]), 8).tolist() == pytest.approx([3.0] + [20 / 3 + SPLIT_MERGE] * 3)
    assert _split(torch.tensor([3, 20]), None).tolist() == [3, 20]
    docs = Documents.from_args(2048, torch.tensor([0, 1900, 2048]), True, None)
    whole = layout_row(docs, [torch.arange(2048)], 8, 2, 16, 1.5, 4.0, gap_us=5.0, tile_us=1.0)
    split = layout_row(docs, [torch.arange(2048)], 8, 2, 16, 1.5, 4.0, gap_us=5.0, tile_us=1.0, split=2)
    assert split["one_call_fwd_ms"] == whole["one_call_fwd_ms"]
    assert split["rows"]["fb"] < whole["rows"]["fb"] == pytest.approx(1.0)


def test_all_gather_with_its_longest_tiles_first_ends_sooner():
    """The all-gather columns: a rank's programs longest first (the masked kernel's ``auto`` since the 24th
    session) against row order, on a pack whose ranks' tiles differ in length; a whole call is unchanged."""
    from distlab.cp.documents import Documents

    docs = Documents.from_args(2048, torch.tensor([0, 1500, 1600, 2048]), True, None)
    shards = [torch.arange(r * 512, (r + 1) * 512) for r in range(4)]
    row = layout_row(docs, shards, 4, 2, 8, 1.5, 4.0, gap_us=5.0, tile_us=1.0)
    rows, lpt = row["all-gather rows"], row["all-gather"]
    assert lpt["fb"] > rows["fb"] and lpt["fwd"] >= rows["fwd"], (rows, lpt)


def test_the_study_ranks_layouts(capsys, tmp_path):
    import json

    from distlab.cp.waves import main

    timed = tmp_path / "timed.json"   # an emulate_packed JSON's shape: one layout timed under lpt+dq
    timed.write_text(json.dumps({"rows": [{"seq": 8192, "layout": "balanced",
                                           "efficiency": {"fwd_gpu": 0.5, "fwd_bwd_gpu": 0.6}}]}))
    rows = main(["--world", "4", "--seq", "8192", "--layouts", "zigzag", "balanced", "--heads", "4",
                 "--kv-heads", "2", "--sms", "16", "--docs", "lognormal:mean=1024,seed=0",
                 "--measured", f"{timed}:lpt+dq"])
    out = capsys.readouterr().out
    assert "balanced" in out and len(rows) == 2 and "measured lpt+dq: 50.0/60.0%" in out
    assert rows[1]["measured"] == {"lpt+dq": {"fwd": 0.5, "fb": 0.6}} and "measured" not in rows[0]
    model = rows[1]["model"]["lpt+dq"]
    rms = ((model["fwd"] - 0.5) ** 2 / 2 + (model["fb"] - 0.6) ** 2 / 2) ** 0.5
    assert f"against 2 measured figures: RMS {rms * 100:.1f} points" in out
    with pytest.raises(ValueError, match="name a schedule"):
        main(["--seq", "8192", "--measured", f"{timed}:fast"])
    for r in rows:
        for schedule, eff in ((s, e) for s, e in r["model"].items() if s != "one_call_fwd_ms"):
            assert 0.1 < eff["fwd"] <= 1.05 and 0.1 < eff["fb"] <= 1.05, (r["layout"], schedule, eff)
    zigzag, balanced = (r["model"]["lpt+dq"]["fb"] for r in rows)
    assert balanced > zigzag   # a pack's zigzag ranks are out of balance (pairs), balanced's are not


def test_the_model_needs_no_triton():
    """``python -m distlab.cp.waves`` runs on any machine: nothing it imports needs triton."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"
            "from distlab.cp.waves import main\n"
            "main(['--world', '2', '--seq', '2048', '--heads', '2', '--kv-heads', '1', '--sms', '4', '--layouts',"
            " 'zigzag'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "zigzag" in proc.stdout, proc.stderr[-2000:]


def test_several_packs_give_each_layout_its_spread(capsys):
    from distlab.cp.waves import SCHEDULES, main

    rows = main(["--world", "2", "--seq", "4096", "--heads", "2", "--kv-heads", "1", "--sms", "8", "--layouts",
                 "zigzag", "--docs", "lognormal:mean=512,seed=0", "lognormal:mean=512,seed=1"])
    out = capsys.readouterr().out
    assert [r["docs"] for r in rows] == ["lognormal:mean=512,seed=0", "lognormal:mean=512,seed=1"]
    fb = sorted(r["model"]["lpt+dq"]["fb"] * 100 for r in rows)
    assert "over 2 packs, f+b median [min, max]: " in out
    assert f"lpt+dq {sum(fb) / 2:.1f} [{fb[0]:.1f}, {fb[1]:.1f}]" in out and all(s in out for s in SCHEDULES)
