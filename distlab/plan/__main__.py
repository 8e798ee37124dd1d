"""``python -m distlab.plan``: which layout, on my cluster? Every valid TP × CP × DP layout, predicted and ranked.

    python -m distlab.plan --model llama3-8b --seq 131072 --cluster 2x8 --intra nvlink4 --inter ib-ndr400
    python -m distlab.plan --config configs/small.json --seq 65536 --docs lognormal:mean=4096,seed=0 --cluster 8
    python -m distlab.plan --links                                 # the link table and its sources

For a model (a preset below, a distlab config, or a checkpoint folder), a sequence length (or a document
mix, ``--docs`` as in the CP studies), a global batch (default: one sequence per data-parallel rank) and a
cluster (nodes × GPUs per node, the intra- and inter-node links), it predicts each layout's step time —
compute, and the communication left exposed — memory per GPU, tokens/s per GPU and MFU
(``distlab.plan.step``), ranks the layouts that fit by tokens/s, prints the best ``--top`` with what
makes each fast or slow, and writes everything with ``--json``.

Compute comes from a calibration file measured on a real GPU (``distlab.plan.calibration``; the H200's
ships in ``distlab/plan/calibrations/``). ``--gpu`` names the cluster's GPU; a calibration from another
GPU is refused. A layout whose kernels fall outside the calibrated sizes is marked "extrapolated".
"""

from __future__ import annotations

import dataclasses
import itertools
import os

from distlab.bench import StudyParser, positive_int, run_study, write_json
from distlab.model.config import ModelConfig, load_config
from distlab.plan.calibration import Calibration
from distlab.plan.links import load_links, parse_cluster
from distlab.plan.model import Kernels
from distlab.plan.step import FIT_SHARE, Plan, step

CALIBRATIONS = os.path.join(os.path.dirname(__file__), "calibrations")
PRESETS = {   # published configs (Meta's and Mistral's config.json)
    "llama3-8b": dict(vocab=128256, layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336),
    "llama3-70b": dict(vocab=128256, layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672),
    "mixtral-8x7b": dict(vocab=32000, layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, moe_experts=8, moe_topk=2),
}
GPUS = {"h200": ("NVIDIA H200", 141e9)}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg: ModelConfig, world: int, gpus_per_node: int, seq: int, batch: int | None, acs, zeros, methods):
    """Every layout the model and the sequence allow (tp inside a node, heads divisible by tp·ulysses)."""
    for tp in divisors(world):
        if tp > gpus_per_node or cfg.heads % tp or cfg.hidden % tp or cfg.ffn % tp or cfg.vocab % tp:
            continue
        for cp in divisors(world // tp):
            dp = world // (tp * cp)
            if batch is not None and batch % dp:
                continue
            for method in (methods if cp > 1 else ["none"]):
                splits = {"ring": [(1, cp)], "allgather": [(1, cp)], "ulysses": [(cp, 1)], "none": [(1, 1)],
                          "usp": [(u, cp // u) for u in divisors(cp) if 1 < u < cp]}[method]
                for u, r in splits:
                    if (cfg.heads // tp) % u or seq % (2 * r * u if method != "ulysses" else u):
                        continue
                    for zero, ac in itertools.product(zeros if dp * cp > 1 else [0], acs):
                        shards = [dp] if dp * tp * cp <= gpus_per_node or dp == 1 else sorted(
                            {dp, max(1, min(dp, gpus_per_node // (tp * cp)))})
                        for shard in (shards if zero else [dp]):
                            if dp % shard:
                                continue
                            yield Plan(tp, u, r, method, shard, dp // shard, zero, ac)


def reasons(row: dict, best: dict | None) -> str:
    """What sets this layout's time: its compute, its largest exposed collective and where it runs."""
    pl = row["per_layer"]
    parts = [f"compute {row['compute_s'] * 1e3:.0f} ms", f"exposed comm {row['exposed_comm_s'] * 1e3:.0f} ms "
             f"of {row['comm_s'] * 1e3:.0f}"]
    a = pl["attention_fwd"]
    if a["comm"]:
        hidden = 1 - a["exposed"] / a["comm"]
        parts.append(f"attention comm {hidden * 100:.0f}% hidden")
    links = row["links"]
    plan = row["plan"]
    used = [f"{n} over {links[n]}" for n, deg in (("tp", plan["tp"]), ("ulysses", plan["ulysses"]), ("ring", plan["ring"]))
            if deg > 1]
    if used:
        parts.append(", ".join(used))
    if best is not None and best is not row:
        parts.append(f"{(row['step_s'] / best['step_s'] - 1) * 100:+.0f}% step vs #1")
    return "; ".join(parts)


def table(rows, top) -> list[str]:
    lines = [f"{'#':>3} {'layout':<44} {'step s':>8} {'exposed':>8} {'tok/s/GPU':>10} {'MFU':>6} {'mem GB':>7}"]
    for i, r in enumerate(rows[:top]):
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-"
        lines.append(f"{i + 1:>3} {r['layout']:<44} {r['step_s']:>8.3f} {r['exposed_comm_s']:>8.3f} "
                     f"{r['tokens_per_s_per_gpu']:>10.0f} {mfu:>6} {r['memory']['total'] / 1e9:>7.1f}"
                     f"{'  extrapolated: ' + ','.join(r['extrapolated']) if r['extrapolated'] else ''}")
        lines.append(f"{'':>4}{reasons(r, rows[0])}")
    return lines


def check_degrees(cfg: ModelConfig, cluster, a) -> None:
    """``--tp`` / ``--cp`` that cannot divide the cluster, the heads or the sequence: refused by name."""
    if a.tp and (cluster.world % a.tp or cfg.heads % a.tp or cfg.hidden % a.tp or cfg.ffn % a.tp):
        raise ValueError(f"--tp {a.tp} must divide the {cluster.world} GPUs, the {cfg.heads} heads, hidden "
                         f"{cfg.hidden} and ffn {cfg.ffn}")
    if a.tp and a.tp > cluster.gpus_per_node:
        raise ValueError(f"--tp {a.tp} spans nodes ({cluster.gpus_per_node} GPUs each): the planner keeps TP in a node")
    if a.cp and (cluster.world % (a.cp * (a.tp or 1)) or a.seq % a.cp):
        raise ValueError(f"--cp {a.cp} must divide the {cluster.world // (a.tp or 1)} GPUs TP leaves and the "
                         f"sequence {a.seq}")


def build_config(a) -> ModelConfig:
    if a.model:
        if a.model not in PRESETS:
            raise ValueError(f"unknown --model {a.model!r}; presets: {', '.join(PRESETS)} (or --config FILE)")
        return ModelConfig(**PRESETS[a.model])
    if a.config:
        return load_config(a.config)[0]
    raise ValueError("give --model PRESET or --config FILE")


def calibration_for(a, gpu_name: str) -> Calibration:
    path = a.calibration or os.path.join(CALIBRATIONS, f"{a.gpu}.json")
    if not os.path.exists(path):
        raise ValueError(f"no calibration for --gpu {a.gpu}: run python -m distlab.plan.calibration --out FILE "
                         f"on that GPU and pass --calibration FILE")
    cal = Calibration.load(path)
    cal.check_device(gpu_name)
    return cal


def parse_args(argv=None):
    p = StudyParser(prog="python -m distlab.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--config", default=None, help="a distlab config (preset name, JSON file or checkpoint folder)")
    p.add_argument("--seq", type=positive_int, default=8192)
    p.add_argument("--docs", default=None, help="packed documents, as the CP studies take them")
    p.add_argument("--window", type=positive_int, default=None)
    p.add_argument("--batch", type=positive_int, default=None, help="global sequences per step (default: one per dp rank)")
    p.add_argument("--cluster", default="8", help="NODESxGPUS (2x8) or GPUS")
    p.add_argument("--intra", default="nvlink4")
    p.add_argument("--inter", default="ib-ndr400")
    p.add_argument("--link-table", default=None, help="JSON of more links: {name: {alpha_us, busbw_gbs, source}}")
    p.add_argument("--gpu", default="h200", help="the cluster's GPU (its calibration: --calibration or the shipped one)")
    p.add_argument("--calibration", default=None)
    p.add_argument("--ac", default="none,selective,full")
    p.add_argument("--zero", default="0,3", help="ZeRO levels to consider (0: DDP)")
    p.add_argument("--methods", default="ring,ulysses,usp,allgather")
    p.add_argument("--async-tp", action="store_true", help="TP's collectives overlapped with its GEMMs (distlab.tp.async_tp)")
    p.add_argument("--tp", type=positive_int, default=None, help="only this TP degree")
    p.add_argument("--cp", type=positive_int, default=None, help="only this CP degree (Ulysses x ring)")
    p.add_argument("--top", type=positive_int, default=5)
    p.add_argument("--links", action="store_true", help="print the link table and exit")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def plan(a) -> dict:
    links = load_links(a.link_table)
    if a.links:
        return {"links": {n: {"alpha_us": l.alpha_us, "busbw_gbs": l.busbw_gbs, "source": l.source}
                          for n, l in links.items()}}
    cfg = build_config(a)
    cluster = parse_cluster(a.cluster, a.intra, a.inter, links)
    gpu_name, capacity = GPUS.get(a.gpu, (a.gpu, None))
    cal = calibration_for(a, gpu_name)
    capacity = cal.data.get("memory_bytes", capacity)
    from distlab.cp.documents import Documents, parse_docs

    docs = Documents.from_args(a.seq, parse_docs(a.docs, a.seq), True, a.window) if a.docs or a.window else None
    methods = a.methods.split(",")
    bad = set(methods) - {"ring", "ulysses", "usp", "allgather"}
    if bad:
        raise ValueError(f"unknown --methods {sorted(bad)}: ring, ulysses, usp, allgather")
    acs, zeros = a.ac.split(","), [int(z) for z in a.zero.split(",")]
    if set(acs) - {"none", "selective", "full"} or set(zeros) - {0, 1, 2, 3}:
        raise ValueError(f"--ac {a.ac} / --zero {a.zero}: activation checkpointing none, selective, full; ZeRO 0-3")
    check_degrees(cfg, cluster, a)
    shape = cal.data.get("attention_shape", {})
    note = None
    if shape and shape.get("head_dim") != cfg.dims_per_head:
        note = f"attention(head_dim {cfg.dims_per_head}; calibrated at {shape.get('head_dim')})"
    rows = []
    for pl in layouts(cfg, cluster.world, cluster.gpus_per_node, a.seq, a.batch, acs, zeros, methods):
        if (a.tp and pl.tp != a.tp) or (a.cp and pl.cp != a.cp):
            continue
        pl = dataclasses.replace(pl, async_tp=a.async_tp and pl.tp > 1)
        batch = a.batch or pl.dp
        r = step(cfg, pl, cluster, Kernels(cal), a.seq, batch, docs)
        r["fits"] = capacity is None or r["memory"]["total"] <= FIT_SHARE * capacity
        r["extrapolated"] += [note] if note else []
        rows.append(r)
    if not rows:
        raise ValueError(f"no layout of {cluster.world} GPUs fits this model and sequence (heads {cfg.heads}, "
                         f"seq {a.seq}, batch {a.batch}): check the degrees divide")
    rows.sort(key=lambda r: (not r["fits"], -r["tokens_per_s_per_gpu"]))
    return {"model": vars(cfg), "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
            "intra": cluster.intra.name, "inter": cluster.inter.name}, "seq": a.seq, "docs": a.docs,
            "calibration": {"device": cal.device, "date": cal.data["date"], "path": cal.path},
            "capacity_bytes": capacity, "rows": rows}


def main(argv=None):
    a = parse_args(argv)
    out = plan(a)
    if a.links:
        for n, l in out["links"].items():
            print(f"{n:<12} α {l['alpha_us']:>5.1f} us  busbw {l['busbw_gbs']:>6.1f} GB/s  {l['source']}")
        return
    rows = out["rows"]
    fits = [r for r in rows if r["fits"]]
    c = out["cluster"]
    print(f"{a.model or a.config} · seq {a.seq}{' · docs ' + a.docs if a.docs else ''} · {c['nodes']}x{c['gpus_per_node']} "
          f"GPUs ({c['intra']} inside, {c['inter']} across) · calibration {out['calibration']['device']} "
          f"{out['calibration']['date']}")
    print(f"{len(rows)} layouts, {len(fits)} fit in {FIT_SHARE:.0%} of "
          f"{(out['capacity_bytes'] or 0) / 1e9:.0f} GB; best {min(a.top, len(fits))} by tokens/s per GPU:")
    print("\n".join(table(fits or rows, a.top)))
    if not fits:
        print("none fits: the rows above need more memory than the GPU has")
    if any(r["extrapolated"] for r in rows[:a.top]):
        print("extrapolated: some kernel calls fall outside the calibrated sizes (the end rate is held)")
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    run_study(main)
