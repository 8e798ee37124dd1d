"""Fused linear + cross-entropy, chunked: the loss of ``x @ Wᵀ`` without ever holding ``[tokens, vocab]``.

    python -m pytest tests/test_fused_ce.py
    python -m distlab.kernels.fused_linear_ce --tokens 8192 --hidden 4096 --vocab 32000 128256 --plot ce.png
    # GPU: peak memory and time per chunk size, against the plain loss and Liger's (when installed)

``fused_linear_cross_entropy(x, weight, target, group=None, chunk=None, ...)`` is the mean (or sum)
cross-entropy of the logits ``x @ weightᵀ`` over non-ignored targets, with ``weight`` this rank's rows of a
vocabulary split over ``group`` (tensor parallelism: rows ``[r·V/tp, (r+1)·V/tp)``, as the column-parallel
LM head holds them; ``group=None``: the whole vocabulary). It walks the tokens ``chunk`` rows at a time:

1. logits of the chunk (``chunk × V/tp``, float32), their local log-sum-exp, the target's logit where this
   rank holds it and (label smoothing) the logits' sum;
2. under TP one all-gather of those three per-token numbers, from which every rank has the global
   log-sum-exp: ``lse = logsumexp_r(lse_r)``;
3. the gradient of the chunk's logits, ``softmax − (1−ε)·onehot − ε/V`` (× 1/count), straight away: its
   product with ``weight`` is the chunk's ``dx`` (this rank's vocabulary's share; the caller's
   ``copy_to_group`` sums it over tp) and with the chunk's ``x`` it adds to ``dweight`` (float32).

So the forward does the backward's work too (as Liger's kernel does): the backward only scales the two
saved gradients by the incoming one. Peak memory beyond the inputs: ``dx`` and ``dweight`` in float32 (the
sizes of ``x`` and ``weight``; ``dweight`` is accumulated over the chunks in float32, by bf16 GEMMs with a
float32 output on CUDA), the gradients handed back in the inputs' dtype, and two ``chunk × V/tp`` float32
buffers. **Chunk arithmetic**: the default makes a
chunk's logits no bigger than ``x`` itself, ``chunk = N·H / (V/tp)`` rows (rounded down to a power of two,
at least 1), so the extra peak is ~``2·|x|`` in float32 whatever the vocabulary: 8192 tokens × 4096 ×
128256 vocab gives 256-row chunks, 2 × 125 MiB of logits, against 4 GiB for the full logits in float32
(and 4 more for their gradient). Matmuls run in the autocast dtype when autocast is on (bf16 on a GPU),
else in the inputs' dtype; the softmax and every accumulation in float32 (float64 for float64 inputs).

The reference it is tested against is ``F.cross_entropy(x @ weightᵀ)`` (one device) and
``vocab_parallel_cross_entropy`` (TP), forward and both gradients.
"""

from __future__ import annotations


import torch

from distlab import comm


def use_triton_ce(x, mm_dtype, grads_in_input_dtype: bool) -> bool:
    """The Triton chunk kernels (``distlab.kernels.triton_ce``) where they pay: on CUDA, bf16/fp16 GEMMs and
    sums in the inputs' dtype (Liger's setting). ``DISTLAB_FUSED_CE_TRITON``: auto (that), 1 (always: the
    interpreter's CPU test), 0 (never)."""
    from distlab import knobs

    choice = knobs.get("FUSED_CE_TRITON")
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"DISTLAB_FUSED_CE_TRITON={choice!r}: auto, 0 or 1")
    if choice == "0" or x.dtype == torch.float64:
        return False
    return choice == "1" or (x.is_cuda and grads_in_input_dtype and mm_dtype in (torch.bfloat16, torch.float16))


def default_chunk(tokens: int, hidden: int, local_vocab: int) -> int:
    """The largest power of two ≤ tokens·hidden / local_vocab (≥ 1): a chunk's logits ≤ the hidden states."""
    rows = max(1, tokens * hidden // max(1, local_vocab))
    return 1 << (min(rows, tokens).bit_length() - 1)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, group, chunk, ignore_index, reduction, smoothing, mm_dtype, grads_in_input_dtype):
        n, local_vocab = x.shape[0], weight.shape[0]
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        tp, start = comm.group_size(group), comm.group_rank(group) * local_vocab
        vocab = local_vocab * tp
        keep = target != ignore_index
        count = keep.sum().clamp_min(1).to(acc) if reduction == "mean" else torch.ones((), dtype=acc, device=x.device)
        w_mm = weight.to(mm_dtype)
        fp32_out_gemm = x.device.type == "cuda"
        dx = torch.empty(x.shape, dtype=x.dtype if grads_in_input_dtype else acc, device=x.device)
        dweight = torch.zeros(weight.shape, dtype=weight.dtype if grads_in_input_dtype else acc, device=x.device)
        total = torch.zeros((), dtype=acc, device=x.device)
        fused = use_triton_ce(x, mm_dtype, grads_in_input_dtype)
        if fused:
            from distlab.kernels.triton_ce import chunk_grad_, chunk_stats
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            xc, tc, kc = x[lo:hi], target[lo:hi], keep[lo:hi]
            local = tc - start
            mine = (local >= 0) & (local < local_vocab) & kc
            idx = local.clamp(0, local_vocab - 1).unsqueeze(-1)
            if fused:   # the logits stay in the GEMM's dtype and become their own gradient (distlab.kernels.triton_ce)
                logits = xc.to(mm_dtype) @ w_mm.t()
                stats = torch.stack(chunk_stats(logits, idx.squeeze(-1), mine)).to(acc)
            else:
                logits = (xc.to(mm_dtype) @ w_mm.t()).to(acc)                  # (c, V/tp)
                stats = torch.stack([torch.logsumexp(logits, -1), logits.gather(-1, idx).squeeze(-1) * mine,
                                     logits.sum(-1)])                          # (3, c)
            if tp > 1:
                every = comm.all_gather_raw(stats[None], group, 0)             # (tp, 3, c)
                lse, target_logit, logit_sum = (torch.logsumexp(every[:, 0], 0), every[:, 1].sum(0),
                                                every[:, 2].sum(0))
            else:
                lse, target_logit, logit_sum = stats
            per_token = lse - target_logit
            if smoothing:
                per_token = (1 - smoothing) * per_token + smoothing * (lse - logit_sum / vocab)
            total += (per_token * kc).sum()
            if fused:
                g_mm = grad = chunk_grad_(logits, lse, idx.squeeze(-1), mine, kc.to(acc) / count, smoothing, vocab)
            else:
                grad = logits.sub_(lse[:, None]).exp_()                        # softmax, in place of the logits
                grad.scatter_add_(-1, idx, -(1 - smoothing) * mine[:, None].to(acc))
                if smoothing:
                    grad.sub_(smoothing / vocab)
                grad.mul_((kc.to(acc) / count)[:, None])
                g_mm = grad.to(mm_dtype)
            dx[lo:hi] = g_mm @ w_mm
            if dweight.dtype == mm_dtype:            # the sum in the weight's dtype (Liger's default)
                dweight.addmm_(g_mm.t(), xc.to(mm_dtype))
            elif fp32_out_gemm and mm_dtype != acc:   # bf16 GEMM into the float32 sum (an fp32 GEMM is ~10x slower)
                torch.addmm(dweight, g_mm.t(), xc.to(mm_dtype), out_dtype=acc, out=dweight)
            else:
                dweight.addmm_(grad.t(), xc.to(acc))
        ctx.save_for_backward(dx, dweight)
        ctx.dtypes = (x.dtype, weight.dtype)
        return total / count

    @staticmethod
    def backward(ctx, grad):   # scaled in place (no second float32 copy of dweight): one backward per forward
        dx, dweight = ctx.saved_tensors
        return (dx.mul_(grad).to(ctx.dtypes[0]), dweight.mul_(grad).to(ctx.dtypes[1]),
                None, None, None, None, None, None, None, None)


def fused_linear_cross_entropy(x, weight, target, group=None, chunk: int | None = None, ignore_index: int = -100,
                               reduction: str = "mean", label_smoothing: float = 0.0, grads_in_input_dtype: bool = False):
    """Cross-entropy of ``x @ weightᵀ`` (x: ``(..., H)``, weight: this rank's ``(V/tp, H)`` rows, target:
    ``(...)`` global ids or ``ignore_index``) without materialising the logits; see the module docstring.
    Under TP pass ``x`` already made ready for the column layer (``comm.copy_to_group``, or gathered along the
    sequence under SP), so its gradient is summed over the group. ``grads_in_input_dtype``: sum dx and dW
    over the chunks in the inputs' dtypes (bf16: half the memory and traffic of float32 sums, one rounding
    per chunk; Liger's default) instead of float32."""
    if x.shape[:-1] != target.shape or x.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"fused_linear_cross_entropy: x {tuple(x.shape)}, weight {tuple(weight.shape)} and target "
                         f"{tuple(target.shape)} do not fit (x (..., H), weight (V/tp, H), target x's leading dims)")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum'; got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing}")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive number of rows; got {chunk!r}")
    comm.check_same_on_every_rank("fused_linear_cross_entropy", comm.tensor_signature(x, weight, target), group,
                                  comm.describe_signature)
    vocab = weight.shape[0] * comm.group_size(group)
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        raise ValueError(f"targets outside the vocabulary [0, {vocab}) (and not ignore_index {ignore_index}): "
                         f"{target[bad][:4].tolist()}")
    x2, t2 = x.reshape(-1, x.shape[-1]), target.reshape(-1)
    chunk = chunk or default_chunk(x2.shape[0], x2.shape[1], weight.shape[0])
    mm_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    with torch.autocast(x.device.type, enabled=False):
        return _FusedLinearCE.apply(x2, weight, t2, group, chunk, ignore_index, reduction, label_smoothing, mm_dtype,
                                    grads_in_input_dtype)


def liger_loss():
    """Liger-Kernel's fused linear cross-entropy (the anchor), or None when it is not installed."""
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda x, w, t: loss(w, x, t)


def measure(tokens: int, hidden: int, vocab: int, chunks: list[int], device, iters: int = 5) -> list[dict]:
    """Per way of computing the loss (plain ``F.cross_entropy((x @ Wᵀ).float())``, fused at each chunk size,
    Liger's when importable): CUDA's peak over forward + backward above the inputs, and the median time of
    forward + backward, GPU and wall (bf16 inputs, as a training step under autocast holds them)."""
    import torch.nn.functional as F

    from distlab.bench import timeit

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16, generator=g) / hidden ** 0.5).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    ways = [("plain", None, lambda: F.cross_entropy((x @ w.t()).float(), t))]
    ways += [("distlab", c, lambda c=c: fused_linear_cross_entropy(x, w, t, chunk=c)) for c in chunks]
    ways += [("distlab bf16 sums", c, lambda c=c: fused_linear_cross_entropy(x, w, t, chunk=c, grads_in_input_dtype=True))
             for c in chunks]
    liger = liger_loss()
    if liger is not None:
        ways.append(("liger", None, lambda: liger(x, w, t)))
    rows = []
    for name, chunk, loss_fn in ways:
        def step():
            x.grad = w.grad = None
            loss = loss_fn()
            loss.backward()
            return loss

        loss = step()
        x.grad = w.grad = None   # the peak then includes the gradients each way allocates
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        rows.append({"way": name, "chunk": chunk, "peak_MiB": peak, "loss": loss.item(),
                     "gpu_ms": 1e3 * timeit(step, iters, 2, x.device), "wall_ms": 1e3 * timeit(step, iters, 2, x.device, "wall")})
    return rows


def main(argv=None):
    from distlab.bench import StudyParser, positive_int, write_json

    p = StudyParser(prog="python -m distlab.kernels.fused_linear_ce", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=positive_int, default=8192)
    p.add_argument("--hidden", type=positive_int, default=4096)
    p.add_argument("--vocab", type=positive_int, nargs="+", default=[128256])
    p.add_argument("--chunks", type=positive_int, nargs="+", default=[64, 256, 1024, 4096])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG", help="peak MiB against chunk rows, one line per vocabulary, the plain "
                   "loss dashed (needs matplotlib)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise ValueError("the peak-memory table reads CUDA's allocator: run it on a GPU")
    out = []
    print(f"{'vocab':>7} {'way':<17} {'chunk':>6} {'':<9} {'peak MiB':>9} {'GPU ms':>8} {'wall ms':>8}  loss")
    for vocab in a.vocab:
        default = default_chunk(a.tokens, a.hidden, vocab)
        for row in measure(a.tokens, a.hidden, vocab, sorted(set(a.chunks + [default])), "cuda"):
            row.update(vocab=vocab, default=row["chunk"] == default)
            out.append(row)
            print(f"{vocab:>7} {row['way']:<17} {str(row['chunk'] or '-'):>6} {'(default)' if row['default'] else '':<9} "
                  f"{row['peak_MiB']:>9.1f} {row['gpu_ms']:>8.2f} {row['wall_ms']:>8.2f}  {row['loss']:.5f}", flush=True)
    if a.json:
        write_json(a.json, {"tokens": a.tokens, "hidden": a.hidden, "rows": out})
    if a.plot:
        plot(out, a.plot, a.tokens, a.hidden)


def plot(rows, path, tokens, hidden) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, vocab in enumerate(sorted({r["vocab"] for r in rows})):
        mine = [r for r in rows if r["vocab"] == vocab]
        fused = sorted((r["chunk"], r["peak_MiB"]) for r in mine if r["way"] == "distlab")
        line, = ax.plot(*zip(*fused), marker="o", label=f"fused, vocab {vocab}")
        ax.axhline(next(r["peak_MiB"] for r in mine if r["way"] == "plain"), ls="--", color=line.get_color(),
                   label=f"F.cross_entropy(x @ Wᵀ), vocab {vocab}")
        for r in mine:
            if r["way"] == "liger":
                ax.axhline(r["peak_MiB"], ls=":", color=line.get_color(), label=f"Liger, vocab {vocab}")
    ax.set(xscale="log", yscale="log", xlabel="chunk (rows)", ylabel="peak MiB (forward + backward)",
           title=f"fused linear + CE, {tokens} tokens x {hidden} hidden, bf16")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    from distlab.bench import run_study

    run_study(main)
