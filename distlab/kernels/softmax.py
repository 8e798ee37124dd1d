"""The softmax ladder: naive, safe, online (two-pass and one-pass), and an online softmax in Triton.

    python -m distlab.kernels.softmax --rows 16384 --cols 4096 32768      # GPU: GB/s and % of a device copy
    python -m distlab.kernels.softmax --device cpu --rows 64 --cols 1000   # the references, checked on CPU

Each rung computes ``softmax(x)`` over the last dim; all but the naive one return torch's numbers to 1e-5
(``check``):

- ``naive``: ``exp(x) / sum(exp(x))``: overflows once a logit passes ~88 (float32), so it fails the check on
  logits like attention scores or a vocabulary's;
- ``safe``: subtract the row max first: three reads of the row (max, sum, normalise), the textbook form;
- ``online_two_pass``: one pass keeps a running max ``m`` and a running sum ``l`` rescaled by ``exp(m_old −
  m_new)`` block by block (Milakov & Gimelshein 2018), a second pass writes ``exp(x − m) / l``: two reads,
  one write, whatever the row length;
- ``online_one_pass``: the same recurrence over blocks, keeping the unnormalised ``exp(x − m)`` blocks and
  rescaling them once at the end — FlashAttention's trick, one read of x (here in PyTorch the blocks are
  kept in memory; in a kernel they are the registers of the row);
- ``softmax_triton``: one program per row. A row that fits in one block (≤ ``MAX_BLOCK`` columns) is read
  once into registers, max and sum are warp/block reductions, one write: the one-pass form. A longer row
  runs the online two-pass form over blocks of ``MAX_BLOCK`` columns (two reads, one write).

Bandwidth counts the bytes a perfect kernel moves: one read and one write of the row.
"""

from __future__ import annotations

import torch

MAX_BLOCK = 8192


def naive(x):
    e = x.exp()
    return e / e.sum(-1, keepdim=True)


def safe(x):
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def _blocks(x, block):
    return x.split(block, -1)


def online_two_pass(x, block=256):
    m = torch.full(x.shape[:-1] + (1,), float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for b in _blocks(x, block):                      # pass 1: running max and rescaled running sum
        m_new = torch.maximum(m, b.amax(-1, keepdim=True))
        l = l * (m - m_new).exp() + (b - m_new).exp().sum(-1, keepdim=True)
        m = m_new
    return (x - m).exp() / l                         # pass 2


def online_one_pass(x, block=256):
    m = torch.full(x.shape[:-1] + (1,), float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    kept = []
    for b in _blocks(x, block):                      # each block read once: exp against the max so far
        m_new = torch.maximum(m, b.amax(-1, keepdim=True))
        scale = (m - m_new).exp()
        e = (b - m_new).exp()
        kept = [k * scale for k in kept] + [e]       # earlier blocks rescaled to the new max
        l = l * scale + e.sum(-1, keepdim=True)
        m = m_new
    return torch.cat(kept, -1) / l


def _triton_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def one_block(X, Y, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * n + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, 0))
        tl.store(Y + row * n + cols, (e / tl.sum(e, 0)).to(Y.dtype.element_ty), mask=cols < n)

    @triton.jit
    def two_pass(X, Y, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):            # per lane running max and sum, merged at the end
            x = tl.load(X + row * n + start + cols, mask=start + cols < n, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            l = l * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        m_row = tl.max(m, 0)
        l_row = tl.sum(l * tl.exp(m - m_row), 0)
        for start in range(0, n, BLOCK):
            x = tl.load(X + row * n + start + cols, mask=start + cols < n, other=float("-inf")).to(tl.float32)
            tl.store(Y + row * n + start + cols, (tl.exp(x - m_row) / l_row).to(Y.dtype.element_ty),
                     mask=start + cols < n)

    return one_block, two_pass


_KERNELS = None


def softmax_triton(x, out=None):
    """Softmax over the last dim in Triton (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    global _KERNELS
    import triton

    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"softmax_triton: float32/float16/bfloat16 input, got {x.dtype}")
    if x.shape[-1] == 0:
        raise ValueError("softmax_triton: the last dim is empty")
    _KERNELS = _KERNELS or _triton_kernels()
    one_block, two_pass = _KERNELS
    x2 = x.contiguous().view(-1, x.shape[-1])
    out = torch.empty_like(x2) if out is None else out.view(-1, x.shape[-1])
    n = x2.shape[1]
    if n <= MAX_BLOCK:
        block = triton.next_power_of_2(n)
        one_block[(x2.shape[0],)](x2, out, n, BLOCK=block, num_warps=4 if block <= 2048 else 8)
    else:
        two_pass[(x2.shape[0],)](x2, out, n, BLOCK=MAX_BLOCK, num_warps=16)
    return out.view(x.shape)


LADDER = {"naive": naive, "safe": safe, "online_two_pass": online_two_pass, "online_one_pass": online_one_pass,
          "triton": softmax_triton}


def check(fn, x) -> float:
    """Max abs error against ``torch.softmax`` in float64."""
    want = torch.softmax(x.double(), -1)
    return (fn(x).double() - want).abs().max().item()


def main(argv=None):
    from distlab.bench import DTYPES, StudyParser, add_common_args, device_of, positive_int, timeit, write_json
    from distlab.kernels.bench import copy_bandwidth

    p = StudyParser(prog="python -m distlab.kernels.softmax", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=positive_int, default=16384)
    p.add_argument("--cols", type=positive_int, nargs="+", default=[1024, 4096, 32768])
    add_common_args(p, iters=20, warmup=5, dtype=None, dtypes=("float32", "float16", "bfloat16"), gpu_tool=True)
    a = p.parse_args(argv)
    dev = device_of(a, "the softmax ladder", gpu_tool=True, cpu_hint="--device cpu --rows 64 --cols 1000")
    dtype = DTYPES[a.dtype or ("bfloat16" if dev.type == "cuda" else "float32")]
    copy = copy_bandwidth(dev, a.iters, a.warmup) if dev.type == "cuda" else None
    rows = []
    print(f"{'cols':>7} {'rung':<16} {'max err':>9} {'GB/s':>8} {'% copy':>7} {'wall GB/s':>10}")
    for n in a.cols:
        x = (torch.randn(a.rows, n, device=dev) * 40).to(dtype)       # logits past exp's float32 range (~88)
        for name, fn in LADDER.items():
            if name == "triton" and dev.type != "cuda":
                continue
            err = check(fn, x)
            seconds = timeit(lambda: fn(x), a.iters, a.warmup, dev)
            wall = timeit(lambda: fn(x), a.iters, a.warmup, dev, mode="wall")   # launch latency included
            gbs, wall_gbs = (2 * x.numel() * x.element_size() / t / 1e9 for t in (seconds, wall))
            rows.append({"cols": n, "rung": name, "max_err": err, "GB_s": gbs, "wall_GB_s": wall_gbs,
                         "pct_copy": 100 * gbs * 1e9 / copy if copy else None})
            pct = f"{rows[-1]['pct_copy']:.0f}%" if copy else "-"
            print(f"{n:>7} {name:<16} {err:>9.1e} {gbs:>8.0f} {pct:>7} {wall_gbs:>10.0f}", flush=True)
    if a.json:
        write_json(a.json, {"rows_per_call": a.rows, "dtype": a.dtype, "copy_GB_s": copy and copy / 1e9, "rows": rows})


if __name__ == "__main__":
    from distlab.bench import run_study

    run_study(main)
