"""The planner configured as published runs' hardware, next to their published numbers.

    python -m distlab.plan.published --json docs/perf/plan/published.json

- **ring-flash-attention, 8×H800** (its README; ``benchmark/benchmark_kvpacked_func.py``): Llama-3-8B
  attention (32 heads, 8 kv heads, head_dim 128, bf16, causal), 8k tokens per GPU (64k in all), batch 1.
  Efficiency = 8 × T(FlashAttention on one GPU's 8k) / T(ring over 64k). Published: ring fwd 52.1%,
  fwd+bwd 53.9%; zigzag 85.2% / 90.2%. Configured as: the H200 calibration's attention rates (H800 has
  H100's SMs and clocks; attention is compute-bound, so the ratio barely depends on HBM), link ``nvlink-h800``.
- **torchtitan, Llama 3.1 8B on 8×H100** (``benchmarks/llama3_h100_202412_torchtitan.md``, 2024-12):
  FSDP 8, local batch 2, seq 8192, selective AC, bf16, no compile: 5,762 tokens/s/GPU, 82.4 GiB.
  Configured as: the H200 calibration with memory-bound rates scaled to their 2.4 TB/s HBM2e (H200: 4.8),
  compute at SXM rates (their GPUs ran at 500 W, between SXM and NVL: the planner's figure is an upper
  bound), selective AC (distlab's: every matmul output kept; torchtitan's op policy keeps every other one,
  so theirs recomputes more and holds less), NVLink 4 inside the node.
- Megatron-LM publishes MFU only as a figure (weak scaling on H100, up to 47%), not a table of
  configurations and times: nothing is compared.
"""

from __future__ import annotations

import copy

from distlab.bench import StudyParser, run_study, write_json
from distlab.model.config import ModelConfig
from distlab.plan.calibration import Calibration
from distlab.plan.links import LINKS, Cluster
from distlab.plan.model import AttnShape, Kernels, ring_cost
from distlab.plan.step import Plan, step

RING_FLASH = {"ring": {"fwd": 0.521, "fwd_bwd": 0.539}, "zigzag": {"fwd": 0.852, "fwd_bwd": 0.902}}
TORCHTITAN = {"tokens_per_s_per_gpu": 5762, "memory_gib": 82.4}


def scaled(cal: Calibration, memory_scale: float, name: str) -> Calibration:
    """``cal`` with memory-bound (copy) rates times ``memory_scale``, renamed: a derived, unmeasured device."""
    data = copy.deepcopy(cal.data)
    data["rates"]["copy"] = [[s, r * memory_scale] for s, r in data["rates"]["copy"]]
    data["device"] = name
    return Calibration(data, f"{cal.path} (derived: copy x{memory_scale:.2f})")


def ring_flash_attention(cal: Calibration) -> list[dict]:
    link = LINKS["nvlink-h800"]
    rows = []
    local = 8192
    k = Kernels(cal)
    one = AttnShape(1, local, 32, 8, 128)
    t1f, t1b = ring_cost(one, 1, 32, 8, k, link)
    for layout in ("contiguous", "zigzag"):
        f, b = ring_cost(AttnShape(1, 8 * local, 32, 8, 128, layout=layout), 8, 32, 8, k, link)
        name = "ring" if layout == "contiguous" else "zigzag"
        for what, pred in (("fwd", 8 * t1f.total / f.total), ("fwd_bwd", 8 * (t1f + t1b).total / (f + b).total)):
            rows.append({"source": "ring-flash-attention 8xH800", "what": f"{name} {what} efficiency",
                         "published": RING_FLASH[name][what], "predicted": pred,
                         "exposed_ms": (f.exposed if what == "fwd" else f.exposed + b.exposed) * 1e3})
    return rows


def torchtitan(cal: Calibration) -> list[dict]:
    cfg = ModelConfig(vocab=128256, layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336)
    h100 = scaled(cal, 2.4 / 4.8, "H100 96GB HBM2e (derived from the H200 calibration)")
    cluster = Cluster(1, 8, LINKS["nvlink4"], LINKS["ib-ndr400"])
    r = step(cfg, Plan(1, 1, 1, "none", 8, 1, 3, "selective"), cluster, Kernels(h100), 8192, 16)
    return [{"source": "torchtitan 8xH100 Llama 3.1 8B FSDP", "what": "tokens/s/GPU",
             "published": TORCHTITAN["tokens_per_s_per_gpu"], "predicted": r["tokens_per_s_per_gpu"],
             "exposed_ms": r["exposed_comm_s"] * 1e3},
            {"source": "torchtitan 8xH100 Llama 3.1 8B FSDP", "what": "memory GiB",
             "published": TORCHTITAN["memory_gib"], "predicted": r["memory"]["total"] / 2**30, "exposed_ms": None}]


def main(argv=None):
    p = StudyParser(prog="python -m distlab.plan.published", description=__doc__.split("\n\n")[0])
    p.add_argument("--calibration", default=None, help="default: the shipped H200 calibration")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from distlab.plan.__main__ import CALIBRATIONS
    import os

    cal = Calibration.load(a.calibration or os.path.join(CALIBRATIONS, "h200.json"))
    rows = ring_flash_attention(cal) + torchtitan(cal)
    print(f"{'source':<38} {'what':<26} {'published':>10} {'predicted':>10} {'pred/pub':>9}")
    for r in rows:
        print(f"{r['source']:<38} {r['what']:<26} {r['published']:>10.3f} {r['predicted']:>10.3f} "
              f"{r['predicted'] / r['published']:>9.2f}")
    if a.json:
        write_json(a.json, {"calibration": {"device": cal.device, "date": cal.data["date"]}, "rows": rows})


if __name__ == "__main__":
    run_study(main)
