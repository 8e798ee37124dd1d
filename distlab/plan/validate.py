"""Check the planner against what this machine can run: calibrate, run the studies on gloo, compare.

    python -m distlab.plan.validate --json docs/perf/plan/validate_cpu.json          # ~17 min on 2 cores
    python -m distlab.plan.validate --worlds 2 --studies zigzag --seq 2048 --quick      # the test's case
    python -m distlab.plan.validate --measured out/parity_*_bf16.json --link nvlink4   # GPUs: predicted vs run

Steps: (1) calibrate this CPU's kernels with one thread per process (``distlab.plan.calibration``), (2)
calibrate the gloo loopback at each W (the playground's sweep, α and busbw per collective), (3) run each
study (``distlab run --nproc W -m ...  --json``), (4) predict the same study with the planner's cost model
(``distlab.plan.model``: the same functions the cluster planner uses) and print predicted against measured,
forward and forward+backward, with the ratio, and per W whether the CP methods rank the same.

The sharing of this machine is modelled, not hidden: W processes with one thread each on C cores run at
``max(1, W/C)`` times the rate measured with C processes busy at once (the calibration runs its kernels on
C processes together: memory-bandwidth contention is in the rates; every study process runs one thread,
as ``distlab run`` sets OMP_NUM_THREADS = cores // W, at least 1), and gloo's copies run on the same cores,
so on a CPU no communication is hidden (``Link.overlaps_compute`` False).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

from distlab.bench import StudyParser, positive_int, run_study, write_json
from distlab.plan.calibration import Calibration
from distlab.plan.model import AttnShape, Kernels, attention_cost, block_cost, moe_cost, ring_cost

CP_STUDIES = {"ring": ("distlab.cp.ring", ["--layout", "contiguous"]), "zigzag": ("distlab.cp.ring", ["--layout", "zigzag"]),
              "ulysses": ("distlab.cp.ulysses", []), "usp": ("distlab.cp.usp", []),
              "allgather": ("distlab.cp.allgather", [])}
STUDIES = tuple(CP_STUDIES) + ("tp", "ep")
CPU_HEADS = 4    # the CP studies' CPU default (distlab.cp.study); kv heads 2


def _run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return out.stdout


def calibrate(path, worlds, cores, quick):
    """Kernels timed on ``cores`` processes at once (one thread each), then gloo at every W."""
    extra = ["--quick"] if quick else []
    loaded = max(2, cores)
    _run(["distlab", "run", "--nproc", str(loaded), "-m", "distlab.plan.calibration", "--device", "cpu", "--kernels",
          "--threads", "1", "--out", path] + extra)
    for w in worlds:
        if w != loaded:
            _run(["distlab", "run", "--nproc", str(w), "-m", "distlab.plan.calibration", "--links-only", "--out", path]
                 + extra)


def cp_heads(w: int) -> int:
    """The CP studies' heads at W ranks: the CPU default (4), or W where Ulysses needs more (W=8: 8 heads
    for every CP method, so they still compare like with like)."""
    return max(CPU_HEADS, w)


def study_command(study, w, a, json_path):
    common = ["--iters", str(a.iters), "--json", json_path] + (["--warmup", "2"] if study != "ep" else [])
    if study in CP_STUDIES:
        module, extra = CP_STUDIES[study]
        if study == "usp":
            extra = ["--ulysses", "2", "--ring", str(w // 2)]
        return ["distlab", "run", "--nproc", str(w), "-m", module, "--seq", str(a.seq), "--no-baseline",
                "--heads", str(cp_heads(w)), "--kv-heads", "2"] + extra + common
    if study == "tp":
        return ["distlab", "run", "--nproc", str(w), "-m", "distlab.tp", "--hidden", str(a.hidden), "--ffn",
                str(a.ffn), "--heads", "8", "--kv-heads", "2", "--seq", str(a.tp_seq), "--sp"] + common
    return ["distlab", "run", "--nproc", str(w), "-m", "distlab.moe", "--experts", str(2 * w), "--topk", "2",
            "--hidden", str(a.hidden), "--ffn", str(a.ffn), "--tokens", str(a.tokens)] + common


def measured(study, result) -> tuple[float, float]:
    if study in CP_STUDIES:
        return result["slowest"]["fwd_s"], result["slowest"]["fwd_bwd_s"]
    if study == "tp":
        return max(r["fwd_s"] for r in result["ranks"]), max(r["fwd_bwd_s"] for r in result["ranks"])
    return result["results"][0]["fwd_s"], result["results"][0]["fwd_bwd_s"]


def study_of(result) -> str:
    """Which study wrote this JSON: a CP method (ring/zigzag by layout), tp or ep."""
    if "algorithm" in result:
        alg = result["algorithm"]
        return ("zigzag" if result["args"]["layout"] == "zigzag" else "ring") if alg == "ring" else alg
    return "tp" if "tp" in result else "ep"


def world_of(result) -> int:
    return result.get("world_size") or result.get("tp") or result.get("ep")


def predict(study, w, result, cal: Calibration, cores: int, link=None):
    """(fwd, fwd+bwd) seconds and the kernels extrapolated, for a study's own arguments at W ranks; ``link``
    None: this CPU's calibrated gloo at W (sharing the cores), else that link on GPUs."""
    a = result["args"]
    if link is None:
        threads = max(1, cores // w)
        loaded = cal.data.get("concurrent_processes", 1) * (cal.data.get("threads") or 1)   # busy while calibrating
        k = Kernels(cal, slowdown=max(1.0, w * threads / max(loaded, cores)), itemsize=4, cores=cores)
        link = cal.links()[f"gloo-W{w}"]
    else:
        from distlab.bench import DTYPES

        k = Kernels(cal, itemsize=DTYPES[a["dtype"]].itemsize)
    if study in CP_STUDIES:
        shape = AttnShape(a["batch"], a["seq"], a["heads"], a["kv_heads"], a["head_dim"], k.itemsize, a["causal"],
                          layout=a.get("layout", "contiguous"))
        method = {"ring": "ring", "zigzag": "ring"}.get(study, study)
        u, r = {"ulysses": (w, 1), "usp": (a.get("ulysses") or 2, w // (a.get("ulysses") or 2))}.get(study, (1, w))
        f, b = attention_cost(method, shape, k, link, link, ulysses=u, ring=r)
    elif study == "tp":
        heads, kv, d = a["heads"], a["kv_heads"], a["hidden"] // a["heads"]
        shape = AttnShape(a["batch"], a["seq"], heads, kv, d, k.itemsize, True, layout="contiguous")
        attn = ring_cost(shape, 1, heads // w, max(1, kv // w), k, link)
        f, b = block_cost(a["batch"] * a["seq"], {"hidden": a["hidden"], "heads": heads, "kv_heads": kv,
                                                  "head_dim": d, "ffn": a["ffn"]}, w, a["sp"], attn, k, link)
    else:
        f, b = moe_cost(a["tokens"], a["hidden"], a["ffn"], a["experts"], a["topk"], w, k, link,
                        imbalance=result["results"][0]["imbalance"])   # the routing's own skew, an input
    return f.total, f.total + b.total, sorted(k.extrapolated)


def main(argv=None):
    p = StudyParser(prog="python -m distlab.plan.validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--studies", default=",".join(STUDIES))
    p.add_argument("--seq", type=positive_int, default=8192, help="CP studies' sequence")
    p.add_argument("--tp-seq", type=positive_int, default=2048)
    p.add_argument("--hidden", type=positive_int, default=512)
    p.add_argument("--ffn", type=positive_int, default=1536)
    p.add_argument("--tokens", type=positive_int, default=4096, help="EP study: tokens per rank")
    p.add_argument("--iters", type=positive_int, default=5)
    p.add_argument("--calibration", default=None, help="reuse this file (default: calibrate now)")
    p.add_argument("--quick", action="store_true", help="fewer calibration sizes (tests)")
    p.add_argument("--json", default=None)
    p.add_argument("--measured", nargs="+", default=None, metavar="JSON",
                   help="predict these study JSONs (written on GPUs) with --calibration and --link instead")
    p.add_argument("--link", default="nvlink4", help="with --measured: the GPUs' link (distlab.plan.links)")
    a = p.parse_args(argv)
    if a.measured:
        return predict_measured(a)
    worlds = [int(w) for w in a.worlds.split(",")]
    studies = a.studies.split(",")
    unknown = set(studies) - set(STUDIES)
    if unknown:
        raise ValueError(f"unknown studies {sorted(unknown)}; choose from {', '.join(STUDIES)}")
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        cal_path = a.calibration or os.path.join(tmp, "cpu.json")
        if a.calibration is None:
            print(f"calibrating this CPU ({cores} cores) and gloo at W = {a.worlds} ...", flush=True)
            calibrate(cal_path, worlds, cores, a.quick)
        cal = Calibration.load(cal_path)
        rows = []
        for w in worlds:
            for study in studies:
                if study == "usp" and w < 4:
                    continue      # USP needs Ulysses and ring both > 1
                path = os.path.join(tmp, f"{study}{w}.json")
                _run(study_command(study, w, a, path))
                with open(path) as f:
                    result = json.load(f)
                mf, mfb = measured(study, result)
                pf, pfb, extra = predict(study, w, result, cal, cores)
                rows.append({"study": study, "world": w, "measured_fwd_s": mf, "measured_fwd_bwd_s": mfb,
                             "predicted_fwd_s": pf, "predicted_fwd_bwd_s": pfb, "extrapolated": extra})
                print(line(rows[-1]), flush=True)
        calibration = cal.data
    ranking = rank_agreement(rows)
    print(report(rows, ranking))
    if a.json:
        write_json(a.json, {"args": vars(a), "cores": cores, "rows": rows, "ranking": ranking,
                            "calibration": calibration})


def predict_measured(a):
    """``--measured``: the planner's prediction next to each study a multi-GPU run wrote."""
    from distlab.plan.links import LINKS

    import glob

    cal = Calibration.load(a.calibration or os.path.join(os.path.dirname(__file__), "calibrations", "h200.json"))
    if a.link not in LINKS:
        raise ValueError(f"unknown --link {a.link!r}; known: {', '.join(LINKS)}")
    rows = []
    for path in [p for pattern in a.measured for p in sorted(glob.glob(pattern))]:
        with open(path) as f:
            result = json.load(f)
        study, w = study_of(result), world_of(result)
        if not str(result.get("device", "")).startswith("cuda"):
            raise ValueError(f"{path} was measured on {result.get('device')!r}: --measured predicts GPU runs "
                             f"(on a CPU, run python -m distlab.plan.validate without --measured)")
        mf, mfb = measured(study, result)
        pf, pfb, extra = predict(study, w, result, cal, 0, LINKS[a.link])
        rows.append({"file": os.path.basename(path), "study": study, "world": w, "measured_fwd_s": mf,
                     "measured_fwd_bwd_s": mfb, "predicted_fwd_s": pf, "predicted_fwd_bwd_s": pfb,
                     "extrapolated": extra})
    if not rows:
        raise ValueError(f"--measured {' '.join(a.measured)}: no such files")
    print(report(rows, rank_agreement(rows)))
    if a.json:
        write_json(a.json, {"calibration": cal.path, "link": a.link, "rows": rows})


def line(r) -> str:
    return (f"{r['study']:<10} {r['world']:>2} {r['predicted_fwd_s'] * 1e3:>9.1f} {r['measured_fwd_s'] * 1e3:>9.1f} "
            f"{r['predicted_fwd_s'] / r['measured_fwd_s']:>6.2f} {r['predicted_fwd_bwd_s'] * 1e3:>9.1f} "
            f"{r['measured_fwd_bwd_s'] * 1e3:>9.1f} {r['predicted_fwd_bwd_s'] / r['measured_fwd_bwd_s']:>6.2f}"
            f"{'  (extrapolated: ' + ', '.join(r['extrapolated']) + ')' if r['extrapolated'] else ''}")


def rank_agreement(rows) -> dict:
    """Per W, the CP methods ordered by predicted and by measured forward+backward time."""
    out = {}
    for w in sorted({r["world"] for r in rows}):
        cp = [r for r in rows if r["world"] == w and r["study"] in CP_STUDIES]
        pred = [r["study"] for r in sorted(cp, key=lambda r: r["predicted_fwd_bwd_s"])]
        meas = [r["study"] for r in sorted(cp, key=lambda r: r["measured_fwd_bwd_s"])]
        out[str(w)] = {"predicted": pred, "measured": meas, "same_best": pred[:1] == meas[:1], "same_order": pred == meas}
    return out


def report(rows, ranking) -> str:
    lines = ["", f"{'study':<10} {'W':>2} {'pred fwd':>9} {'meas fwd':>9} {'ratio':>6} {'pred f+b':>9} "
                 f"{'meas f+b':>9} {'ratio':>6}   (ms; ratio = predicted / measured)"]
    lines += [line(r) for r in rows]
    worst = max(max(abs(r["predicted_fwd_s"] / r["measured_fwd_s"] - 1), abs(r["predicted_fwd_bwd_s"] / r["measured_fwd_bwd_s"] - 1))
                for r in rows)
    within = sum(abs(r["predicted_fwd_bwd_s"] / r["measured_fwd_bwd_s"] - 1) <= 0.25 for r in rows)
    lines.append(f"forward+backward within 25%: {within} of {len(rows)}; worst error (fwd or f+b) {worst * 100:.0f}%")
    for w, rk in ranking.items():
        lines.append(f"W={w}: predicted order {' < '.join(rk['predicted'])}; measured {' < '.join(rk['measured'])}"
                     f" ({'same order' if rk['same_order'] else 'same best' if rk['same_best'] else 'different best'})")
    return "\n".join(lines)


if __name__ == "__main__":
    run_study(main)
