"""Fused linear + cross-entropy (``distlab.kernels.fused_linear_ce``) against the plain loss of the full
logits: one device in float64 at every chunk size, TP on gloo against ``vocab_parallel_cross_entropy``, and
the mini Llama's loss with ``fused_ce`` (one device, TP ± SP, ZeRO) against the plain one."""

import pytest
import torch
import torch.nn.functional as F

from distlab import comm
from distlab.kernels.fused_linear_ce import default_chunk, fused_linear_cross_entropy
from distlab.model import Llama, ModelConfig
from distlab.model.data import batch, corpus
from distlab.model.parallel import ParallelLlama
from distlab.runtime import Layout
from distlab.tp.vocab import vocab_parallel_cross_entropy


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def problem(n=37, h=16, v=48, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=dtype)
    w = torch.randn(v, h, generator=g, dtype=dtype) / h ** 0.5
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100                                    # ignored targets spread through the chunks
    return x, w, t


@pytest.mark.parametrize("chunk", [1, 7, 16, None, 1000])
@pytest.mark.parametrize("smoothing,reduction", [(0.0, "mean"), (0.1, "mean"), (0.0, "sum")])
def test_matches_the_plain_loss_on_one_device(chunk, smoothing, reduction):
    x, w, t = problem()
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = F.cross_entropy(xa @ wa.t(), t, ignore_index=-100, label_smoothing=smoothing, reduction=reduction)
    want.backward()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = fused_linear_cross_entropy(xb, wb, t, chunk=chunk, label_smoothing=smoothing, reduction=reduction)
    (got * 3).backward()                              # the incoming gradient scales both saved ones
    assert abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
    assert rel(xb.grad, 3 * xa.grad) < 1e-12 and rel(wb.grad, 3 * wa.grad) < 1e-12


def test_sums_in_the_input_dtype():
    """bf16 inputs, dx and dW summed in bf16 (one rounding per chunk) against float32 sums."""
    x, w, t = problem(64, 32, 96, dtype=torch.float32)
    x, w = x.bfloat16(), w.bfloat16()
    grads = []
    for in_dtype in (False, True):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        fused_linear_cross_entropy(xa, wa, t, chunk=8, grads_in_input_dtype=in_dtype).backward()
        grads.append((xa.grad.float(), wa.grad.float()))
    assert rel(grads[1][0], grads[0][0]) < 1e-2 and rel(grads[1][1], grads[0][1]) < 2e-2


def test_default_chunk_keeps_a_chunks_logits_under_the_hidden_states():
    assert default_chunk(8192, 4096, 128256) == 256            # the module docstring's example
    assert default_chunk(8192, 4096, 128256 // 8) == 2048      # TP 8: eight times the rows
    assert default_chunk(3, 4096, 16) == 2 and default_chunk(5, 1, 10 ** 6) == 1
    for n, h, v in ((8192, 4096, 128256), (1000, 64, 256), (17, 8, 1000)):
        assert default_chunk(n, h, v) * v <= max(n * h, v)


def test_bad_input_is_refused():
    x, w, t = problem()
    with pytest.raises(ValueError, match="do not fit"):
        fused_linear_cross_entropy(x, w[:, :8], t)
    with pytest.raises(ValueError, match="positive number of rows"):
        fused_linear_cross_entropy(x, w, t, chunk=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fused_linear_cross_entropy(x, w, torch.full_like(t, 48))


def tp_vs_vocab_parallel(smoothing):
    """This rank's vocabulary rows: the fused loss and gradients against vocab_parallel_cross_entropy."""
    n, r = comm.group_size(), comm.group_rank()
    x, w, t = problem(v=12 * n)
    rows = slice(r * 12, (r + 1) * 12)
    xa, wa = x.clone().requires_grad_(), w[rows].clone().requires_grad_()
    want = vocab_parallel_cross_entropy(comm.copy_to_group(xa) @ wa.t(), t, label_smoothing=smoothing)
    want.backward()
    xb, wb = x.clone().requires_grad_(), w[rows].clone().requires_grad_()
    got = fused_linear_cross_entropy(comm.copy_to_group(xb), wb, t, None, chunk=5, label_smoothing=smoothing)
    got.backward()
    return abs(got.item() - want.item()) / abs(want.item()), rel(xb.grad, xa.grad), rel(wb.grad, wa.grad)


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_matches_vocab_parallel_cross_entropy(pools, world):
    for smoothing in (0.0, 0.1):
        for errors in pools(world).run(tp_vs_vocab_parallel, smoothing):
            assert max(errors) < 1e-12, errors


def model_loss_vs_plain(**layout):
    """The mini Llama's loss and every gradient with fused_ce against the plain one-device model, float64."""
    cfg = ModelConfig(vocab=256, layers=2, hidden=64, heads=4, kv_heads=2, ffn=96)
    torch.manual_seed(0)
    ref = Llama(cfg, dtype=torch.float64)
    ids, targets = batch(corpus(), 3, 4, 16)
    ref.loss(ids, targets).backward()
    layout = Layout.for_model(comm.group_size(), **layout)
    model = ParallelLlama(ref, layout, layout.build_mesh("cpu"))
    model.fused_ce = 8                                  # several chunks per rank
    my_ids, my_targets, ctx = model.shard_batch(ids, targets)
    loss = model.loss(my_ids, my_targets, **ctx)
    loss.backward()
    model.sync_gradients()
    grads = (model.zero.full_tensors if model.zero else model.full_tensors)(
        lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
    n = comm.group_size(model.replica_group)
    errors = {"loss": rel(comm.all_reduce_raw(loss.detach().reshape(1), model.replica_group) / n,
                          ref.loss(ids, targets).detach().reshape(1))}
    want = dict(ref.named_parameters())
    errors.update({k: rel(g, want[k].grad) for k, g in grads.items()})
    return errors


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, sp=True), dict(tp=1), dict(dp_shard=2, tp=2)],
                         ids=["tp2", "tp2-sp", "dp2", "zero3-tp2"])
def test_model_loss_with_fused_ce_matches_one_device(pools, layout):
    for errors in pools(4 if layout.get("dp_shard") else 2).run(model_loss_vs_plain, **layout):
        assert max(errors.values()) < 1e-10, {k: v for k, v in errors.items() if v >= 1e-10}


def test_one_device_model_with_fused_ce_matches_the_plain_loss():
    cfg = ModelConfig(vocab=256, layers=1, hidden=32, heads=4, kv_heads=2, ffn=64)
    torch.manual_seed(0)
    plain = Llama(cfg, dtype=torch.float64)
    fused = Llama(cfg, dtype=torch.float64)
    fused.load_state_dict(plain.state_dict())
    fused.fused_ce = True
    ids, targets = batch(corpus(), 0, 2, 32)
    a, b = plain.loss(ids, targets, label_smoothing=0.1), fused.loss(ids, targets, label_smoothing=0.1)
    a.backward()
    b.backward()
    assert abs(a.item() - b.item()) < 1e-12
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert rel(q.grad, p.grad) < 1e-12, name


@pytest.mark.gpu
def test_at_real_size_on_the_gpu():
    """bf16 inputs, 4096 tokens x 2048 hidden x 32000 vocab: the loss and both gradients against the plain
    loss, and the peak memory a quarter of the plain one's or less."""
    from distlab.kernels.fused_linear_ce import measure

    x, w, t = problem(4096, 2048, 32000, dtype=torch.float32)
    x, w, t = x.cuda().bfloat16(), w.cuda().bfloat16(), t.cuda()
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = F.cross_entropy((xa @ wa.t()).float(), t)
    want.backward()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = fused_linear_cross_entropy(xb, wb, t)
    got.backward()
    assert abs(got.item() - want.item()) <= 1e-3 * abs(want.item())
    assert rel(xb.grad.float(), xa.grad.float()) < 2e-2 and rel(wb.grad.float(), wa.grad.float()) < 2e-2
    rows = {r["way"]: r for r in measure(4096, 2048, 32000, [], "cuda", iters=2) if r["way"] != "distlab"}
    fused = measure(4096, 2048, 32000, [default_chunk(4096, 2048, 32000)], "cuda", iters=2)[1]
    assert fused["peak_MiB"] * 2 <= rows["plain"]["peak_MiB"], (fused, rows)


TRITON_CHUNKS = """
import os
os.environ["DISTLAB_FUSED_CE_TRITON"] = "1"
import torch
import torch.nn.functional as F
from distlab.kernels.fused_linear_ce import fused_linear_cross_entropy
g = torch.Generator().manual_seed(0)
x, w = torch.randn(40, 16, generator=g), torch.randn(300, 16, generator=g) / 4
t = torch.randint(0, 300, (40,), generator=g)
t[::5] = -100
worst = 0.0
for smoothing in (0.0, 0.1):
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = F.cross_entropy(xa @ wa.t(), t, ignore_index=-100, label_smoothing=smoothing)
    want.backward()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = fused_linear_cross_entropy(xb, wb, t, chunk=7, label_smoothing=smoothing)
    got.backward()
    worst = max(worst, abs(got.item() - want.item()) / want.item(),
                ((xb.grad - xa.grad).abs().max() / xa.grad.abs().max()).item(),
                ((wb.grad - wa.grad).abs().max() / wa.grad.abs().max()).item())
print("OK" if worst < 1e-5 else f"BAD {worst}")
"""


def test_triton_chunk_kernels_in_the_interpreter():
    """The Triton chunk step (``distlab.kernels.triton_ce``: row statistics, then the softmax gradient in
    place of the logits) against ``F.cross_entropy``, loss and both gradients, ignored rows and smoothing."""
    from distlab.testing import run_in_triton_interpreter

    proc = run_in_triton_interpreter(TRITON_CHUNKS)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout + proc.stderr[-3000:]


@pytest.mark.gpu
def test_triton_chunk_step_on_the_gpu():
    """The Triton chunk step (bf16 logits become their gradient in place; sums in bf16, Liger's setting)
    against the plain float32 loss at 4096 tokens x 2048 x 32000, label smoothing and ignored rows too."""
    from distlab.kernels.fused_linear_ce import use_triton_ce

    x, w, t = problem(4096, 2048, 32000, dtype=torch.float32)
    x, w, t = x.cuda().bfloat16(), w.cuda().bfloat16(), t.cuda()
    assert use_triton_ce(x, torch.bfloat16, True)
    for smoothing in (0.0, 0.1):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        want = F.cross_entropy((xa @ wa.t()).float(), t, label_smoothing=smoothing)
        want.backward()
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        got = fused_linear_cross_entropy(xb, wb, t, label_smoothing=smoothing, grads_in_input_dtype=True)
        got.backward()
        assert abs(got.item() - want.item()) <= 1e-3 * abs(want.item())
        assert rel(xb.grad.float(), xa.grad.float()) < 2e-2 and rel(wb.grad.float(), wa.grad.float()) < 3e-2
