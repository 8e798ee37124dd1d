"""distlab/kernels/attention.py: every backend against whole-matrix float64 attention, forward and backward.

The property context parallelism relies on is tested directly: attention over keys cut into blocks,
each block's (out, lse) merged, then each block's backward run with the *merged* out and lse, must give
the whole attention's output and gradients (dK/dV per block, dQ summed over blocks).
"""

import pytest
import torch

import distlab.kernels.attention as attn
from distlab.kernels.lse_merge import merge_attention
from distlab.kernels.attention import attention_backward, attention_forward, attention_reference


def make(batch=2, seq=40, heads=4, kv_heads=2, head_dim=16, dtype=torch.float64, device="cpu", seed=0, seq_k=None):
    g = torch.Generator().manual_seed(seed)
    sk = seq if seq_k is None else seq_k
    q = torch.randn(batch, seq, heads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, sk, kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, sk, kv_heads, head_dim, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, seq, heads, head_dim, generator=g, dtype=torch.float64)
    return [t.to(device, dtype) for t in (q, k, v, dout)]


def reference(q, k, v, dout, causal, scale=None):
    """float64 output, lse and grads through autograd on the whole score matrix."""
    full = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out = attention_reference(*full, causal=causal, softmax_scale=scale)
    out.backward(dout.double())
    groups = q.shape[2] // k.shape[2]
    s = scale if scale is not None else q.shape[-1] ** -0.5
    scores = full[0].detach().transpose(1, 2) @ full[1].detach().repeat_interleave(groups, 2).permute(0, 2, 3, 1) * s
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    return out.detach(), scores.logsumexp(-1), *(t.grad for t in full)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("block_bytes", [1, 2 * 2**20], ids=["16-row-blocks", "one-block"])
def test_torch_backend_matches_reference(monkeypatch, causal, heads, kv_heads, dtype, tol, block_bytes):
    monkeypatch.setattr(attn, "block_bytes", block_bytes)
    q, k, v, dout = make(heads=heads, kv_heads=kv_heads, dtype=dtype)
    want = reference(q, k, v, dout, causal, scale=0.3)
    out, lse = attention_forward(q, k, v, causal, softmax_scale=0.3, backend="torch")
    grads = attention_backward(dout, q, k, v, out, lse, causal, softmax_scale=0.3, backend="torch")
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    for name, got, exp in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want):
        assert got.dtype == (lse.dtype if name == "lse" else dtype)
        assert rel(got, exp) < tol, f"{name}: {rel(got, exp):.2e}"


def split_keys_then_merge(q, k, v, dout, backend, cuts):
    """Blockwise attention over key ranges, merged through the LSE; backward per block with merged stats."""
    out = lse = None
    bounds = list(zip([0] + cuts, cuts + [k.shape[1]]))
    for a, b in bounds:
        o, l = attention_forward(q, k[:, a:b], v[:, a:b], backend=backend)
        out, lse = merge_attention(out, lse, o, l)
    out = out.to(q.dtype)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dks, dvs = [], []
    for a, b in bounds:
        dq_b, dk_b, dv_b = attention_backward(dout, q, k[:, a:b], v[:, a:b], out, lse, backend=backend)
        dq += dq_b.float()
        dks.append(dk_b)
        dvs.append(dv_b)
    return out, lse, dq, torch.cat(dks, 1), torch.cat(dvs, 1)


def test_blockwise_with_global_lse_equals_whole_attention():
    q, k, v, dout = make(seq=32, seq_k=48, dtype=torch.float32)
    want = reference(q, k, v, dout, causal=False)
    got = split_keys_then_merge(q, k, v, dout, "torch", [10, 30])
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert rel(g, w) < 1e-5, name


@pytest.mark.parametrize("bad,message", [
    (lambda q, k, v: (q[0], k, v), "4-D tensor"),
    (lambda q, k, v: (q, k.double(), v), "share a dtype"),
    (lambda q, k, v: (q, k, v[:, :, :1]), "same shape"),
    (lambda q, k, v: (q[:, :, :3], k, v), "multiple of kv heads"),
    (lambda q, k, v: (q[..., :8], k, v), "batch and head_dim"),
    (lambda q, k, v: (q.long(), k.long(), v.long()), "floating point"),
])
def test_bad_inputs_are_refused(bad, message):
    q, k, v, _ = make(dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        attention_forward(*bad(q, k, v))


def test_results_written_into_given_views():
    """``into``: forward and backward results land in the tensors given (views of wider heads, as all-gather
    CP's kv-head groups hand them), equal to the allocated ones; None entries allocate; wrong shapes refused."""
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 12, 4, 8, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 12, 2, 8, dtype=torch.float64, generator=g) for _ in range(2))
    out, lse = attention_forward(q, k, v, True, backend="torch")
    grads = attention_backward(dout, q, k, v, out, lse, True, backend="torch")
    wide_out, wide_lse = torch.zeros(1, 12, 8, 8, dtype=torch.float64), torch.zeros(1, 8, 12, dtype=torch.float32)
    got = attention_forward(q, k, v, True, backend="torch", into=(wide_out[:, :, 4:], wide_lse[:, 4:]))
    assert got[0].data_ptr() == wide_out[:, :, 4:].data_ptr() and got[1].data_ptr() == wide_lse[:, 4:].data_ptr()
    assert torch.equal(wide_out[:, :, 4:], out) and torch.equal(wide_lse[:, 4:], lse.float())
    assert not wide_out[:, :, :4].any() and not wide_lse[:, :4].any()
    wide_dq = torch.zeros(1, 12, 8, 8, dtype=torch.float64)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, True, backend="torch", into=(wide_dq[:, :, :4], None, None))
    assert dq.data_ptr() == wide_dq.data_ptr() and not wide_dq[:, :, 4:].any()
    for a, b in zip((dq, dk, dv), grads):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="into: a tensor"):
        attention_forward(q, k, v, True, backend="torch", into=(wide_out, None))


def test_causal_needs_equal_lengths_and_backends_are_checked():
    q, k, v, _ = make(dtype=torch.float32, seq_k=24)
    with pytest.raises(ValueError, match="seq_q == seq_k"):
        attention_forward(q, k, v, causal=True)
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_forward(q, k, v, backend="nope")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cannot run"):
            attention_forward(q, k, v, backend="sdpa-flash")
    assert attn.resolve_backend("auto", "cpu", torch.float32) == "torch"


# ------------------------------------------------------------------------------------------------------
# GPU: the SDPA backends (skipped without CUDA)
# ------------------------------------------------------------------------------------------------------
GPU_CASES = [(b, dt) for b in ("sdpa-cudnn", "sdpa-flash") for dt in (torch.bfloat16, torch.float16)]
GPU_CASES += [("sdpa-efficient", torch.float32), ("torch", torch.bfloat16)]
GPU_CASES += [("triton", dt) for dt in (torch.bfloat16, torch.float16)]


def _gpu_backend_or_skip(backend, dtype):
    if backend not in attn.available_backends("cuda", dtype):
        pytest.skip(f"{backend} not present for {dtype} here")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype", GPU_CASES, ids=[f"{b}-{str(d)[6:]}" for b, d in GPU_CASES])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_backend_matches_reference(backend, dtype, causal, head_dim):
    _gpu_backend_or_skip(backend, dtype)
    q, k, v, dout = make(batch=2, seq=512, heads=8, kv_heads=2, head_dim=head_dim, dtype=dtype, device="cuda")
    want = reference(q, k, v, dout, causal)
    out, lse = attention_forward(q, k, v, causal, backend=backend)
    grads = attention_backward(dout, q, k, v, out, lse, causal, backend=backend)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, got, exp in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want):
        assert got.shape == exp.shape, name
        assert rel(got, exp) < tol, f"{backend} {name}: {rel(got, exp):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype", GPU_CASES, ids=[f"{b}-{str(d)[6:]}" for b, d in GPU_CASES])
def test_gpu_backend_blockwise_with_global_lse(backend, dtype):
    """What a ring step does with these kernels: the backward with merged (out, lse) of other blocks."""
    _gpu_backend_or_skip(backend, dtype)
    q, k, v, dout = make(batch=1, seq=256, seq_k=384, heads=8, kv_heads=4, head_dim=128, dtype=dtype, device="cuda")
    want = reference(q, k, v, dout, causal=False)
    got = split_keys_then_merge(q, k, v, dout, backend, [128, 256])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert rel(g, w) < tol, f"{backend} {name}: {rel(g, w):.2e}"


# ------------------------------------------------------------------------------------------- FlashAttention-4
def test_fa4_without_its_package_or_a_gpu_is_a_clear_error():
    from distlab.kernels.attention import resolve_backend

    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="FlashAttention-4.*(CUDA GPUs|flash-attn-4)"):
        attention_forward(q, q, q, True, backend="fa4")
    with pytest.raises(ValueError, match="fa4"):
        resolve_backend("fa4", "cpu", torch.float32)
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "torch"   # auto never picks what cannot run


def _fa4_or_skip():
    from distlab.kernels import fa4

    if not fa4.runs_on("cuda", torch.bfloat16):
        pytest.skip(f"fa4 cannot run here: {fa4.why_not('cuda', torch.bfloat16)}")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads,causal", [(8, True), (2, True), (8, False)])
def test_fa4_matches_the_float32_reference(kv_heads, causal):
    """Forward (out, LSE) and backward of FA4 against whole-matrix float32 attention: GQA, causal and not."""
    _fa4_or_skip()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 1024, kv_heads, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    full = [t.float().requires_grad_(True) for t in (q, k, v)]
    want = attention_reference(*full, causal=causal)
    want.backward(dout.float())
    _, want_lse = attention_forward(*(t.detach() for t in full), causal, backend="torch")
    out, lse = attention_forward(q, k, v, causal, backend="fa4")
    grads = attention_backward(dout, q, k, v, out, lse, causal, backend="fa4")
    rel = lambda a, b: ((a.float() - b).abs().max() / b.abs().max()).item()  # noqa: E731
    assert rel(out, want.detach()) < 2e-2 and (lse - want_lse).abs().max() < 2e-2
    for got, ref in zip(grads, (t.grad for t in full)):
        assert got.shape == ref.shape and rel(got, ref) < 3e-2


@pytest.mark.gpu
def test_fa4_block_with_the_global_lse_as_a_ring_step():
    """Two key blocks merged through the LSE equal one call; each block's backward with the *global* out and
    LSE sums to the whole gradient, as a ring step uses the backend."""
    from distlab.kernels.lse_merge import merge_attention

    _fa4_or_skip()
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, 512, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    parts = [attention_forward(q, k[:, a:a + 512], v[:, a:a + 512], False, backend="fa4") for a in (0, 512)]
    out, lse = merge_attention(*merge_attention(None, None, *parts[0]), *parts[1])
    whole, whole_lse = attention_forward(q, k, v, False, backend="fa4")
    assert (out - whole.float()).abs().max() < 2e-2 and (lse - whole_lse).abs().max() < 1e-2
    out = out.to(q.dtype)
    blocks = [attention_backward(dout, q, k[:, a:a + 512], v[:, a:a + 512], out, lse, False, backend="fa4")
              for a in (0, 512)]
    dq, dk, dv = attention_backward(dout, q, k, v, whole, whole_lse, False, backend="fa4")
    assert ((blocks[0][0].float() + blocks[1][0].float()) - dq.float()).abs().max() < 5e-2
    assert (torch.cat([blocks[0][1], blocks[1][1]], 1).float() - dk.float()).abs().max() < 5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads,causal", [(2, True), (8, False)])
def test_fa4_replayed_forward_equals_a_call_through_its_interface(kv_heads, causal):
    """The replayed forward (FA4's compiled kernel called directly, distlab.kernels.fa4) gives the very bits
    a call through FlashAttention-4's interface gives, and a second call of a shape is a replay."""
    _fa4_or_skip()
    from distlab import knobs
    from distlab.kernels import fa4

    g = torch.Generator(device="cpu").manual_seed(3)
    q = torch.randn(2, 777, 8, 128, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(2, 777, kv_heads, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    with knobs.override(FA4_REPLAY="0"):
        want, want_lse = fa4.fa4_forward(q, k, v, causal, 0.088)
    before = fa4.REPLAYED[0]
    runs = [fa4.fa4_forward(q, k, v, causal, 0.088) for _ in range(3)]
    assert fa4.REPLAYED[0] - before == 2, "the second and third calls should be replays"
    for out, lse in runs:
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    q2 = torch.randn_like(q)   # new data, same shape: a replay computes on it, not on what was recorded
    with knobs.override(FA4_REPLAY="0"):
        want2, _ = fa4.fa4_forward(q2, k, v, causal, 0.088)
    assert torch.equal(fa4.fa4_forward(q2, k, v, causal, 0.088)[0], want2)
