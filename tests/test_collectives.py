"""The collectives playground: nccl-tests' formulas, exact correctness checks on gloo, the CLI."""

import json
import os
import subprocess
import sys

import pytest
import torch

from distlab.collectives.playground import bandwidths, parse_size, sweep
from distlab.comm import bus_factor


@pytest.mark.parametrize("op,n,size,us,algbw,busbw", [
    # hand-computed as nccl-tests does: algbw = size / time / 1e9, busbw = algbw * factor
    ("all_reduce", 8, 1 << 30, 4000.0, 268.435456, 469.762048),        # factor 2*7/8
    ("all_gather", 8, 1 << 30, 3000.0, 357.913941, 313.174699),        # factor 7/8
    ("reduce_scatter", 4, 1 << 20, 10.0, 104.8576, 78.6432),           # factor 3/4
    ("all_to_all", 2, 1000, 1.0, 1.0, 0.5),                            # factor 1/2
    ("broadcast", 8, 1 << 30, 5000.0, 214.748365, 214.748365),         # factor 1
    ("sendrecv", 8, 4096, 2.0, 2.048, 2.048),                          # factor 1
])
def test_bandwidth_formulas_match_nccl_tests(op, n, size, us, algbw, busbw):
    got = bandwidths(op, size, us * 1e-6, n)
    assert got == pytest.approx((algbw, busbw), rel=1e-8)


def test_bus_factors_and_sizes():
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_gather", 4) == 0.75
    assert parse_size("1G") == 1 << 30 and parse_size("256M") == 256 << 20 and parse_size("8") == 8
    with pytest.raises(ValueError, match="unknown op"):
        bus_factor("gossip", 4)


def sweep_all(corrupt_rank, dtype):
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv")
    return {op: sweep(op, [8, 1000, 4096], dtype, torch.device("cpu"), 1, 0, True, corrupt_rank) for op in ops}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_playground_is_exactly_right_on_gloo(pools, world, dtype):
    for results in pools(world).run(sweep_all, -1, dtype):
        for op, rows in results.items():
            for row in rows:
                for placement in ("out", "in"):
                    if row[placement] is not None:
                        assert row[placement]["wrong"] == 0, (op, row)
                assert row["size"] <= max(8, 4096) and row["count"] >= 1


def test_playground_counts_wrong_elements_when_a_rank_is_corrupted(pools):
    results = pools(4).run(sweep_all, 1, torch.float32)[0]      # rank 1's first input element is off by one
    # every element a reduction touches with rank 1's first element is wrong on some rank
    assert all(r["out"]["wrong"] > 0 and r["in"]["wrong"] > 0 for r in results["all_reduce"])
    assert all(r["out"]["wrong"] > 0 for r in results["all_gather"])
    assert all(r["out"]["wrong"] == 0 for r in results["broadcast"])   # only rank 0's data travels
    assert all(r["out"]["wrong"] > 0 for r in results["sendrecv"])    # rank 2 receives rank 1's message


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_playground_cli_prints_nccl_tests_table_and_json(tmp_path):
    out = tmp_path / "c.json"
    cmd = [sys.executable, "-m", "distlab", "run", "--nproc", "2", "-m", "distlab.collectives", "--op", "all",
           "-b", "8", "-e", "4K", "-f", "8", "-n", "2", "-w", "1", "--device", "cpu",
           "--json", str(out), "--plot", str(tmp_path / "c.png")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gloo on CPU: a correctness check" in proc.stdout and "# Out of bounds values : 0 OK" in proc.stdout
    assert "#wrong" in proc.stdout and "busbw" in proc.stdout and "# Avg bus bandwidth" in proc.stdout
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv"}
    assert [r["size"] for r in result["results"]["all_reduce"]] == [8, 64, 512, 4096]
    bad = subprocess.run(cmd[:-4] + ["--corrupt-rank", "1"], capture_output=True, text=True, timeout=120, env=ENV)
    assert bad.returncode == 1 and "FAILED" in bad.stdout
