"""The ring-rank emulator and the kernel bench as commands on CPU: they run, write their JSON, and the
emulator's FLOP count of a rank's schedule is its exact share of the whole attention."""

import json
import subprocess
import sys

import pytest
import torch

from distlab.cp.emulate import rank_rows, schedule_flops


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_gives_every_rank_an_equal_share_of_causal_flops(world):
    seq, heads, d = 96 * world, 4, 16
    whole = 4 * seq * seq * heads * d / 2                                     # causal, FlashAttention's count
    shares = [schedule_flops(world, r, seq, heads, d, True, "zigzag") for r in range(world)]
    assert all(abs(s - whole / world) / whole < 1e-12 for s in shares), shares
    contiguous = [schedule_flops(world, r, seq, heads, d, True, "contiguous") for r in range(world)]
    assert contiguous == sorted(contiguous) and abs(sum(contiguous) - whole) / whole < 1e-12   # last rank busiest
    rows = sorted(i for r in range(world) for i in rank_rows(r, world, seq, "zigzag").tolist())
    assert rows == list(range(seq))                                          # the shards cover the sequence once


def test_emulate_and_bench_commands_write_their_json(tmp_path):
    em, be = tmp_path / "emulate.json", tmp_path / "bench.json"
    # two step groupings (one step a launch; step 0, then the other three together) and two knob variants
    out = subprocess.run([sys.executable, "-m", "distlab.cp.emulate", "--world", "4", "--seq", "256", "--iters", "1",
                          "--layout", "zigzag", "contiguous", "--steps-per-launch", "1", "1,3",
                          "--variant", "", "SPLIT_GROUPS=1", "--paired", "2", "--json", str(em)], capture_output=True,
                         text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(em.read_text())["results"]
    assert [r["layout"] for r in results] == ["zigzag"] * 4 + ["contiguous"] * 4
    assert [r["rank"] for r in results] == [0] * 4 + [3] * 4
    assert [r["steps_per_launch"] for r in results[:4]] == [1, 1, [1, 3], [1, 3]]
    assert [r["variant"] for r in results[:4]] == ["", "SPLIT_GROUPS=1"] * 2
    assert all(r["fwd_s"] > 0 and r["bwd_s"] > 0 and r["backend"] == "torch" for r in results)
    assert "1|3" in out.stdout and "[SPLIT_GROUPS=1]" in out.stdout
    for r in results:   # --paired: the rank and the H/W anchor timed again, in turn
        pr = r["paired"]
        assert pr["rounds"] == 2 and min(pr["fwd_s"], pr["bwd_s"], pr["anchor_fwd_s"], pr["anchor_bwd_s"]) > 0
        want = r["flops_fwd"] / (pr["fwd_s"] + pr["bwd_s"]) / (r["anchor"]["flops_fwd"] / (pr["anchor_fwd_s"]
                                                                                           + pr["anchor_bwd_s"]))
        assert pr["efficiency_fwd_bwd"] == pytest.approx(want)
    assert out.stdout.count("timed in turn with it (2 rounds)") == len(results)
    bad = subprocess.run([sys.executable, "-m", "distlab.cp.emulate", "--world", "4", "--seq", "256", "--iters", "1",
                          "--steps-per-launch", "2,1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "group sizes adding up to the ring size (4)" in bad.stderr, bad.stderr[-2000:]
    two = tmp_path / "ranks.json"   # --rank: one row a rank; a rank outside the ring refused before any timing
    out = subprocess.run([sys.executable, "-m", "distlab.cp.emulate", "--world", "3", "--seq", "96", "--iters", "1",
                          "--rank", "all", "--no-backward", "--json", str(two)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ranks = json.loads(two.read_text())["results"]
    assert [r["rank"] for r in ranks] == [0, 1, 2] and "zigzag r2" in out.stdout
    low = min(ranks, key=lambda r: r["efficiency_fwd"])   # the ring's pace: its slowest rank
    assert f"slowest of ranks [0, 1, 2]: rank {low['rank']}, fwd {100 * low['efficiency_fwd']:.1f}%" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "distlab.cp.emulate", "--world", "3", "--seq", "96", "--rank", "3"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "ranks of a ring of 3 are 0 to 2" in bad.stderr and "fused" not in bad.stdout
    bad = subprocess.run([sys.executable, "-m", "distlab.cp.emulate", "--world", "3", "--seq", "96", "--rank", "x"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "ring ranks (0 to 2) or 'all'" in bad.stderr
    out = subprocess.run([sys.executable, "-m", "distlab.kernels.bench", "--seq", "128", "--iters", "1", "--warmup", "0",
                          "--only", "attention", "--json", str(be)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(be.read_text())["results"]
    assert {(r["kernel"], r["pass"]) for r in rows} == {("attention torch", p) for p in ("fwd", "bwd", "fwd wall",
                                                                                         "bwd wall")}


def test_time_alternating_takes_the_functions_in_turn():
    from distlab.bench import time_alternating

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    t = time_alternating(fns, iters=2, warmup=1, device=torch.device("cpu"), mode="wall", rounds=4)
    assert set(t) == set("abc") and all(s >= 0 for s in t.values())
    assert calls[:3] == list("abc")   # the warm-up calls, then four rounds, each starting one further on
    rounds = [calls[3 + 6 * i:3 + 6 * (i + 1)] for i in range(4)]
    assert [r[::2] for r in rounds] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert all(r[0::2] == r[1::2] for r in rounds) and len(calls) == 3 + 24
    with pytest.raises(ValueError, match="rounds=0"):
        time_alternating(fns, 1, 0, torch.device("cpu"), rounds=0)


SKIPPED_LAUNCH = """
import torch
from distlab import knobs
from distlab.kernels.triton_attention import flash_forward
q, k, v = (torch.randn(1, 64, 2, 16) for _ in range(3))
out, lse = torch.full_like(q, float("nan")), torch.full((1, 2, 64), float("nan"))
with knobs.override(TRITON_LAUNCH="skip"):
    flash_forward(q, k, v, True, out=out, lse=lse)
skipped = bool(out.isnan().all())
flash_forward(q, k, v, True, out=out, lse=lse)
print("OK" if skipped and not out.isnan().any() else "BAD")
"""


def test_host_cost_with_launches_skipped_on_cpu(tmp_path):
    """``DISTLAB_TRITON_LAUNCH=skip`` computes everything up to a launch and launches nothing (the output
    stays as it was), and ``host_cost --skip-launches`` times the Triton rows so on a CPU, ring steps too."""
    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    from distlab.testing import run_in_triton_interpreter

    proc = run_in_triton_interpreter(SKIPPED_LAUNCH)
    assert proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr[-2000:]
    js = tmp_path / "host.json"
    out = subprocess.run([sys.executable, "-m", "distlab.kernels.host_cost", "--skip-launches", "--rounds", "1",
                          "--calls", "6", "--ring-world", "3", "--seq", "64", "--head-dim", "16", "--json", str(js)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {(r["row"], r["pass"]): r for r in json.loads(js.read_text())["rows"]}
    assert {("ring step W3, triton, 4 steps a launch", "fwd"), ("ring step W3, triton, 1 step a launch", "fwd"),
            ("ring step W3, triton", "bwd"), ("triton launch", "fwd")} <= set(rows), sorted(rows)
    assert all(r["host_s"] > 0 for r in rows.values())


def test_host_cost_profile_row_is_named_before_any_timing():
    """``host_cost --profile`` takes ``name`` or ``name/pass``; a name that is no row is a ValueError listing the
    rows (``main`` looks the row up before its timing rounds, which take a minute on a GPU: a CPU cannot run it)."""
    from distlab.kernels.host_cost import _profiled_row

    specs = [("fa4", "fwd", "f", {}, 1), ("fa4", "bwd", "b", {}, 1), ("ring step W8, fa4, 4 steps fused", "fwd",
                                                                       "r", {}, 8)]
    assert _profiled_row(specs, "fa4")[2] == "f"
    assert _profiled_row(specs, "fa4/bwd")[2] == "b"
    assert _profiled_row(specs, "ring step W8, fa4, 4 steps fused/fwd")[2] == "r"
    with pytest.raises(ValueError, match="no such row.*ring step W8, fa4, 4 steps fused"):
        _profiled_row(specs, "ring step W8, fa4, 4 steps fused fwd")


def test_the_dkv_adds_timing_probe_is_refused_on_a_real_ring():
    """``RING_DKV_ADDS=0`` leaves dK/dV wrong: only the emulator's stand-in ring may time it; any other ring
    object is refused before its first exchange, and the emulator's rank still runs with it."""
    import types

    import torch

    from distlab import knobs
    from distlab.cp.emulate import emulate_rank
    from distlab.cp.ring_fused import ring_backward_groups

    t = torch.zeros(1, 8, 2, 4)
    ring = types.SimpleNamespace(rank=0, size=2)   # no ``stand_in``: it would be a real exchanger
    with knobs.override(RING_DKV_ADDS="0"):
        with pytest.raises(ValueError, match="timing probe"):
            ring_backward_groups(t, t, t, t, t, torch.zeros(1, 2, 8), ring, True, "zigzag", 0.5, "torch", 2)
        probed = emulate_rank(4, 64, 2, 2, 4, 0, "zigzag", True, "torch", torch.float32, torch.device("cpu"),
                              iters=1, steps_per_launch=(1, 3))
        dq_p, dk_p, _ = probed["calls"][1]()
    full = emulate_rank(4, 64, 2, 2, 4, 0, "zigzag", True, "torch", torch.float32, torch.device("cpu"), iters=1,
                        steps_per_launch=(1, 3))
    dq, dk, _ = full["calls"][1]()
    assert probed["bwd_s"] > 0
    torch.testing.assert_close(dq_p, dq)   # dQ is the same; the step's dK/dV share was not added
    assert not torch.allclose(dk_p, dk)
