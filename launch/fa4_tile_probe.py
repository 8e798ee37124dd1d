"""Does FA4's sm90 backward run a full (non-causal) ring block as fast with 64-row tiles as with its 80? (#24)

    python3 launch/fa4_tile_probe.py --json OUT.json          # H100/H200 with FA4 (../shared/tools/fa4-carry)
    python3 launch/fa4_tile_probe.py --mha --json OUT.json    # GQA blocks against K/V repeated to MHA
    python3 launch/fa4_tile_probe.py --fold --json OUT.json   # GQA blocks against their q heads folded into rows

FA4 tiles the backward's rows by 80 for a full block and by 64 for a causal or local one (head_dim 128), and
its float32 dQ accumulator is laid out in those tiles. A zigzag ring rank's blocks therefore need one
accumulator (and one preprocess, one conversion) per row set: the causal step 0's rows and the later steps'
second half, which starts at row 2048 at S32768, W=8 — off the 80-row tiles, on the 64-row ones. A full block
asked for as *local* with a window wider than its keys (``window_size=(None, keys)``: nothing masked) gets the
64-row tiles; if its main kernel runs as fast, one accumulator could serve every row set (~110 µs of
preprocess, conversion and sum saved a backward at S32768 by the timeline). This probe times the main kernel
of the rank-0 block shapes both ways (torch.profiler, kernel time only) and checks they compute the same.
"""

from __future__ import annotations

import argparse
import json

import torch

from distlab.kernels.fa4_ring_backward import fold_heads, unfold_heads


def main_kernel_us(fn, iters):
    """Mean GPU time of the backward's main kernel (name holds ``bwd_sm90``) over ``iters`` calls, and of all."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    main = total = 0.0
    for e in prof.key_averages():
        t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        total += t
        if "bwd_sm90" in e.key:
            main += t
    return main / iters, total / iters


def _block(rows, keys, heads, kv_heads, dim):
    """FA4's interface and one full block's bf16 inputs, forward output and LSE (seeded)."""
    from flash_attn.cute import interface as fi

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, rows, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, keys, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse, *_ = fi._flash_attn_fwd(q, k, v, causal=False, return_lse=True)
    return fi, q, k, v, dout, out, lse


def probe(rows, keys, heads, kv_heads, dim, iters):
    fi, q, k, v, dout, out, lse = _block(rows, keys, heads, kv_heads, dim)
    runs = {"full (80-row tiles)": {}, "local, window over every key (64-row tiles)":
            {"window_size_left": None, "window_size_right": keys}}
    res, grads = {}, {}
    for name, kw in runs.items():
        def call(kw=kw):
            return fi._flash_attn_bwd(q, k, v, out, dout, lse, causal=False, **kw)[:3]
        grads[name] = call()
        res[name] = main_kernel_us(call, iters)
    (a, b) = grads.values()
    err = max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item() for x, y in zip(a, b))
    flops = 2.5 * 4 * rows * keys * heads * dim   # backward = 2.5 x forward's 4·S·K·H·D
    out = {"rows": rows, "keys": keys, "max_rel_diff": err}
    for name, (main, total) in res.items():
        out[name] = {"main_us": main, "all_kernels_us": total, "main_tflops": flops / main / 1e6}
    return out


def probe_mha(rows, keys, heads, kv_heads, dim, iters):
    """GQA against MHA on the same block: FA4's backward with ``kv_heads`` K/V heads (dK/dV added by atomics into
    float32 scratch, converted after) and with K/V repeated to ``heads`` (each q head's dK/dV written straight
    in bf16), plus what MHA would cost a ring around the kernel: the K/V repeat and the sum of a kv head's
    q-head dK/dV into a float32 accumulator."""
    fi, q, k, v, dout, out, lse = _block(rows, keys, heads, kv_heads, dim)
    group = heads // kv_heads
    k_rep, v_rep = (t.repeat_interleave(group, dim=2) for t in (k, v))
    acc = torch.zeros(1, keys, kv_heads, dim, device="cuda", dtype=torch.float32)
    gqa = lambda: fi._flash_attn_bwd(q, k, v, out, dout, lse, causal=False)[:3]          # noqa: E731
    mha = lambda: fi._flash_attn_bwd(q, k_rep, v_rep, out, dout, lse, causal=False)[:3]  # noqa: E731
    rep = lambda: (k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2))  # noqa: E731
    dk_mha = mha()[1]
    add = lambda: acc.add_(dk_mha.view(1, keys, kv_heads, group, dim).sum(3, dtype=torch.float32))  # noqa: E731
    a, b = gqa(), mha()
    b = (b[0], *(t.float().view(1, keys, kv_heads, group, dim).sum(3) for t in b[1:]))
    err = max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item() for x, y in zip(a, b))
    flops = 2.5 * 4 * rows * keys * heads * dim
    res = {"rows": rows, "keys": keys, "max_rel_diff": err}
    for name, fn in (("gqa", gqa), ("mha", mha)):
        main, total = main_kernel_us(fn, iters)
        res[name] = {"main_us": main, "all_kernels_us": total, "main_tflops": flops / main / 1e6}
    for name, fn in (("repeat_kv_us", rep), ("sum_one_of_dk_dv_us", add)):
        res[name] = main_kernel_us(fn, iters)[1]
    return res


def probe_fold(rows, keys, heads, kv_heads, dim, iters):
    """GQA against the q heads folded into rows (MHA over the kv heads, G times the rows a CTA loops over; dK/dV
    written straight in bf16, no float32 scratch), on a full block: FA4 4.0.0b36 has no packed-GQA backward,
    and its CTAs each own a key tile and loop over the rows, so a ring's short row sets (2048 at S32768, W=8)
    pay each CTA's prologue and epilogue over few rows. Plus the folds a ring would add: Q, dO, O (once per
    row set) and dQ back."""
    fi, q, k, v, dout, out, lse = _block(rows, keys, heads, kv_heads, dim)
    group = heads // kv_heads
    qf, of, df = (fold_heads(t, kv_heads) for t in (q, out, dout))
    lf = lse.view(1, kv_heads, group, rows).reshape(1, kv_heads, group * rows)
    gqa = lambda: fi._flash_attn_bwd(q, k, v, out, dout, lse, causal=False)[:3]      # noqa: E731
    fold = lambda: fi._flash_attn_bwd(qf, k, v, of, df, lf, causal=False)[:3]       # noqa: E731
    a, b = gqa(), fold()
    b = (unfold_heads(b[0], heads), *b[1:])
    err = max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item() for x, y in zip(a, b))
    flops = 2.5 * 4 * rows * keys * heads * dim
    res = {"rows": rows, "keys": keys, "max_rel_diff": err}
    for name, fn in (("gqa", gqa), ("fold", fold)):
        main, total = main_kernel_us(fn, iters)
        res[name] = {"main_us": main, "all_kernels_us": total, "main_tflops": flops / main / 1e6}
    dq_f = b[0].new_empty(qf.shape)
    for name, fn in (("fold_q_dout_out_us", lambda: [fold_heads(t, kv_heads) for t in (q, out, dout)]),
                     ("unfold_dq_us", lambda: unfold_heads(dq_f, heads))):
        res[name] = main_kernel_us(fn, iters)[1]
    return res


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="2048x12288,2048x16384,2048x4096,4096x8192")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json")
    p.add_argument("--mha", action="store_true", help="GQA against K/V repeated to MHA instead")
    p.add_argument("--fold", action="store_true", help="GQA against the q heads folded into rows instead")
    a = p.parse_args(argv)
    if a.fold:
        fn, header = probe_fold, (f"{'GQA main us':>11} {'all':>7} | {'fold main us':>12} {'all':>7} | "
                                  f"{'fold Q,O,dO us':>14} | {'unfold dQ us':>12}")
    elif a.mha:
        fn, header = probe_mha, (f"{'GQA main us':>11} {'all':>7} | {'MHA main us':>11} {'all':>7} | "
                                 f"{'repeat K,V us':>13} | {'sum dK us':>9}")
    else:
        fn, header = probe, (f"{'full main us':>12} {'TFLOP/s':>8} | {'local main us':>13} {'TFLOP/s':>8} | "
                             f"{'local/full':>10} | {'all kernels full / local us':>28}")
    print(f"{'rows x keys':>14} | {header} | max rel diff")
    rows = []
    for shape in a.shapes.split(","):
        r, k = map(int, shape.split("x"))
        row = fn(r, k, a.heads, a.kv_heads, a.dim, a.iters)
        print(f"{shape:>14} | {_columns(row, a.mha, a.fold)} | {row['max_rel_diff']:.2e}", flush=True)
        rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(),
                       "mode": "fold" if a.fold else "mha" if a.mha else "tiles", "rows": rows},
                      f, indent=1)


def _columns(row, mha, fold=False):
    """One row of the table: the two kernels' times (and, for MHA or folds, what a ring would add around it)."""
    if fold:
        gqa, f = row["gqa"], row["fold"]
        return (f"{gqa['main_us']:11.1f} {gqa['all_kernels_us']:7.1f} | {f['main_us']:12.1f} "
                f"{f['all_kernels_us']:7.1f} | {row['fold_q_dout_out_us']:14.1f} | {row['unfold_dq_us']:12.1f}")
    if mha:
        gqa, m = row["gqa"], row["mha"]
        return (f"{gqa['main_us']:11.1f} {gqa['all_kernels_us']:7.1f} | {m['main_us']:11.1f} "
                f"{m['all_kernels_us']:7.1f} | {row['repeat_kv_us']:13.1f} | {row['sum_one_of_dk_dv_us']:9.1f}")
    full, local = (row[n] for n in row if isinstance(row[n], dict))
    return (f"{full['main_us']:12.1f} {full['main_tflops']:8.1f} | {local['main_us']:13.1f} "
            f"{local['main_tflops']:8.1f} | {local['main_us'] / full['main_us']:10.3f} | "
            f"{full['all_kernels_us']:13.1f} / {local['all_kernels_us']:12.1f}")

if __name__ == "__main__":
    main()
