"""The planner (distlab.plan): its calibration lookup, link model, byte and pair accounting, overlap rules,
the ranked layouts on the shipped H200 calibration, its refusals, and one gloo validation end to end."""

import json
import os
import subprocess
import sys

import pytest
import torch

from distlab.cp.cost import cp_bytes
from distlab.plan import __main__ as plan_cli
from distlab.plan.calibration import KERNELS, Calibration, fit_link
from distlab.plan.links import LINKS, Link, parse_cluster
from distlab.plan.model import AttnShape, Kernels, attention_cost, ring_cost


def flat_calibration(rate=1e12, launch_us=0.0, device="flat"):
    """Every kernel at one rate; memory-bound ones free (the LSE merges drop out of the sums)."""
    return Calibration({"device": device, "launch_us": launch_us, "date": "test",
                        "rates": {k: [[1.0, 1e40 if k == "copy" else rate], [1e18, 1e40 if k == "copy" else rate]]
                                  for k in KERNELS}})


BYTES = Link("bytes", 0.0, 1e-9, "time = bytes x factor")          # seconds == bytes moved
FREE = Link("free", 0.0, 1e12, "nothing costs")


def test_rate_interpolates_in_log_size_and_flags_what_is_outside():
    cal = Calibration({"device": "x", "launch_us": 0, "date": "t", "rates": {
        **{k: [[1.0, 1.0], [100.0, 100.0]] for k in KERNELS},
        "gemm": [[1.0, 1.0], [100.0, 100.0], [1000.0, 105.0]]}})
    assert cal.rate("copy", 10.0) == (pytest.approx(10.0), False)
    assert cal.rate("copy", 0.5) == (1.0, True)                   # below: held, flagged
    assert cal.rate("copy", 1e4) == (100.0, True)                 # above, not saturated: flagged
    assert cal.rate("gemm", 1e6) == (105.0, False)                # above, last two within 10%: saturated


def test_link_fit_recovers_alpha_and_busbw():
    rows = [{"size": s, "time_us": 50 + s * 0.5 / 2e9 * 1e6, "n": 2} for s in (1e5, 1e6, 1e7, 1e8)]
    alpha, busbw = fit_link(rows, "all_gather")                   # factor (n-1)/n = 0.5
    assert alpha == pytest.approx(50, rel=1e-6) and busbw == pytest.approx(2.0, rel=1e-6)


@pytest.mark.parametrize("method,u,r", [("ring", 1, 3), ("ring", 1, 4), ("ulysses", 4, 1), ("usp", 2, 2),
                                        ("allgather", 1, 4)])
def test_communication_is_the_cost_models_bytes(method, u, r):
    """With time = bytes, each method's forward and backward comm equals distlab.cp.cost (= CommLog)."""
    shape = AttnShape(2, 96, 8, 4, 16, itemsize=2, layout="contiguous" if r == 3 else "zigzag")
    f, b = attention_cost(method, shape, Kernels(flat_calibration()), BYTES, BYTES, ulysses=u, ring=r)
    want = cp_bytes(method, 2, 96, 8, 4, 16, torch.bfloat16, ulysses=u, ring=r)
    assert f.comm == pytest.approx(want["fwd"]) and b.comm == pytest.approx(want["bwd"])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_attention_work_counts_visible_pairs(world):
    """At a flat rate: zigzag splits the causal pairs evenly (W·T_W = T_1); contiguous waits on its busiest
    step each time; packed documents count only their pairs."""
    seq, k = 48 * world, Kernels(flat_calibration())
    one, _ = ring_cost(AttnShape(1, seq, 4, 2, 8), 1, 4, 2, k, FREE)
    zig, _ = ring_cost(AttnShape(1, seq, 4, 2, 8, layout="zigzag"), world, 4, 2, k, FREE)
    assert world * zig.compute == pytest.approx(one.compute)
    con, _ = ring_cost(AttnShape(1, seq, 4, 2, 8, layout="contiguous"), world, 4, 2, k, FREE)
    local = seq // world
    pairs = (world - 1) * local * local + local * (local + 1) / 2
    assert con.compute == pytest.approx(4 * pairs * 4 * 8 / 1e12)
    from distlab.cp.documents import Documents

    docs = Documents.from_args(seq, torch.tensor([0, seq // 2, seq]), True)
    packed, _ = ring_cost(AttnShape(1, seq, 4, 2, 8, docs=docs, layout="zigzag"), 1, 4, 2, k, FREE)
    half = seq // 2
    assert packed.compute == pytest.approx(4 * 2 * half * (half + 1) / 2 * 4 * 8 / 1e12)


def test_overlap_rules():
    shape = AttnShape(1, 256, 4, 2, 8, layout="zigzag")
    slow, k = Link("slow", 0.0, 1e-3, "slow"), Kernels(flat_calibration())
    f, b = ring_cost(shape, 4, 4, 2, k, slow)
    steps = 3                                     # hops hidden behind steps 0..2, each hop >> its step
    assert f.exposed == pytest.approx(f.comm - steps * f.compute / 4, rel=1e-6)
    fu, _ = attention_cost("ulysses", shape, k, slow, slow, ulysses=4)
    assert fu.exposed == fu.comm                    # all-to-alls are never hidden
    gloo = Link("gloo", 0.0, 1e-3, "cpu", overlaps_compute=False)
    fg, bg = ring_cost(shape, 4, 4, 2, k, gloo)
    assert fg.exposed == fg.comm and bg.exposed == bg.comm


@pytest.mark.parametrize("world,layout,causal", [(3, "contiguous", False), (4, "zigzag", True), (8, "zigzag", True)])
def test_launch_groups_and_the_direct_route_move_the_rings_bytes(world, layout, causal):
    """With time = bytes: launch groups move the step-by-step ring's bytes (distlab.cp.cost, = CommLog); the
    direct route moves the K/V hops plus, per group, the busiest rank's shares — at least the shares of any one
    rank (``direct_bytes``, = CommLog on gloo in tests/test_ring.py), at most W − 1 whole shards, and exactly
    one rank's where every rank sends the same (a non-causal ring)."""
    from distlab.cp.ring_dkv_direct import direct_bytes

    shape = AttnShape(1, 32 * world, 4, 2, 8, layout=layout, causal=causal)
    k, want = Kernels(flat_calibration()), cp_bytes("ring", 1, 32 * world, 4, 2, 8, torch.bfloat16, ring=world)
    for spl in (1, 2, (1, world - 1)):
        f, b = ring_cost(shape, world, 4, 2, k, BYTES, steps_per_launch=spl)
        assert f.comm == pytest.approx(want["fwd"]) and b.comm == pytest.approx(want["bwd"]), spl
        for itemsize in (2, 4):
            f, b = ring_cost(shape, world, 4, 2, k, BYTES, steps_per_launch=spl, dkv_route="direct",
                             share_itemsize=itemsize)
            sent = [direct_bytes(r, world, 32, causal, layout, spl, 1, 2, 8, itemsize) for r in range(world)]
            assert max(sent) <= b.comm - f.comm + 1e-6 <= (world - 1) * 2 * 32 * 2 * 8 * itemsize + 1e-6, spl
            if not causal:
                assert b.comm - f.comm == pytest.approx(sent[0]), spl


def test_a_real_ring_pays_its_last_groups_dkv():
    """Compute slow enough to hide every hop but the last: by the ring's route the last launch group's dK/dV
    go rank to rank, one hop a step, then home (W=8: 1 | 3 | 4 leaves 4 hops after the last kernel, 1 | 5 | 2
    two, one step a launch one); by the direct route the last group's shares leave at once. The forward's
    K/V hops hide."""
    shape, k = AttnShape(1, 256, 4, 2, 8, layout="zigzag"), Kernels(flat_calibration(rate=1e3))
    link = Link("l", 0.0, 1.0, "1 GB/s")
    hop = 2 * 32 * 2 * 8 * 4 / 1e9                        # a float32 dK/dV shard
    for spl, hops in ((None, 1), (4, 4), ((1, 5, 2), 2), ((1, 6, 1), 1)):
        f, b = ring_cost(shape, 8, 4, 2, k, link, steps_per_launch=spl)
        assert f.exposed == 0 and b.exposed == pytest.approx(hops * hop), spl
    for spl, shards in ((4, 4), ((1, 5, 2), 2)):           # rank 0 sends whole shards at every later step
        _, b = ring_cost(shape, 8, 4, 2, k, link, steps_per_launch=spl, dkv_route="direct", share_itemsize=2)
        assert b.exposed == pytest.approx(shards * hop / 2), spl
    with pytest.raises(ValueError, match="one of"):
        ring_cost(shape, 8, 4, 2, k, link, dkv_route="straight")


def test_ring_tail_prints_the_planners_exposure_per_grouping_and_route(tmp_path, capsys):
    """``python -m distlab.plan.ring_tail``: a row per grouping and route that fits the ring, each the planner's
    own figures; a sequence that does not split into 2W chunks or an unknown link is refused by name."""
    from distlab.bench import UsageError
    from distlab.plan import ring_tail

    out = tmp_path / "tail.json"
    ring_tail.main(["--world", "4", "--seq", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                    "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["groups"], r["route"]) for r in rows] == [("1 a launch", "ring"), (4, "ring"), (4, "direct"),
                                                        (4, "direct")]   # 1,5,2 and 1,6,1 need W=8
    k = Kernels(Calibration.load(os.path.join(plan_cli.CALIBRATIONS, "h200.json")))
    f, b = ring_cost(AttnShape(1, 256, 4, 2, 8), 4, 4, 2, k, LINKS["nvlink4"], steps_per_launch=4,
                     dkv_route="direct", share_itemsize=2)
    assert rows[2]["exposed_ms"] == pytest.approx((f.exposed + b.exposed) * 1e3)
    assert "bwd exposed" in capsys.readouterr().out
    for argv, message in ((["--seq", "100"], "--seq 100 must divide"), (["--link", "bogus"], "unknown link")):
        with pytest.raises(UsageError, match=message):
            ring_tail.main(argv)


def test_masked_calls_take_the_masked_kernels_rate():
    """All-gather KV's causal positions, packed documents and the balanced layout run the masked kernels;
    zigzag's causal and full blocks do not."""
    cal = flat_calibration()
    cal.data["rates"]["attention_fwd_masked"] = [[1.0, 1e11], [1e18, 1e11]]          # 10x slower
    k = Kernels(cal)
    shape = AttnShape(1, 128, 4, 2, 8, layout="zigzag")
    ag, _ = attention_cost("allgather", shape, k, FREE, FREE, ring=2)
    pairs = sum(range(1, 33)) + sum(range(97, 129))          # rank 0's zigzag rows (0-31, 96-127), every key
    assert ag.compute == pytest.approx(4 * pairs * 4 * 8 / 1e11)
    zig, _ = ring_cost(shape, 2, 4, 2, k, FREE)             # the same pairs, as causal and full blocks
    assert zig.compute == pytest.approx(4 * pairs * 4 * 8 / 1e12)
    bal, _ = ring_cost(AttnShape(1, 128, 4, 2, 8, layout="balanced"), 2, 4, 2, k, FREE)
    assert bal.compute > 5 * zig.compute


def test_ranks_sharing_cores_overlap_their_idle_steps():
    """8 ranks on 2 cores: a contiguous ring step where few ranks have work costs the work over the cores,
    not the slowest rank at an eighth of a core."""
    shape = AttnShape(1, 256, 4, 2, 8, layout="contiguous")
    alone, _ = ring_cost(shape, 8, 4, 2, Kernels(flat_calibration(), slowdown=4.0), FREE)
    shared, _ = ring_cost(shape, 8, 4, 2, Kernels(flat_calibration(), slowdown=4.0, cores=2), FREE)
    zig = AttnShape(1, 256, 4, 2, 8, layout="zigzag")
    z_alone, _ = ring_cost(zig, 8, 4, 2, Kernels(flat_calibration(), slowdown=4.0), FREE)
    z_shared, _ = ring_cost(zig, 8, 4, 2, Kernels(flat_calibration(), slowdown=4.0, cores=2), FREE)
    assert shared.compute < 0.7 * alone.compute and z_shared.compute == pytest.approx(z_alone.compute)
    # USP 2x2 on 4 ranks, 2 cores: two rings side by side share them (without counting both: half the time)
    k4 = Kernels(flat_calibration(), slowdown=2.0, cores=2)
    usp, _ = attention_cost("usp", zig, k4, FREE, FREE, ulysses=2, ring=2)
    ring4, _ = ring_cost(zig, 4, 4, 2, k4, FREE)
    assert usp.compute == pytest.approx(ring4.compute)


def test_groups_inside_a_node_use_the_intra_link():
    c = parse_cluster("2x8", "nvlink4", "ib-ndr400", LINKS)
    assert c.world == 16 and c.group_link(1, 8).name == "nvlink4" and c.group_link(8, 2).name == "ib-ndr400"
    assert c.group_link(2, 4).name == "nvlink4" and c.group_link(4, 4).name == "ib-ndr400"


def test_worked_example_ranks_ulysses_inside_and_ring_across(tmp_path):
    """The README's example on the shipped H200 calibration: Llama-3-8B, 128k tokens, one sequence, 2x8."""
    out = tmp_path / "plan.json"
    plan_cli.main(["--model", "llama3-8b", "--seq", "131072", "--batch", "1", "--cluster", "2x8",
                   "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    fits = [r for r in rows if r["fits"]]
    assert fits and all(a["tokens_per_s_per_gpu"] >= b["tokens_per_s_per_gpu"] for a, b in zip(fits, fits[1:]))
    best = fits[0]
    assert best["plan"]["method"] == "usp" and best["links"]["ulysses"] == "nvlink4" and best["links"]["ring"] == "ib-ndr400"
    assert best["step_s"] == pytest.approx(best["compute_s"] + best["exposed_comm_s"])
    assert 0 < best["mfu"] < 1 and not best["extrapolated"]
    plan_cli.main(["--config", "tiny", "--seq", "4096", "--cluster", "2", "--tp", "2", "--json", str(out)])
    tiny = json.loads(out.read_text())["rows"]       # head_dim 16, calibrated at 128: said, on every row
    assert tiny and all(r["plan"]["tp"] == 2 for r in tiny)
    assert all("attention(head_dim 16; calibrated at 128)" in r["extrapolated"] for r in tiny)
    assert not all(r["fits"] for r in rows)        # AC none without sharding does not fit everywhere


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama3-8b", "--intra", "nvlink9"], "unknown link 'nvlink9'"),
    (["--model", "llama3-8b", "--cluster", "2by8"], "NODESxGPUS"),
    (["--model", "llama3-8b", "--gpu", "h100", "--calibration", "H200"], "measured on 'NVIDIA H200', not 'h100'"),
    (["--model", "gpt5"], "unknown --model 'gpt5'"),
    (["--model", "llama3-8b", "--seq", "7", "--cluster", "8"], "no layout of 8 GPUs"),
    (["--model", "llama3-8b", "--methods", "ring,stripe"], "unknown --methods"),
    (["--model", "llama3-8b", "--ac", "some"], "activation checkpointing none, selective, full"),
    (["--model", "llama3-8b", "--tp", "3", "--cluster", "2x8"], "--tp 3 must divide the 16 GPUs"),
    (["--model", "llama3-8b", "--tp", "16", "--cluster", "2x8"], "spans nodes"),
    (["--model", "llama3-8b", "--cp", "3", "--cluster", "2x8"], "--cp 3 must divide"),
])
def test_bad_input_is_refused_by_name(argv, message):
    argv = [os.path.join(plan_cli.CALIBRATIONS, "h200.json") if a == "H200" else a for a in argv]
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        plan_cli.main(argv)


def test_user_link_table(tmp_path):
    table = tmp_path / "links.json"
    table.write_text(json.dumps({"slingshot": {"alpha_us": 5, "busbw_gbs": 25, "source": "ours"}}))
    out = plan_cli.plan(plan_cli.parse_args(["--model", "llama3-8b", "--cluster", "2x4", "--inter", "slingshot",
                                             "--link-table", str(table)]))
    assert out["cluster"]["inter"] == "slingshot"
    table.write_text(json.dumps({"bad": {"alpha_us": 5}}))
    with pytest.raises(ValueError, match="missing busbw_gbs"):
        plan_cli.plan(plan_cli.parse_args(["--model", "llama3-8b", "--link-table", str(table)]))


def test_published_tables_are_reproduced_in_shape():
    """Configured as their hardware the planner puts zigzag far above the plain ring, as published."""
    from distlab.plan.published import ring_flash_attention, torchtitan

    cal = Calibration.load(os.path.join(plan_cli.CALIBRATIONS, "h200.json"))
    rows = {r["what"]: r for r in ring_flash_attention(cal)}
    assert rows["zigzag fwd_bwd efficiency"]["predicted"] > 1.5 * rows["ring fwd_bwd efficiency"]["predicted"]
    for r in rows.values():
        assert 0.75 < r["predicted"] / r["published"] < 1.25
    tt = torchtitan(cal)[0]
    assert tt["published"] < tt["predicted"] < 2 * tt["published"]     # an upper bound (eager, 500 W caps)
    mem = torchtitan(cal)[1]
    assert 0.8 < mem["predicted"] / mem["published"] < 1.25


def test_validation_on_gloo_end_to_end(tmp_path):
    """Calibrate this CPU and gloo at W=2, run the zigzag study, predict it: both numbers come back."""
    out = tmp_path / "v.json"
    run = subprocess.run([sys.executable, "-m", "distlab.plan.validate", "--worlds", "2", "--studies", "zigzag",
                          "--seq", "1024", "--iters", "2", "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["study"] == "zigzag" and row["world"] == 2
    assert row["measured_fwd_bwd_s"] > 0 and row["predicted_fwd_bwd_s"] > 0
    assert "predicted / measured" in run.stdout


def test_prediction_next_to_a_gpu_run(tmp_path, capsys):
    """``--measured`` (what launch/multigpu_check.sh prints): a study's JSON in, predicted next to measured;
    a CPU run is refused rather than compared with a GPU calibration."""
    from distlab.plan import validate

    result = {"algorithm": "ring", "world_size": 8, "device": "cuda:0", "slowest": {"fwd_s": 0.01, "fwd_bwd_s": 0.04},
              "args": {"batch": 1, "seq": 65536, "heads": 32, "kv_heads": 8, "head_dim": 128, "causal": True,
                       "layout": "zigzag", "dtype": "bfloat16"}}
    path = tmp_path / "parity_distlab_cp_ring_bf16.json"
    path.write_text(json.dumps(result))
    validate.main(["--measured", str(path), "--json", str(tmp_path / "out.json")])
    (row,) = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert row["study"] == "zigzag" and row["world"] == 8 and 0.005 < row["predicted_fwd_s"] < 0.02
    path.write_text(json.dumps({**result, "device": "cpu"}))
    with pytest.raises(ValueError, match="measured on 'cpu'"):
        validate.main(["--measured", str(path)])
