"""The attention-kernel work of one rank for each CP method, timed on one device with no communication.

    python -m distlab.cp.local_kernels --world 8 --seq 8192 32768 --json local.json

Once communication hides behind compute, a CP method is as fast as the kernels its busiest rank runs.
Those kernels differ in shape: ring runs W blocks of S/W queries (zigzag: one causal S/W block and W−1
half blocks; contiguous: rank W−1 runs W−1 full blocks and one causal one), Ulysses runs one causal
attention over the whole S on H/W heads, USP U×R runs R-block rings of S/R on H/U heads. This runs exactly
the busiest rank's kernel calls (``attention_forward``, then ``attention_backward`` for each block) back
to back on one device and reports their TFLOP/s (FlashAttention's count, causal halved), next to one
attention call over the whole problem on the same device. Merges and communication are left out on
purpose: this is the kernels' ceiling.
"""

from __future__ import annotations

import json

import torch

from distlab.cp.ring import ring_blocks
from distlab.cp.ulysses import kv_replication
from distlab.bench import DTYPES, StudyParser, add_common_args, device_of, positive_int, run_study, timeit
from distlab.kernels.attention import BACKENDS, attention_backward, attention_forward, resolve_backend


def method_blocks(method, world, seq, heads, kv_heads, ulysses=1):
    """(heads, kv_heads, [(q_len, k_len, causal), ...]) the busiest rank of ``method`` computes."""
    if method == "ulysses":
        kv = kv_heads * kv_replication(heads, kv_heads, world) // world
        return heads // world, kv, [(seq, seq, True)]
    if method in ("ring-contiguous", "ring-zigzag"):
        u, ring, layout = 1, world, method.split("-")[1]
    else:  # usp
        u, ring, layout = ulysses, world // ulysses, "zigzag"
    kv = kv_heads * kv_replication(heads, kv_heads, u) // u
    local = seq // ring
    busiest = ring - 1 if layout == "contiguous" else 0
    blocks = []
    for step in range(ring):
        for rows, cols, causal in ring_blocks((busiest - step) % ring, busiest, local, True, layout):
            blocks.append((rows.stop - rows.start, cols.stop - cols.start, causal))
    return heads // u, kv, blocks


def block_flops(batch, head_dim, heads, blocks):
    return sum(4 * batch * n * m * heads * head_dim * (0.5 if c else 1.0) for n, m, c in blocks)


def time_blocks(batch, heads, kv_heads, head_dim, blocks, dtype, device, backend, iters, warmup):
    gen = torch.Generator(device="cpu").manual_seed(0)
    tensors = []
    for n, m, causal in blocks:
        q = torch.randn(batch, n, heads, head_dim, generator=gen).to(device, dtype)
        k = torch.randn(batch, m, kv_heads, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(batch, m, kv_heads, head_dim, generator=gen).to(device, dtype)
        out, lse = attention_forward(q, k, v, causal, backend=backend)
        tensors.append((q, k, v, out, lse, torch.randn_like(q), causal))

    def fwd():
        for q, k, v, _, _, _, c in tensors:
            attention_forward(q, k, v, c, backend=backend)

    def bwd():
        for q, k, v, o, l, d, c in tensors:
            attention_backward(d, q, k, v, o, l, c, backend=backend)

    return timeit(fwd, iters, warmup, device), timeit(bwd, iters, warmup, device)


def main(argv=None):
    p = StudyParser(prog="python -m distlab.cp.local_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=positive_int, default=8)
    p.add_argument("--seq", type=positive_int, nargs="+", default=None, help="default: 8192 32768 (GPU), 1024 (CPU)")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--heads", type=positive_int, default=None, help="default: 32 (GPU), 8 (CPU)")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="default: 8 (GPU), 2 (CPU)")
    p.add_argument("--head-dim", type=positive_int, default=None, help="default: 128 (GPU), 32 (CPU)")
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    add_common_args(p, gpu_tool=True)
    a = p.parse_args(argv)
    device = device_of(a, "distlab.cp.local_kernels", gpu_tool=True)
    gpu = device.type == "cuda"
    for name, on_gpu, on_cpu in (("seq", [8192, 32768], [1024]), ("heads", 32, 8), ("kv_heads", 8, 2),
                                 ("head_dim", 128, 32), ("dtype", "bfloat16", "float32"), ("iters", 10, 2),
                                 ("warmup", 3, 1)):
        if getattr(a, name) is None:
            setattr(a, name, on_gpu if gpu else on_cpu)
    dtype = DTYPES[a.dtype]
    backend = resolve_backend(a.backend, device, dtype)
    methods = [("ring-contiguous", 1), ("ring-zigzag", 1)]
    if a.heads % a.world == 0:
        methods.append(("ulysses", a.world))
    methods += [(f"usp {u}x{a.world // u}", u) for u in range(2, a.world) if a.world % u == 0 and a.heads % u == 0]
    print(f"one rank's attention kernels, W={a.world}, batch {a.batch} · heads {a.heads} (kv {a.kv_heads}) · "
          f"head_dim {a.head_dim} · {a.dtype} · causal · backend {backend} · "
          f"{torch.cuda.get_device_name() if gpu else 'cpu'}")
    print(f"{'seq':>7} {'method':<16} {'blocks':>6} {'block shapes (q x k, c = causal)':<34} {'fwd ms':>8} {'fwd TF/s':>9} "
          f"{'bwd ms':>8} {'bwd TF/s':>9}")
    rows = []
    for seq in a.seq:
        whole = [(seq, seq, True)]
        cases = [("one device", a.heads, a.kv_heads, whole)]
        for name, u in methods:
            key = "usp" if name.startswith("usp") else name
            cases.append((name, *method_blocks(key, a.world, seq, a.heads, a.kv_heads, u)))
        for name, h, kv, blocks in cases:
            t_f, t_b = time_blocks(a.batch, h, kv, a.head_dim, blocks, dtype, device, backend, a.iters, a.warmup)
            f = block_flops(a.batch, a.head_dim, h, blocks)
            shape = " + ".join(f"{blocks.count(b)}x({b[0]}x{b[1]}{'c' if b[2] else ''})" for b in dict.fromkeys(blocks))
            print(f"{seq:>7} {name:<16} {len(blocks):>6} {shape:<34} {t_f * 1e3:>8.3f} {f / t_f / 1e12:>9.1f} "
                  f"{t_b * 1e3:>8.3f} {2.5 * f / t_b / 1e12:>9.1f}")
            rows.append({"seq": seq, "method": name, "heads": h, "kv_heads": kv, "blocks": blocks, "fwd_s": t_f,
                         "bwd_s": t_b, "fwd_tflops": f / t_f / 1e12, "bwd_tflops": 2.5 * f / t_b / 1e12})
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "backend": backend, "rows": rows}, fh, indent=2)
        print(f"wrote {a.json}")
    return rows


if __name__ == "__main__":
    run_study(main)
