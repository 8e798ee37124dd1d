"""How much communication a trace hid behind compute: per rank, from Chrome/Perfetto traces.

    python -m distlab.profiling.overlap traces/trace_rank0.json traces/trace_rank1.json [--json out.json]

nsys on the lab's GPU machines writes only a ``.qdstrm``, so this reads ``torch.profiler`` traces instead
(one file per rank, as ``--profile torch`` writes them). Which events count (``--use``, default auto = the
first that the trace has):

- ``kernel``: GPU kernels; communication = names with nccl / gloo / all_reduce / all_gather /
  reduce_scatter / all_to_all / broadcast / sendrecv in them, compute = every other kernel;
- ``phases``: distlab's own phase ranges (``distlab.profiling.phase``); communication = ``comm.*`` and
  ``*.exchange`` / ``*.wait`` / ``*.all_to_all``, compute = the rest (``ring.block``, ``compute.*`` ...).
  On CPU this is what there is: gloo works in threads the profiler does not record, so a phase shows
  when the rank *waited* for communication, which is the exposed part;
- ``cpu``: every CPU op (coarse: enclosing ops swallow what they contain).

Intervals of each kind are merged (nested or overlapping events count once), then:

- compute, communication: the lengths of the two unions;
- overlapped: the length of their intersection; overlap % = overlapped / communication;
- exposed communication = communication − overlapped: the time a rank spent only communicating.

For each communication kernel whose collective metadata is in the trace (``record_param_comms``'s
"Collective name", "In/Out msg nelems", "dtype", "Group size", on the kernel or on the CPU op with the
same "External id"), the kernel's algbw and busbw (nccl-tests factors, GB = 1e9) are listed too.
"""

from __future__ import annotations

import json
import re
import sys

from distlab.comm import bus_factor
from distlab.bench import StudyParser, run_study

COMM = re.compile(r"nccl|gloo|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|send_?recv", re.I)
COLLECTIVE_OPS = {"allreduce": "all_reduce", "all_reduce": "all_reduce", "allgather": "all_gather",
                  "all_gather": "all_gather", "_allgather_base": "all_gather", "all_gather_into_tensor": "all_gather",
                  "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
                  "reduce_scatter_tensor": "reduce_scatter", "all_to_all": "all_to_all", "all_to_allv": "all_to_all",
                  "alltoall": "all_to_all", "alltoall_base": "all_to_all", "broadcast": "broadcast",
                  "send": "sendrecv", "recv": "sendrecv"}
DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
               "int": 4, "int32": 4, "long": 8, "int64": 8, "char": 1, "byte": 1, "int8": 1, "uint8": 1}


def union(intervals):
    """Merge (start, end) intervals; returns a sorted list of disjoint intervals."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def intersection(a, b):
    """Intersection of two disjoint sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def load_events(path):
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


KERNEL_OPS = {"allreduce": ("all_reduce",), "allgather": ("all_gather",), "reducescatter": ("reduce_scatter",),
              "broadcast": ("broadcast",), "sendrecv": ("sendrecv", "all_to_all")}


def _metadata(kernel, by_ext, metas):
    """The collective metadata of a kernel: on itself; or on the innermost ``record_param_comms`` that
    encloses the CPU op which launched it (through the kernel's "External id"); or, for kernels NCCL
    launched itself (no External id), the last matching collective recorded before the kernel started."""
    args = kernel.get("args") or {}
    if "Collective name" in args:
        return args
    launcher = by_ext.get(args.get("External id"))
    if launcher is None:
        name = kernel["name"].lower().replace("_", "")
        ops = next((v for k, v in KERNEL_OPS.items() if k in name), ())
        before = [m for m in metas if m["ts"] <= kernel["ts"]
                  and COLLECTIVE_OPS.get(str(m["args"]["Collective name"]).lower()) in ops]
        return max(before, key=lambda m: m["ts"])["args"] if before else None
    if "Collective name" in (launcher.get("args") or {}):
        return launcher["args"]
    s, e = launcher["ts"], launcher["ts"] + launcher["dur"]
    around = [m for m in metas if m["ts"] <= s and m["ts"] + m["dur"] >= e]
    return min(around, key=lambda m: m["dur"])["args"] if around else None


def collective_bandwidths(events, chosen):
    """algbw/busbw of each communication event that carries (or points to) collective metadata."""
    by_ext, metas = {}, []
    for e in events:
        args = e.get("args") or {}
        if e.get("cat") in ("cpu_op", "user_annotation") and "External id" in args:
            by_ext.setdefault(args["External id"], e)
        if str(args.get("Collective name", "wait")).lower() not in ("wait", "barrier"):
            metas.append(e)
    rows = []
    for e in chosen:
        if not is_comm(e["name"]) or e["dur"] <= 0:
            continue
        meta = _metadata(e, by_ext, metas)
        if not meta:
            continue
        op = COLLECTIVE_OPS.get(str(meta["Collective name"]).lower())
        elem = DTYPE_BYTES.get(str(meta.get("dtype", "")).lower())
        n = int(meta.get("Group size", 1) or 1)
        if op is None or elem is None:
            continue
        size = max(int(meta.get("In msg nelems", 0)), int(meta.get("Out msg nelems", 0))) * elem
        algbw = size / (e["dur"] * 1e-6) / 1e9
        rows.append({"name": e["name"][:60], "op": op, "bytes": size, "ranks": n, "time_us": e["dur"],
                     "algbw": algbw, "busbw": algbw * bus_factor(op, n)})
    return rows


PHASE = re.compile(r"^(comm|compute|ring|ulysses|usp|moe|tp)\.")
COMM_PHASE = re.compile(r"^comm\.|\.(exchange|wait|all_to_all|dispatch|combine)$")


def is_comm(name: str) -> bool:
    if PHASE.match(name):
        return bool(COMM_PHASE.search(name))
    return bool(COMM.search(name))


def analyse_events(events, use="auto") -> dict:
    """Overlap figures (µs) for one rank's complete events."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    phases = [e for e in events if e.get("cat") == "user_annotation" and PHASE.match(e["name"])]
    if use == "auto":
        use = "kernel" if kernels else "phases" if phases else "cpu"
    if use == "kernel":
        chosen, source = kernels, "gpu kernels"
    elif use == "phases":
        chosen, source = phases, "phases"
    else:
        chosen = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")
                  and not e["name"].startswith("ProfilerStep")]
        source = "cpu ops"
    comm = union((e["ts"], e["ts"] + e["dur"]) for e in chosen if is_comm(e["name"]))
    compute = union((e["ts"], e["ts"] + e["dur"]) for e in chosen if not is_comm(e["name"]))
    both = length(intersection(compute, comm))
    t_comm, t_compute = length(comm), length(compute)
    return {"source": source, "compute_us": t_compute, "comm_us": t_comm, "overlapped_us": both,
            "overlap_pct": 100.0 * both / t_comm if t_comm else 0.0, "exposed_comm_us": t_comm - both,
            "collectives": collective_bandwidths(events, chosen)}


def analyse(paths, use="auto") -> list[dict]:
    return [{"trace": p, **analyse_events(load_events(p), use)} for p in paths]


def report(results) -> str:
    lines = [f"{'trace':<40} {'source':<12} {'compute ms':>11} {'comm ms':>9} {'overlap ms':>11} {'overlap %':>10} "
             f"{'exposed comm ms':>16}"]
    for r in results:
        lines.append(f"{r['trace'][-40:]:<40} {r['source']:<12} {r['compute_us'] / 1e3:>11.3f} {r['comm_us'] / 1e3:>9.3f} "
                     f"{r['overlapped_us'] / 1e3:>11.3f} {r['overlap_pct']:>9.1f}% {r['exposed_comm_us'] / 1e3:>16.3f}")
    for r in results:
        if r["collectives"]:
            lines.append(f"\ncollectives in {r['trace']}:")
            lines.append(f"  {'op':<15} {'bytes':>12} {'ranks':>5} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}  kernel")
            for c in r["collectives"]:
                lines.append(f"  {c['op']:<15} {c['bytes']:>12} {c['ranks']:>5} {c['time_us']:>10.1f} {c['algbw']:>11.2f} "
                             f"{c['busbw']:>11.2f}  {c['name']}")
    return "\n".join(lines)


def main(argv=None):
    p = StudyParser(prog="python -m distlab.profiling.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="Chrome/Perfetto trace JSON files, one per rank")
    p.add_argument("--use", choices=("auto", "kernel", "phases", "cpu"), default="auto",
                   help="which events to analyse (see above)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    try:
        results = analyse(args.traces, args.use)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot read trace: {e}", file=sys.stderr)
        sys.exit(2)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    run_study(main)
