"""Grouped GEMM over variable-size row segments (MoE experts): a loop reference, torch._grouped_mm, Triton.

    python -m distlab.kernels.grouped_gemm --experts 8 --rows 32768 --k-dim 4096 --n-dim 7168   # GPU benchmark vs torch._grouped_mm

``x`` (M, K) holds the rows of E groups back to back (``counts[e]`` rows for group e, possibly 0);
``w`` (E, K, N). ``grouped_mm(x, w, counts)`` returns (M, N) with rows of group e multiplied by ``w[e]``.
Its backward is two more grouped GEMMs: ``dX = dY · w[e]ᵀ`` (the same kernel, ``w`` read transposed
through its strides) and ``dW[e] = X_eᵀ · dY_e`` (a kernel whose reduction runs over each segment's rows;
an empty segment gets a zero gradient).

Backends (``backend=``): ``loop`` (one matmul per group; any device, the reference), ``torch``
(``torch._grouped_mm``; CUDA bf16 on Hopper), ``triton`` (this file's kernels; CUDA, or CPU tensors under
``TRITON_INTERPRET=1`` for tests — in fp32/fp16 there, the interpreter's bf16 dot is wrong).

The Triton forward and dX kernel (``segment_mm_tma``) is persistent — one program per SM walks a list of
(m-tile, n-tile) pairs of the non-empty groups, in bands of 16 m-tiles — and moves its tiles with TMA
descriptors (A and the output 2-d, the weights 3-d so a K tail never reads the next expert). Where TMA
cannot be used (rows not 16-byte aligned, pre-Hopper GPUs) a pointer kernel (``segment_mm``, one program per
tile) does the same product. Tuning knobs (env): ``DISTLAB_GROUPED_GEMM_{CONFIG,GROUP_M,TMA,PERSISTENT,WS,
SPLIT_EPILOGUE}``; ``--variant`` times several in the same interleaved rounds. ``DISTLAB_GROUPED_GEMM_WGRAD_TMA=1``
(an experiment, off until timed on a GPU) runs dW with TMA loads too.
"""

from __future__ import annotations

import os

import torch

from distlab import knobs
from distlab.bench import StudyParser, require_gpu, run_study
from distlab.kernels.launch import sm_major, triton_runs_on

BACKENDS = ("auto", "loop", "torch", "triton")


def offsets(counts, device):
    """Exclusive-scan offsets (E+1,) int32 of the group row counts."""
    c = torch.as_tensor(counts, dtype=torch.int64, device="cpu")
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(c, 0)]).to(device=device, dtype=torch.int32)


def grouped_mm_loop(x, w, counts):
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for e, n in enumerate(counts):
        out[start:start + n] = x[start:start + n] @ w[e]
        start += n
    return out


def resolve(backend, x):
    if backend not in BACKENDS:
        raise ValueError(f"unknown grouped GEMM backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            return "torch"
        return "loop"
    if backend == "triton" and not triton_runs_on(x.device):
        raise ValueError("the triton backend needs triton and a CUDA tensor (or TRITON_INTERPRET=1 on CPU)")
    if backend == "torch" and not (x.is_cuda and hasattr(torch, "_grouped_mm")):
        raise ValueError("the torch backend (torch._grouped_mm) needs CUDA tensors")
    return backend


# ------------------------------------------------------------------------------------------------------
# Triton kernels (defined lazily so CPU-only installs import this file without triton)
# ------------------------------------------------------------------------------------------------------
_KERNELS = {}


def _kernels():
    if _KERNELS:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def segment_mm(x_ptr, w_ptr, y_ptr, offs_ptr, tiles_m, tiles_n, N, K,
                   sxm, sxk, swe, swk, swn, sym, syn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
        """y[rows of group e] = x[rows] @ w[e]; one program per (e, m-tile, n-tile), w read through strides.
        Within a group the tiles go in bands of GROUP_M m-tiles, n fastest inside a band's columns, so the
        programs resident together share A rows and B columns in L2 (not every n-tile re-reading all of A)."""
        pid = tl.program_id(0)
        per_e = tiles_m * tiles_n
        e, local = pid // per_e, pid % per_e
        band = GROUP_M * tiles_n
        first_m = (local // band) * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        tile = first_m + (local % band) % size_m
        pid_n = (local % band) // size_m
        start, end = tl.load(offs_ptr + e), tl.load(offs_ptr + e + 1)
        row0 = start + tile * BM
        if row0 >= end:
            return
        rm = row0.to(tl.int64) + tl.arange(0, BM)               # int64: M·K or M·N may pass 2^31
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        a_ptrs = x_ptr + rm[:, None] * sxm + rk[None, :] * sxk
        b_ptrs = w_ptr + e * swe + rk[:, None] * swk + rn[None, :] * swn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=rm[:, None] < end, other=0.0)
                if EVEN_N:
                    b = tl.load(b_ptrs)
                else:
                    b = tl.load(b_ptrs, mask=rn[None, :] < N, other=0.0)
            else:
                a = tl.load(a_ptrs, mask=(rm[:, None] < end) & ((k0 + rk)[None, :] < K), other=0.0)
                b = tl.load(b_ptrs, mask=((k0 + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc += tl.dot(a, b)
            a_ptrs += BK * sxk
            b_ptrs += BK * swk
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < end) & (rn[None, :] < N))

    @triton.jit
    def segment_wgrad(x_ptr, dy_ptr, dw_ptr, offs_ptr, K, N, max_rows,
                      sxm, sxk, sym, syn, swe, swk, swn,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """dw[e] = x[rows of e]ᵀ @ dy[rows of e]; program (e, k-tile, n-tile); empty groups write zeros."""
        e, pid_k, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start, end = tl.load(offs_ptr + e), tl.load(offs_ptr + e + 1)
        rk = pid_k * BK + tl.arange(0, BK)
        rn = pid_n * BN + tl.arange(0, BN)
        rm = tl.arange(0, BM)
        acc = tl.zeros((BK, BN), dtype=tl.float32)
        for m0 in range(0, max_rows, BM):
            rows = (start + m0 + rm).to(tl.int64)
            a = tl.load(x_ptr + rows[None, :] * sxm + rk[:, None] * sxk,
                        mask=(rows[None, :] < end) & (rk[:, None] < K), other=0.0)
            b = tl.load(dy_ptr + rows[:, None] * sym + rn[None, :] * syn,
                        mask=(rows[:, None] < end) & (rn[None, :] < N), other=0.0)
            acc += tl.dot(a, b)
        tl.store(dw_ptr + e * swe + rk[:, None] * swk + rn[None, :] * swn, acc.to(dw_ptr.dtype.element_ty),
                 mask=(rk[:, None] < K) & (rn[None, :] < N))

    @triton.jit
    def segment_mm_tma(x_desc, w_desc, y_desc, y_ptr, tiles_ptr, offs_ptr, num_m_tiles, tiles_n, N, K, sym, syn,
                       NUM_PROGS, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                       TRANS_W: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr):
        """The same product through TMA descriptors, persistent: NUM_PROGS programs walk the list of
        (m-tile, n-tile) pairs in bands of GROUP_M m-tiles. ``tiles_ptr`` lists each m-tile's (group,
        first row), so no program is launched for the empty tail of a short group. A's rows past the
        group's end belong to the next group (or are zero-filled past M): they only feed output rows that
        are not stored. W is a 3-d descriptor (E, K, N) [or (E, N, K) read transposed], so a K tail is
        zero-filled inside the group. Whole tiles are stored by TMA, a group's last partial tile masked."""
        total = num_m_tiles * tiles_n
        band = GROUP_M * tiles_n
        for t in tl.range(tl.program_id(0), total, NUM_PROGS, warp_specialize=WARP_SPECIALIZE):
            first_m = (t // band) * GROUP_M
            size_m = tl.minimum(num_m_tiles - first_m, GROUP_M)
            mt = first_m + (t % band) % size_m
            n0 = ((t % band) // size_m) * BN
            e = tl.load(tiles_ptr + 2 * mt)
            row0 = tl.load(tiles_ptr + 2 * mt + 1)
            end = tl.load(offs_ptr + e + 1)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                a = x_desc.load([row0, k0])
                if TRANS_W:
                    b = tl.trans(w_desc.load([e, n0, k0]).reshape(BN, BK))
                else:
                    b = w_desc.load([e, k0, n0]).reshape(BK, BN)
                acc = tl.dot(a, b, acc)
            out = acc.to(y_desc.dtype)
            if row0 + BM <= end:                       # TMA clips columns past N
                if SPLIT_EPILOGUE:                     # two (BM, BN/2) stores: half the staging memory
                    lo, hi = tl.split(tl.permute(tl.reshape(out, (BM, 2, BN // 2)), (0, 2, 1)))
                    y_desc.store([row0, n0], lo)
                    y_desc.store([row0, n0 + BN // 2], hi)
                else:
                    y_desc.store([row0, n0], out)
            else:
                rm = row0.to(tl.int64) + tl.arange(0, BM)       # int64: M·N may pass 2^31
                rn = n0 + tl.arange(0, BN)
                tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, out,
                         mask=(rm[:, None] < end) & (rn[None, :] < N))

    @triton.jit
    def segment_wgrad_tma(x_desc, dy_desc, dw_desc, offs_ptr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """dw[e] = x[rows of e]ᵀ @ dy[rows of e] with TMA loads: program (e, k-tile, n-tile) streams the
        segment's rows in BM-row steps; rows past its end (the next group's) are zeroed in the x tile.
        The (1, BK, BN) output tile is stored by TMA (K/N tails clipped); an empty group stores zeros."""
        e, k0, n0 = tl.program_id(0), tl.program_id(1) * BK, tl.program_id(2) * BN
        start, end = tl.load(offs_ptr + e), tl.load(offs_ptr + e + 1)
        acc = tl.zeros((BK, BN), dtype=tl.float32)
        for r0 in range(start, end, BM):
            a = x_desc.load([r0, k0])
            a = tl.where((r0 + tl.arange(0, BM) < end)[:, None], a, tl.zeros_like(a))
            acc = tl.dot(tl.trans(a), dy_desc.load([r0, n0]), acc)
        dw_desc.store([e, k0, n0], acc.to(dw_desc.dtype).reshape(1, BK, BN))

    _KERNELS.update(segment_mm=segment_mm, segment_mm_tma=segment_mm_tma, segment_wgrad=segment_wgrad,
                    segment_wgrad_tma=segment_wgrad_tma, triton=triton)
    return _KERNELS


def _config(dtype, interpret):
    """(BM, BN, BK, num_warps, num_stages): small for the CPU interpreter; on the GPU a 128x256x64 bf16 tile
    over 8 warps and 3 stages (147 KB of shared memory), a smaller one for fp32 (4-byte tiles)."""
    if interpret:
        return 32, 32, 32, 4, 1
    if knobs.get("GROUPED_GEMM_CONFIG"):   # tuning knob: "BM,BN,BK,warps,stages" (or x-separated)
        return tuple(int(v) for v in knobs.get("GROUPED_GEMM_CONFIG").replace("x", ",").split(","))
    if dtype == torch.float32:
        return 64, 64, 32, 4, 2
    return 128, 256, 64, 8, 3


def _tma_ok(interpret, *tensors):
    """TMA descriptors need 16-byte aligned bases and row strides, unit last stride, and sm_90+.
    ``DISTLAB_GROUPED_GEMM_TMA=0`` forces the pointer kernel (for comparisons)."""
    if knobs.get("GROUPED_GEMM_TMA") == "0":
        return False
    if not interpret and sm_major(tensors[0].device) < 9:
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in tensors)


def _offsets_and_m_tiles(counts, bm, device):
    """One host-to-device copy: the (E+1,) row offsets, then (group, first row) of every bm-row tile of
    every non-empty group, flattened; int32."""
    offs, pairs = [0], []
    for e, c in enumerate(counts):
        pairs += [v for r in range(offs[-1], offs[-1] + c, bm) for v in (e, r)]
        offs.append(offs[-1] + c)
    table = torch.tensor(offs + pairs, dtype=torch.int32).to(device, non_blocking=True)
    return table[:len(offs)], table[len(offs):]


def _num_programs(total, device, interpret):
    """Persistent grid: one program per SM (the 128x256 bf16 tile fills an SM's shared memory);
    ``DISTLAB_GROUPED_GEMM_PERSISTENT=0``: one program per tile."""
    if knobs.get("GROUPED_GEMM_PERSISTENT") == "0":
        return total
    sms = 3 if interpret else torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(total, sms))


def _triton_segment_mm_tma(x, w, counts, transpose_w, y, cfg, interpret):
    from triton.tools.tensor_descriptor import TensorDescriptor

    ks = _kernels()
    bm, bn, bk, warps, stages = cfg
    N, K = y.shape[1], x.shape[1]
    offs, tiles = _offsets_and_m_tiles(counts, bm, x.device)
    num_m_tiles, tiles_n = tiles.numel() // 2, -(-N // bn)
    total = num_m_tiles * tiles_n
    progs = _num_programs(total, x.device, interpret)
    w_block = [1, bn, bk] if transpose_w else [1, bk, bn]
    split = knobs.get("GROUPED_GEMM_SPLIT_EPILOGUE") == "1"
    ks["segment_mm_tma"][(progs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, w_block),
        TensorDescriptor.from_tensor(y, [bm, bn // 2 if split else bn]), y, tiles, offs,
        num_m_tiles, tiles_n, N, K, y.stride(0), y.stride(1), progs, BM=bm, BN=bn, BK=bk,
        GROUP_M=max(1, int(knobs.get("GROUPED_GEMM_GROUP_M") or 16)), TRANS_W=transpose_w,
        WARP_SPECIALIZE=knobs.get("GROUPED_GEMM_WS") == "1", SPLIT_EPILOGUE=split,
        num_warps=warps, num_stages=stages)
    return y


def triton_segment_mm(x, w, counts, transpose_w=False):
    """(M, K) x per-group (K, N) [or w stored (E, N, K) used transposed] -> (M, N)."""
    ks = _kernels()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    cfg = bm, bn, bk, warps, stages = _config(x.dtype, interpret)
    e = w.shape[0]
    if transpose_w:   # logical (E, K, N) = stored (E, N, K) with swapped strides
        K, N = w.shape[2], w.shape[1]
        swe, swk, swn = w.stride(0), w.stride(2), w.stride(1)
    else:
        K, N = w.shape[1], w.shape[2]
        swe, swk, swn = w.stride(0), w.stride(1), w.stride(2)
    y = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    if _tma_ok(interpret, x, w, y):
        return _triton_segment_mm_tma(x, w, counts, transpose_w, y, cfg, interpret)
    offs = offsets(counts, x.device)
    tiles_m, tiles_n = max(1, -(-max(counts) // bm)), -(-N // bn)
    group_m = int(knobs.get("GROUPED_GEMM_GROUP_M") or 8)
    ks["segment_mm"][(e * tiles_m * tiles_n,)](
        x, w, y, offs, tiles_m, tiles_n, N, K, x.stride(0), x.stride(1), swe, swk, swn, y.stride(0), y.stride(1),
        BM=bm, BN=bn, BK=bk, GROUP_M=max(1, group_m), EVEN_K=K % bk == 0, EVEN_N=N % bn == 0,
        num_warps=warps, num_stages=stages)
    return y


def triton_segment_wgrad(x, dy, counts):
    """Per group e: x_eᵀ @ dy_e -> (E, K, N) (zeros for empty groups)."""
    ks = _kernels()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    bm, bn, bk, warps, stages = _config(x.dtype, interpret)
    bk, bm = bm, bk                     # here the output tile is (K, N) and the reduction runs over rows
    e, K, N = len(counts), x.shape[1], dy.shape[1]
    dw = torch.empty(e, K, N, dtype=x.dtype, device=x.device)
    offs = offsets(counts, x.device)
    grid = (e, -(-K // bk), -(-N // bn))
    if knobs.get("GROUPED_GEMM_WGRAD_TMA") == "1" and x.shape[0] and _tma_ok(interpret, x, dy, dw):
        from triton.tools.tensor_descriptor import TensorDescriptor

        ks["segment_wgrad_tma"][grid](TensorDescriptor.from_tensor(x, [bm, bk]),
                                      TensorDescriptor.from_tensor(dy, [bm, bn]),
                                      TensorDescriptor.from_tensor(dw, [1, bk, bn]), offs,
                                      BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
        return dw
    ks["segment_wgrad"][grid](x, dy, dw, offs, K, N, max(max(counts), 1), x.stride(0), x.stride(1),
                              dy.stride(0), dy.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
                              BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return dw


# ------------------------------------------------------------------------------------------------------
# autograd front end
# ------------------------------------------------------------------------------------------------------
class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts, backend):
        ctx.save_for_backward(x, w)
        ctx.counts, ctx.backend = counts, backend
        return _forward(x, w, counts, backend)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        counts, backend = ctx.counts, ctx.backend
        dy = dy.contiguous()
        if backend == "triton":
            dx = triton_segment_mm(dy, w, counts, transpose_w=True)
            dw = triton_segment_wgrad(x, dy, counts)
        elif backend == "torch":
            offs = offsets(counts, x.device)[1:]
            dx = torch._grouped_mm(dy, w.transpose(1, 2), offs=offs)
            dw = torch._grouped_mm(x.t(), dy, offs=offs)
        else:
            dx = grouped_mm_loop(dy, w.transpose(1, 2), counts)
            dw = torch.zeros_like(w)
            start = 0
            for e, n in enumerate(counts):
                dw[e] = x[start:start + n].t() @ dy[start:start + n]
                start += n
        return dx, dw, None, None


def _forward(x, w, counts, backend):
    if backend == "triton":
        return triton_segment_mm(x, w, counts)
    if backend == "torch":
        return torch._grouped_mm(x, w, offs=offsets(counts, x.device)[1:])
    return grouped_mm_loop(x, w, counts)


def grouped_mm(x, w, counts, backend="auto"):
    """Rows of group e of ``x`` (M, K) times ``w[e]`` (K, N); ``counts`` (E,) rows per group, summing to M."""
    counts = [int(c) for c in counts]
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0] or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)} and counts (sum {sum(counts)}, "
                         f"{len(counts)} groups) disagree")
    return _GroupedMM.apply(x.contiguous(), w, counts, resolve(backend, x))


def _with_env(settings, fn):
    """Run ``fn`` with knob GROUPED_GEMM_<KEY>=<value> in force for each "KEY=value" in ``settings``."""
    with knobs.override(**knobs.parse_settings(";".join(settings), "GROUPED_GEMM_")):
        return fn()


def main(argv=None):
    import statistics
    import time

    from distlab.bench import timeit

    p = StudyParser(prog="python -m distlab.kernels.grouped_gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--k-dim", type=int, default=4096, help="K: each row's features in")
    p.add_argument("--n-dim", type=int, default=7168, help="N: features out (--n would clash with torchrun's --nnodes)")
    p.add_argument("--skew", type=float, default=0.0, help="0: uniform rows per group; >0 Zipf-like")
    p.add_argument("--iters", type=int, default=20, help="timed calls per backend per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds; each times every backend in turn")
    p.add_argument("--cooldown", type=float, default=0.0, help="seconds idle before each timing (boost clocks)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=V,KEY=V",
                   help="a Triton variant, KEY a DISTLAB_GROUPED_GEMM_<KEY> knob (e.g. ws:WS=1,GROUP_M=16); "
                        "repeatable, all timed in the same rounds")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    require_gpu("distlab.kernels.grouped_gemm", "tests/test_moe.py checks the kernels under TRITON_INTERPRET=1 on CPU")
    a.k, a.n = a.k_dim, a.n_dim
    dev = torch.device("cuda")
    weights = torch.tensor([(e + 1.0) ** -a.skew for e in range(a.experts)])
    counts = (weights / weights.sum() * a.rows).floor().long()
    counts[0] += a.rows - counts.sum()
    counts = [int(c) // 16 * 16 for c in counts]          # torch._grouped_mm wants 16-row aligned groups
    counts[0] += a.rows - sum(counts)
    x = torch.randn(a.rows, a.k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(a.experts, a.k, a.n, device=dev, dtype=torch.bfloat16)
    flops = 2 * a.rows * a.k * a.n
    print(f"grouped GEMM, {a.experts} groups, {a.rows} rows ({counts}), {a.k}->{a.n}, bf16, "
          f"{torch.cuda.get_device_name()}")
    runs = {"torch": ("torch", []), "loop": ("loop", [])}
    for v in a.variant or ["triton:"]:
        name, _, settings = v.partition(":")
        runs[name] = ("triton", settings.split(","))
    ref = _forward(x, w, counts, "torch").float()
    errs = {}
    for name, (backend, settings) in list(runs.items()):   # check each variant against torch._grouped_mm first
        try:
            out = _with_env(settings, lambda: _forward(x, w, counts, backend)).float()
        except Exception as exc:                      # e.g. a tile config that does not fit shared memory
            print(f"  {name}: does not run ({type(exc).__name__}: {str(exc).splitlines()[-1][:120]})")
            del runs[name]
            continue
        errs[name] = ((out - ref).abs().max() / ref.abs().max()).item()
        if not errs[name] < 2e-2:
            raise SystemExit(f"{name} disagrees with torch._grouped_mm: {errs[name]:.3e}")
    times = {name: [] for name in runs}
    for _ in range(a.rounds):                           # interleaved, so clock drift hits every backend alike
        for name, (backend, settings) in runs.items():
            time.sleep(a.cooldown)
            times[name].append(_with_env(settings, lambda: timeit(lambda: _forward(x, w, counts, backend),
                                                                  a.iters, 3, dev)))
    rows = []
    print(f"  {'backend':<14} {'ms':>8} {'TFLOP/s':>8} {'vs torch':>9}   (median of {a.rounds} rounds; "
          f"ratio = median of the per-round ratios; {a.cooldown} s idle before each)")
    for name, (backend, settings) in runs.items():
        t = statistics.median(times[name])
        ratio = statistics.median(tt / t_ for tt, t_ in zip(times["torch"], times[name]))
        rows.append({"backend": backend, "variant": name, "settings": settings, "ms": t * 1e3,
                     "tflops": flops / t / 1e12, "vs_torch": ratio, "rel_err": errs[name],
                     "rounds_ms": [v * 1e3 for v in times[name]]})
        print(f"  {name:<14} {t * 1e3:8.3f} {flops / t / 1e12:8.1f} {ratio:9.1%}   {','.join(settings)}")
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(a), "counts": counts,
                       "env": {k: v for k, v in knobs.in_force().items() if k.startswith("DISTLAB_GROUPED_GEMM")},
                       "config": _config(x.dtype, False), "results": rows}, f, indent=1)


if __name__ == "__main__":
    run_study(main)
