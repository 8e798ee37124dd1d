"""What a real ring pays that an emulated rank does not: the K/V and dK/dV hops left exposed (#24).

    python -m distlab.plan.ring_tail --world 8 --seq 8192 32768 --link nvlink4 --json docs/perf/plan/ring_tail.json

``distlab.cp.emulate`` times one rank's kernels with every K/V shard resident: no hop is paid. A ring over
NVLink pays the hops its compute cannot hide — above all the dK/dV of the last launch group, which by the
ring's route go rank to rank, one hop a step of the group, then home, after the last kernel
(``distlab.cp.ring_fused``), and by the direct route (``distlab.cp.ring_dkv_direct``) leave at once. For
each launch grouping and route this prints the planner's exposed communication (``distlab.plan.model.
ring_cost``: link α + bytes / busbw, nccl-tests' model; bytes as ``distlab.cp.cost`` and ``direct_bytes``
count them), forward and backward, and the backward's dK/dV bytes. The compute that hides the other hops
comes from the calibration (the H200's ships; its attention kernels are slower than FA4's, so on FA4 blocks
less is hidden than printed here — the last group's hops are exposed either way). A prediction, not a
measurement: no machine with several GPUs has been lent to time a ring.
"""

from __future__ import annotations

import os

from distlab.bench import StudyParser, positive_int, run_study, write_json
from distlab.plan.calibration import Calibration
from distlab.plan.links import load_links
from distlab.plan.model import AttnShape, Kernels, ring_cost

# (launch groups, dK/dV route, bytes an element of a direct share): one step a launch; FA4's default groups
# (1 | 3 | 4 at W=8) by either route — folded blocks' shares in bf16, others in FA4's float32 accumulator
# layout; and groups whose last is short
CASES = [(None, "ring", None), (4, "ring", None), (4, "direct", 2), (4, "direct", 4),
         ("1,5,2", "ring", None), ("1,5,2", "direct", 2), ("1,6,1", "ring", None), ("1,6,1", "direct", 2)]


def rows_for(world, seq, heads, kv_heads, head_dim, k, link, cases=CASES) -> list[dict]:
    shape = AttnShape(1, seq, heads, kv_heads, head_dim, layout="zigzag")
    rows = []
    for groups, route, share in cases:
        spl = tuple(int(x) for x in groups.split(",")) if isinstance(groups, str) else groups
        if isinstance(spl, tuple) and sum(spl) != world:
            continue
        f, b = ring_cost(shape, world, heads, kv_heads, k, link, steps_per_launch=spl, dkv_route=route,
                         share_itemsize=share)
        rows.append({"seq": seq, "groups": groups if groups is not None else "1 a launch", "route": route,
                     "share_bytes_per_element": share or 4, "fwd_compute_ms": f.compute * 1e3,
                     "fwd_exposed_ms": f.exposed * 1e3, "bwd_compute_ms": b.compute * 1e3,
                     "bwd_comm_ms": b.comm * 1e3, "bwd_exposed_ms": b.exposed * 1e3,
                     "exposed_ms": (f.exposed + b.exposed) * 1e3})
    return rows


def main(argv=None):
    p = StudyParser(prog="python -m distlab.plan.ring_tail", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=positive_int, default=8)
    p.add_argument("--seq", type=positive_int, nargs="+", default=[8192, 32768])
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--link", default="nvlink4", help="a link of `python -m distlab.plan --links`")
    p.add_argument("--links-file", default=None, help="your own link table (JSON), as distlab.plan takes it")
    p.add_argument("--calibration", default=None, help="default: the shipped H200 calibration")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from distlab.plan.__main__ import CALIBRATIONS

    links = load_links(a.links_file)
    if a.link not in links:
        p.error(f"unknown link {a.link!r}; known: {', '.join(links)}")
    for seq in a.seq:
        if seq % (2 * a.world):
            p.error(f"--seq {seq} must divide into 2 x {a.world} zigzag chunks")
    cal = Calibration.load(a.calibration or os.path.join(CALIBRATIONS, "h200.json"))
    k, link = Kernels(cal), links[a.link]
    rows = [r for seq in a.seq for r in rows_for(a.world, seq, a.heads, a.kv_heads, a.head_dim, k, link)]
    print(f"W={a.world} zigzag, {a.heads} q / {a.kv_heads} kv heads, D{a.head_dim}, link {link.name} "
          f"(α {link.alpha_us:g} µs, busbw {link.busbw_gbs:g} GB/s); compute: {cal.device} calibration")
    print(f"{'seq':>6} {'groups':>10} {'route':>6} {'share B':>7} {'fwd exposed':>12} {'bwd exposed':>12} "
          f"{'bwd comm':>9} {'bwd compute':>12}   ms")
    for r in rows:
        print(f"{r['seq']:>6} {r['groups']:>10} {r['route']:>6} {r['share_bytes_per_element']:>7} "
              f"{r['fwd_exposed_ms']:>12.3f} {r['bwd_exposed_ms']:>12.3f} {r['bwd_comm_ms']:>9.3f} "
              f"{r['bwd_compute_ms']:>12.3f}")
    if a.json:
        write_json(a.json, {"world": a.world, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
                            "link": {"name": link.name, "alpha_us": link.alpha_us, "busbw_gbs": link.busbw_gbs,
                                     "source": link.source},
                            "calibration": {"device": cal.device, "date": cal.data["date"]}, "rows": rows})


if __name__ == "__main__":
    run_study(main)
