"""The overlap analyser on hand-made traces (exact numbers), and traces written by real CPU runs."""

import json
import os
import subprocess
import sys

import pytest

from distlab.profiling.overlap import analyse_events, intersection, union


def kernel(name, ts, dur, **args):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": args}


GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32"
AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"


def test_interval_algebra():
    assert union([(5, 7), (0, 2), (1, 3), (6, 9)]) == [(0, 3), (5, 9)]
    assert intersection([(0, 3), (5, 9)], [(2, 6), (8, 10)]) == [(2, 3), (5, 6), (8, 9)]


@pytest.mark.parametrize("events,want", [
    # fully hidden: the all-reduce runs inside the GEMMs
    ([kernel(GEMM, 0, 60), kernel(GEMM, 60, 40), kernel(AR, 20, 40)], (100, 40, 40, 100.0, 0)),
    # half hidden: 20 of the 40 us are beside a GEMM
    ([kernel(GEMM, 0, 100), kernel(AR, 80, 40)], (100, 40, 20, 50.0, 20)),
    # serial: nothing hidden
    ([kernel(GEMM, 0, 100), kernel(AR, 100, 50)], (100, 50, 0, 0.0, 50)),
    # nested / overlapping compute counts once; two collectives merge
    ([kernel(GEMM, 0, 50), kernel("elementwise", 10, 20), kernel(GEMM, 40, 20), kernel(AR, 55, 10), kernel(AR, 62, 8)],
     (60, 15, 5, 100 * 5 / 15, 10)),
])
def test_overlap_numbers_are_exact(events, want):
    r = analyse_events(events + [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}])
    assert r["source"] == "gpu kernels"           # kernels win over CPU ops
    got = (r["compute_us"], r["comm_us"], r["overlapped_us"], r["overlap_pct"], r["exposed_comm_us"])
    assert got == pytest.approx(want)


def test_collective_bandwidth_from_trace_metadata():
    meta = {"Collective name": "allreduce", "In msg nelems": 2**28, "Out msg nelems": 2**28, "dtype": "Float",
            "Group size": 8, "External id": 7}
    events = [{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 0, "dur": 5, "args": meta},
              kernel(AR, 10, 4000.0, **{"External id": 7}), kernel(GEMM, 0, 5000)]
    (c,) = analyse_events(events)["collectives"]
    assert c["op"] == "all_reduce" and c["bytes"] == 2**30 and c["ranks"] == 8
    assert (c["algbw"], c["busbw"]) == pytest.approx((268.435456, 469.762048))


def test_distlab_phases_are_used_on_cpu_traces():
    ann = lambda n, ts, dur: {"ph": "X", "cat": "user_annotation", "name": n, "ts": ts, "dur": dur}  # noqa: E731
    events = [ann("ring.exchange", 0, 2), ann("ring.block", 2, 50), ann("ring.merge", 52, 3), ann("ring.wait", 55, 10),
              {"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#3", "ts": 0, "dur": 70}]
    r = analyse_events(events)
    assert r["source"] == "phases"
    assert (r["compute_us"], r["comm_us"], r["exposed_comm_us"]) == (53, 12, 12)


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_cpu_profile_of_a_study_writes_a_trace_per_rank(tmp_path):
    cmd = [sys.executable, "-m", "distlab", "run", "--nproc", "2", "-m", "distlab.cp.ring", "--seq", "128",
           "--device", "cpu", "--iters", "1", "--no-baseline", "--profile", "torch", "--profile-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    traces = sorted((tmp_path / "ring__zigzag").glob("trace_rank*.json"))
    assert [t.name for t in traces] == ["trace_rank0.json", "trace_rank1.json"]
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"ring.block", "ring.exchange", "ring.merge", "ring.block_backward"} <= names
    report = subprocess.run([sys.executable, "-m", "distlab.profiling.overlap", *map(str, traces)],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0 and "phases" in report.stdout


def test_overlap_study_runs_on_gloo_and_traces(tmp_path):
    out = tmp_path / "o.json"
    cmd = [sys.executable, "-m", "distlab", "run", "--nproc", "2", "-m", "distlab.collectives.overlap", "--device",
           "cpu", "--size", "1M", "--gemm", "128", "--iters", "2", "--profile", "torch", "--profile-dir",
           str(tmp_path / "tr"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and min(r["gemm_s"], r["comm_s"], r["serial_s"], r["overlapped_s"]) > 0
    assert "overlap achieved" in proc.stdout and "compute slowdown" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "tr").iterdir()) == ["trace_rank0.json", "trace_rank1.json"]


END_PROCESS = """
import sys, torch
from distlab.profiling import Profiler, end_process
with Profiler(sys.argv[1], sys.argv[2]) as prof:
    for _ in range(prof.steps):
        torch.ones(4).sum()
        prof.step()
print("finished", end="")          # unflushed on purpose: end_process must flush it
end_process()
print(" and went on")
"""


@pytest.mark.parametrize("mode,want", [("torch", "finished"), ("none", "finished and went on")])
def test_end_process_exits_at_once_after_a_torch_profile(tmp_path, mode, want):
    proc = subprocess.run([sys.executable, "-c", END_PROCESS, mode, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == want
    assert (tmp_path / "trace_rank0.json").exists() == (mode == "torch")


def test_metadata_found_through_the_enclosing_record_param_comms():
    """torch 2.11 traces: the kernel points at the 'nccl:all_reduce' range, inside record_param_comms."""
    meta = {"Collective name": "allreduce", "In msg nelems": 2**20, "Out msg nelems": 2**20, "dtype": "BFloat16",
            "Group size": 4, "External id": 4}
    events = [{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 0, "dur": 90, "args": meta},
              {"ph": "X", "cat": "user_annotation", "name": "nccl:all_reduce", "ts": 10, "dur": 67,
               "args": {"External id": 5}},
              {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 100, "dur": 6,
               "args": {"Collective name": "wait", "External id": 9}},
              kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 50, 10.0, **{"External id": 5})]
    (c,) = analyse_events(events)["collectives"]
    assert c["bytes"] == 2**21 and c["algbw"] == pytest.approx(209.7152) and c["busbw"] == pytest.approx(314.5728)


def test_metadata_for_kernels_nccl_launched_itself():
    """P2P kernels carry no External id: the last matching collective recorded before them is theirs."""
    send = {"Collective name": "send", "In msg nelems": 2**29, "Out msg nelems": 2**29, "dtype": "BFloat16",
            "Group size": 1}
    events = [{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 0, "dur": 40, "args": send},
              {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": 45, "dur": 10,
               "args": {"Collective name": "allreduce", "In msg nelems": 8, "Out msg nelems": 8, "dtype": "Float",
                        "Group size": 1}},
              kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 100, 500.0, stream=16)]
    (c,) = analyse_events(events)["collectives"]
    assert c["op"] == "sendrecv" and c["bytes"] == 2**30 and c["busbw"] == pytest.approx(2**30 / 500e-6 / 1e9)


def test_kernel_timeline_summary_counts_overlap_once_and_gaps():
    """Busy time is the union of kernel intervals (PDL-overlapped kernels are not counted twice) and the
    printed gap of an overlapping kernel is negative; a wrong union would report > 100% busy."""
    from distlab.profiling.timeline import format_timeline, summarize

    tl = [("a", 0.0, 10.0), ("b", 8.0, 10.0), ("c", 20.0, 5.0)]   # b overlaps a by 2 us, c after a 2 us gap
    s = summarize(tl)
    assert s["busy_us"] == 23.0 and s["span_us"] == 25.0 and abs(s["busy_fraction"] - 0.92) < 1e-12
    lines = format_timeline(tl, "t", [None, 2e7, None]).splitlines()
    assert lines[3].split()[:5] == ["1", "8.0", "-2.0", "10.0", "2.0"]    # 2e7 flop in 10 us = 2 TFLOP/s
    assert lines[4].split()[:4] == ["2", "20.0", "2.0", "5.0"] and "(92.0%)" in lines[-1]


def test_kernel_timeline_names_the_op_and_stream_of_each_kernel_from_the_trace():
    """``kernels_of_trace`` (``kernel_timeline(origins=True)``): each kernel of an exported trace with its stream
    and the CPU op of its External id with that op's input shapes; kernels outside any op have no origin,
    the spin kernel is left out, starts are relative to the first kernel, sorted by start."""
    from distlab.profiling.timeline import by_origin, format_timeline, kernels_of_trace

    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::add_", "ts": 5.0, "dur": 9.0,
         "args": {"External id": 7, "Input Dims": [[2, 8, 512], [2, 8, 512], []]}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 20.0, "dur": 3.0,
         "args": {"External id": 9, "Input Dims": [[4, 4], [4, 4], []]}},
        {"ph": "X", "cat": "kernel", "name": "void spin_kernel", "ts": 90.0, "dur": 500.0,
         "args": {"External id": 0, "stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "elementwise_kernel<128, 2>", "ts": 700.0, "dur": 12.5,
         "args": {"External id": 7, "stream": 13}},
        {"ph": "X", "cat": "kernel", "name": "_dq_finish_kernel", "ts": 650.0, "dur": 40.0,
         "args": {"External id": 3, "stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 720.0, "dur": 2.0,
         "args": {"External id": 9, "stream": 7}},
        {"ph": "i", "cat": "kernel", "name": "not a span", "ts": 1.0}]}
    got = kernels_of_trace(trace)
    assert got == [("_dq_finish_kernel", 0.0, 40.0, 7, ""),
                   ("elementwise_kernel<128, 2>", 50.0, 12.5, 13, "aten::add_ [2, 8, 512] [2, 8, 512]"),
                   ("Memcpy DtoD", 70.0, 2.0, 7, "aten::copy_ [4, 4] [4, 4]")], got
    lines = format_timeline(got, "t").splitlines()
    assert lines[3].endswith("s13 aten::add_ [2, 8, 512] [2, 8, 512]") and lines[2].endswith("s7"), lines
    assert kernels_of_trace({"traceEvents": []}) == []
    assert by_origin(got + [("void at::native::fill<4>(x)", 80.0, 1.0, 7, "aten::fill_ [3]")]) == [
        ("_dq_finish_kernel", 1, 40.0), ("aten::add_", 1, 12.5), ("aten::copy_", 1, 2.0), ("aten::fill_", 1, 1.0)]
    assert lines[-1] == "    by op: _dq_finish_kernel 1x 40.0 us; aten::add_ 1x 12.5 us; aten::copy_ 1x 2.0 us"
