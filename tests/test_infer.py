"""CP prefill + greedy decode with a sharded KV cache (``distlab.infer``) against the one-device model's
greedy decode without a cache: the same 32 tokens, logits to float32 rounding."""

import subprocess
import sys

import pytest
import torch

from distlab import comm
from distlab.infer import generate, generate_packed, greedy_reference, pack_prompts, prompt_ids
from distlab.model import Llama, ModelConfig
from distlab.model.parallel import ParallelLlama
from distlab.runtime import Layout


def parallel(ref, dp, tp, ring, ulysses, cp_layout="zigzag", sp=False, cp_method="ring"):
    """The ParallelLlama of this layout on a new mesh: the pool destroys the groups a task creates when it
    returns (``distlab.testing``), so a mesh cannot outlive its test."""
    layout = Layout(comm.group_size(), dp=dp, tp=tp, ring=ring, ulysses=ulysses, sp=sp, cp_layout=cp_layout,
                    cp_method=cp_method)
    return ParallelLlama(ref, layout, layout.build_mesh("cpu"))


def decode_vs_one_device(dp, tp, ring, ulysses, layout, experts, steps=32, batch=2, kv_cache="paged"):
    cfg = ModelConfig(vocab=256, layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, moe_experts=experts)
    torch.manual_seed(0)
    ref = Llama(cfg)
    with torch.no_grad():   # unit-scale embeddings: a varied greedy sequence (top-2 logit gap >= 6e-3 here)
        ref.embed.weight.normal_(0, 1)
    ids = prompt_ids(None, 48, batch, 16)
    ref_tokens, ref_logits = greedy_reference(ref, ids, steps)
    model = parallel(ref, dp, tp, ring, ulysses, layout)
    with comm.CommLog() as log:
        tokens, logits = generate(model, ids, steps, kv_cache=kv_cache)
    rows = slice(comm.group_rank(model.dp_group) * batch // dp, (comm.group_rank(model.dp_group) + 1) * batch // dp)
    err = ((logits - ref_logits[rows]).abs().max() / ref_logits.abs().max()).item()
    return (tokens == ref_tokens[rows]).all().item(), err, len(set(ref_tokens.flatten().tolist())), dict(log.calls)


LAYOUTS = [  # (world, dp, tp, ring, ulysses, cp layout, experts)
    (2, 1, 1, 2, 1, "zigzag", 0), (4, 1, 1, 4, 1, "zigzag", 0), (4, 1, 1, 4, 1, "contiguous", 0),
    (2, 1, 1, 1, 2, "contiguous", 0), (4, 1, 1, 2, 2, "zigzag", 0), (4, 1, 2, 2, 1, "zigzag", 0),
    (4, 2, 1, 2, 1, "zigzag", 0), (3, 1, 1, 3, 1, "zigzag", 0), (4, 1, 2, 2, 1, "zigzag", 4),
    (8, 2, 2, 2, 1, "zigzag", 8),
]


@pytest.mark.parametrize("world,dp,tp,ring,ulysses,layout,experts", LAYOUTS,
                         ids=[f"dp{d}-tp{t}-ring{r}-uly{u}-{lay}-e{e}" for _, d, t, r, u, lay, e in LAYOUTS])
def test_cp_decode_gives_the_one_device_greedy_tokens(pools, world, dp, tp, ring, ulysses, layout, experts):
    for same, err, distinct, calls in pools(world).run(decode_vs_one_device, dp, tp, ring, ulysses, layout, experts):
        assert distinct > 3                   # a sequence that could differ, not one token repeated
        assert same and err < 1e-5, err
        if ring * ulysses > 1:                # 2 collectives per layer per decode step, over the CP group
            assert calls["all_gather"] >= 2 * 31


@pytest.mark.parametrize("world,tp,ring", [(2, 1, 2), (4, 2, 2)])
def test_contiguous_cache_gives_the_same_tokens(pools, world, tp, ring):
    """The default cache is paged (every test above); the one growing buffer per rank decodes the same."""
    for same, err, _, _ in pools(world).run(decode_vs_one_device, 1, tp, ring, 1, "zigzag", 0, 16, 2, "contiguous"):
        assert same and err < 1e-5, err


def packed_vs_one_device(tp, ring, ulysses, layout, lengths=(5, 40, 23), steps=12, cp_method="ring"):
    """Prompts prefilled as one packed sequence, decoded as a batch at their own positions, against each
    prompt decoded alone on one device (the 5-token prompt leaves some ranks' rows empty)."""
    cfg = ModelConfig(vocab=256, layers=2, hidden=64, heads=4, kv_heads=2, ffn=96)
    torch.manual_seed(0)
    ref = Llama(cfg).double()
    with torch.no_grad():
        ref.embed.weight.normal_(0, 1)
    text = prompt_ids(None, sum(lengths), 1, 1)[0]
    prompts = list(text.split(list(lengths)))
    model = parallel(ref, 1, tp, ring, ulysses, layout, cp_method=cp_method)
    tokens, logits = generate_packed(model, prompts, steps)
    refs = [greedy_reference(ref, q[None], steps) for q in prompts]
    want_tokens, want_logits = torch.cat([r[0] for r in refs]), torch.cat([r[1] for r in refs])
    err = ((logits - want_logits).abs().max() / want_logits.abs().max()).item()
    return torch.equal(tokens, want_tokens), err, len(set(want_tokens.flatten().tolist()))


PACKED = [(1, 1, 1, 1, "contiguous"), (4, 1, 4, 1, "balanced"), (4, 1, 2, 2, "zigzag"), (4, 2, 2, 1, "contiguous"),
          (3, 1, 3, 1, "zigzag")]


@pytest.mark.parametrize("world,tp,ring,ulysses,layout", PACKED,
                         ids=[f"tp{t}-ring{r}-uly{u}-{lay}" for _, t, r, u, lay in PACKED])
def test_packed_prompts_decode_as_each_alone(pools, world, tp, ring, ulysses, layout):
    for same, err, distinct in pools(world).run(packed_vs_one_device, tp, ring, ulysses, layout):
        assert distinct > 3 and same and err < 1e-10, err


def test_allgather_kv_prefill_decodes_as_each_alone(pools):
    """``--cp-method allgather``: the packed prefill's attention is all-gather KV; the decode is the same."""
    for same, err, distinct in pools(4).run(packed_vs_one_device, 1, 4, 1, "zigzag", cp_method="allgather"):
        assert distinct > 3 and same and err < 1e-10, err


def test_packed_prompts_refused_where_they_cannot_run():
    with pytest.raises(ValueError, match="needs --kv-cache paged"):
        pack_prompts("4,8", "contiguous", Layout(2, dp=1, ring=2))
    with pytest.raises(ValueError, match="leaves 2 data-parallel ranks"):
        pack_prompts("4,8", "paged", Layout(2, dp=2))
    with pytest.raises(ValueError, match="comma-separated prompt lengths"):
        pack_prompts("4;8", "paged", Layout(1))
    with pytest.raises(ValueError, match="but the corpus has"):
        pack_prompts("4,999999999", "paged", Layout(1))


def sp_model_refused():
    model = parallel(Llama(ModelConfig()), 1, 2, 1, 1, sp=True)
    generate(model, prompt_ids(None, 16, 1, 2), 2)


def test_sequence_parallel_model_refused_on_every_rank(pools):
    outcome = pools(2).run_all(sp_model_refused, timeout_s=60)
    assert all(not ok and "without sequence parallelism" in msg for ok, msg in outcome), outcome


def test_prompt_is_trimmed_to_what_the_layout_needs():
    assert prompt_ids("abcdefghij", 0, 2, 4).shape == (2, 8)
    with pytest.raises(ValueError, match="needs a multiple of 16"):
        prompt_ids("abc", 0, 1, 16)


def test_infer_command_checks_itself():
    out = subprocess.run([sys.executable, "-m", "distlab.infer", "--config", "tiny", "--steps", "8", "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "8/8 tokens equal" in out.stdout and "PASS" in out.stdout


def static_step_vs_eager(packed, steps=12):
    """The graph-ready decode step (``distlab.graphed_decode``: static buffers, slots computed on the device,
    blocks reserved) run eagerly, against the ordinary decode: the same tokens and logits (float64)."""
    cfg = ModelConfig(vocab=256, layers=2, hidden=64, heads=4, kv_heads=2, ffn=96)
    torch.manual_seed(0)
    ref = Llama(cfg).double()
    with torch.no_grad():
        ref.embed.weight.normal_(0, 1)
    model = parallel(ref, 1, 1, 1, 1, "contiguous")
    if packed:   # three prompts at their own positions; 17 + 11 steps crosses a 16-token block
        text = prompt_ids(None, 60, 1, 1)[0]
        prompts = list(text.split([17, 30, 13]))
        runs = [generate_packed(model, prompts, steps, static_step=s) for s in (None, "eager")]
    else:
        ids = prompt_ids(None, 32, 2, 16)
        runs = [generate(model, ids, steps, static_step=s) for s in (None, "eager")]
    (tokens, logits), (s_tokens, s_logits) = runs
    return torch.equal(tokens, s_tokens), (logits - s_logits).abs().max().item(), len(set(tokens.flatten().tolist()))


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_graph_ready_decode_step_matches_the_eager_decode(pools, packed):
    for same, err, distinct in pools(1).run(static_step_vs_eager, packed):
        assert distinct > 3 and same and err < 1e-12, err


def test_cuda_graph_decode_refused_where_it_cannot_run():
    from distlab.graphed_decode import check_graphable

    dense, moe = ModelConfig(), ModelConfig(moe_experts=4)
    with pytest.raises(ValueError, match="a CUDA device"):
        check_graphable(dense, Layout(1), "paged", "cpu")
    with pytest.raises(ValueError, match=r"one process \(this run has 2.*--kv-cache paged.*a dense model"):
        check_graphable(moe, Layout(2, dp=1, ring=2), "contiguous", "cuda")
    with pytest.raises(ValueError, match=r"head_dim \(24\) and q heads per kv head \(3\) powers of two"):
        check_graphable(ModelConfig(hidden=72, heads=3, kv_heads=1), Layout(1), "paged", "cuda")
    check_graphable(dense, Layout(1), "paged", "cuda")   # what the GPU run takes: no complaint
    if not torch.cuda.is_available():   # the command says so in one line, no traceback
        out = subprocess.run([sys.executable, "-m", "distlab.infer", "--config", "tiny", "--steps", "4",
                              "--cuda-graph"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "--cuda-graph needs a CUDA device" in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr


@pytest.mark.gpu
def test_cuda_graph_decode_gives_the_one_device_tokens():
    out = subprocess.run([sys.executable, "-m", "distlab.infer", "--config", "tiny", "--steps", "40", "--check",
                          "--cuda-graph"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "40/40 tokens equal" in out.stdout and "CUDA-graphed step" in out.stdout
