"""distlab next to Hugging Face transformers (the ``hf`` extra): both import in one process, and the models
match transformers' own (built from tiny random configs, nothing downloaded) through the converter.

transformers 5 depends on Hugging Face's ``kernels`` package; distlab's own kernels live under
``distlab.kernels`` so that a checkout or an install of distlab never shadows it.
"""

import os
import subprocess
import sys

import pytest
import torch

from distlab import comm
from distlab.model.llama import Llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_transformers_llama_imports_next_to_distlab_from_the_repo_root():
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    code = ("import distlab.kernels.attention, distlab.model.llama\n"
            "import transformers.models.llama.modeling_llama as m\n"
            "import transformers.models.mixtral.modeling_mixtral\n"
            "print(m.LlamaDecoderLayer.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and "LlamaDecoderLayer" in proc.stdout, proc.stderr[-3000:]


def test_no_top_level_package_named_kernels():
    assert not os.path.exists(os.path.join(ROOT, "kernels")), "a top-level kernels/ shadows Hugging Face's kernels"


# ------------------------------------------------------------------------------ parity with transformers
# Every model is built by transformers itself from a tiny random config (nothing downloaded), its weights
# mapped into distlab by the converter's own functions, and compared in float32: logits, the loss over
# non-ignored targets, and every gradient (mapped the same way), on one device and on gloo ranks.
VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, attn_implementation="eager")
MODELS = {   # name: (model_type, extra config)
    "llama": ("llama", {"rope_theta": 500000.0}),
    "llama3.1-tied-headdim": ("llama", {"tie_word_embeddings": True, "head_dim": 16, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe-norm": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
                                     "norm_topk_prob": True, "head_dim": 8}),
    "qwen3_moe-nonorm": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
                                       "norm_topk_prob": False, "head_dim": 8}),
}


def hf_model(name, seed=0):
    """A transformers model (eval mode, float32) built from MODELS[name] with a fixed seed."""
    import transformers

    kind, extra = MODELS[name]
    config = transformers.AutoConfig.for_model(kind, **{**BASE, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():   # HF initialises RMSNorm weights to 1 and q/k norms alike: make them matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


def converted(hf):
    """(distlab config, one-device Llama) holding the HF model's weights, through the converter's functions."""
    from distlab.model.convert import config_from_hf, from_hf_state

    config = hf.config.to_dict()
    cfg = config_from_hf(config)
    model = Llama(cfg)
    state = from_hf_state(dict(hf.state_dict()), cfg, config["model_type"])
    model.load_state_dict(state, strict=not cfg.tie_embeddings)
    return cfg, model


def hf_batch(seed=1, batch=2, seq=16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    targets = torch.randint(0, VOCAB, (batch, seq), generator=g)
    targets[0, 3:9] = -100           # ignored targets spread unevenly over the rows and the sequence pieces
    targets[1, -1] = -100
    return ids, targets


def hf_reference(hf, ids, targets):
    """transformers' logits, the mean cross-entropy over non-ignored targets, and every gradient mapped to
    distlab's names (the converter's mapping applied to gradients)."""
    from distlab.model.convert import config_from_hf, from_hf_state

    hf.zero_grad()
    logits = hf(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=-100)
    loss.backward()
    cfg = config_from_hf(hf.config.to_dict())
    grads = from_hf_state({n: p.grad for n, p in hf.named_parameters()}, cfg, hf.config.model_type)
    grads = {k: g for k, g in grads.items() if not k.endswith(("router.bias", "router.logit_offset"))}   # buffers
    return logits.detach(), loss.detach(), grads


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", list(MODELS))
def test_one_device_model_matches_transformers(name):
    pytest.importorskip("transformers")
    hf = hf_model(name)
    cfg, model = converted(hf)
    ids, targets = hf_batch()
    want_logits, want_loss, want_grads = hf_reference(hf, ids, targets)
    loss = model.loss(ids, targets)
    loss.backward()
    assert rel(model(ids).detach(), want_logits) < 2e-6       # measured: <= 3.4e-7
    assert rel(loss.detach(), want_loss) < 1e-6
    grads = {n: p.grad for n, p in model.named_parameters()}
    errors = {n: rel(grads[n], g) for n, g in want_grads.items() if n in grads}
    assert set(errors) == {n for n in grads}, set(grads) ^ set(errors)
    assert max(errors.values()) < 1e-5, {n: e for n, e in errors.items() if e >= 1e-5}   # measured: <= 7.1e-7


def parallel_vs_transformers(name, dp, tp, sp, ring, ulysses, layout):
    """Runs on every rank: ParallelLlama from the converted HF weights vs HF's loss and every gradient."""
    from distlab.runtime import Layout
    from distlab.model.parallel import ParallelLlama

    hf = hf_model(name)
    cfg, ref = converted(hf)
    ids, targets = hf_batch(batch=2 * dp)
    _, want_loss, want_grads = hf_reference(hf, ids, targets)
    plan = Layout(comm.group_size(), dp=dp, tp=tp, ring=ring, ulysses=ulysses, sp=sp, cp_layout=layout)
    model = ParallelLlama(ref, plan, plan.build_mesh("cpu"))
    my_ids, my_targets, ctx = model.shard_batch(ids, targets)
    loss = model.loss(my_ids, my_targets, **ctx)
    loss.backward()
    model.sync_gradients()
    n = comm.group_size(model.replica_group)
    mean = comm.all_reduce_raw(loss.detach().reshape(1), model.replica_group).item() / n
    grads = model.full_tensors(lambda p: p.grad)
    assert set(grads) == set(want_grads), set(grads) ^ set(want_grads)
    errors = {k: rel(grads[k], g) for k, g in want_grads.items()}
    return rel(torch.tensor(mean), want_loss), errors


HF_LAYOUTS = [  # (model, world, dp, tp, sp, ring, ulysses, layout)
    ("llama", 2, 1, 2, True, 1, 1, "zigzag"), ("llama", 4, 1, 4, False, 1, 1, "zigzag"),
    ("llama3.1-tied-headdim", 2, 1, 2, False, 1, 1, "zigzag"), ("llama3.1-tied-headdim", 2, 1, 1, False, 2, 1, "zigzag"),
    ("llama", 2, 1, 1, False, 2, 1, "contiguous"), ("llama", 2, 1, 1, False, 1, 2, "contiguous"),
    ("qwen3", 4, 1, 2, True, 2, 1, "zigzag"), ("llama", 4, 2, 1, False, 2, 1, "zigzag"),
    ("mixtral", 4, 1, 2, False, 2, 1, "zigzag"), ("qwen3_moe-nonorm", 2, 1, 1, False, 1, 2, "contiguous"),
    ("qwen3_moe-norm", 4, 2, 2, True, 1, 1, "zigzag"),
]


@pytest.mark.parametrize("name,world,dp,tp,sp,ring,ulysses,layout", HF_LAYOUTS,
                         ids=[f"{m}-dp{d}-tp{t}{'-sp' if s else ''}-ring{r}-uly{u}-{lay}" for m, _, d, t, s, r, u, lay in HF_LAYOUTS])
def test_sharded_model_matches_transformers(pools, name, world, dp, tp, sp, ring, ulysses, layout):
    pytest.importorskip("transformers")
    for loss_err, errors in pools(world).run(parallel_vs_transformers, name, dp, tp, sp, ring, ulysses, layout,
                                             timeout_s=300):
        assert loss_err < 1e-6, loss_err
        assert max(errors.values()) < 1e-5, {k: v for k, v in errors.items() if v >= 1e-5}


def moe_block_vs_transformers(name):
    """Runs on every rank: transformers' sparse-MoE block vs distlab's EP layer built by from_reference; each
    rank routes its own quarter of the tokens, as expert parallelism does."""
    from distlab.moe.layer import MoE

    hf = hf_model(name)
    cfg, ref = converted(hf)
    block = hf.model.layers[0].mlp
    x = torch.randn(4 * comm.group_size(), 5, cfg.hidden, generator=torch.Generator().manual_seed(3))
    want = block(x).detach()
    layer = MoE.from_reference(ref.blocks[0].moe, None)
    mine = slice(comm.group_rank() * 4, comm.group_rank() * 4 + 4)
    return rel(layer(x[mine]).detach(), want[mine]), layer.router.renormalize


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe-norm", "qwen3_moe-nonorm"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_block_matches_transformers_at_every_ep_size(pools, name, world):
    pytest.importorskip("transformers")
    for err, renormalize in pools(world).run(moe_block_vs_transformers, name, timeout_s=300):
        assert err < 2e-6
        assert renormalize == (name != "qwen3_moe-nonorm")


@pytest.mark.parametrize("name", ["llama3.1-tied-headdim", "qwen3", "mixtral", "qwen3_moe-nonorm"])
def test_convert_one_adamw_step_convert_back_equals_the_step_on_the_hf_model(tmp_path, name):
    """HF folder -> distlab checkpoint -> one AdamW step in distlab (train --resume's load) -> checkpoint ->
    HF folder, read by transformers: equal to the same step in plain PyTorch on the HF model."""
    transformers = pytest.importorskip("transformers")
    from distlab.model import checkpoint
    from distlab.model.convert import from_hf, to_hf

    hf = hf_model(name)
    hf.save_pretrained(tmp_path / "hf")
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    cfg = from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt" / "step_0"))
    ids, targets = hf_batch()
    model, opt, step = checkpoint.load(str(tmp_path / "ckpt" / "step_0"), cfg, lambda m: m,
                                       lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    assert step == 0
    model.loss(ids, targets).backward()
    opt.step()
    checkpoint.save(str(tmp_path / "ckpt" / "step_1"), model, opt, 1)
    assert to_hf(str(tmp_path / "ckpt" / "step_1"), str(tmp_path / "back")) == MODELS[name][0]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-2)
    logits = hf(input_ids=ids).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100).backward()
    hf_opt.step()
    mine, want = dict(back.state_dict()), dict(hf.state_dict())
    assert set(mine) == set(want)
    # AdamW's first step moves every weight by about lr·sign(g): compare the steps, with a bar of 2% of lr
    # (float32 gradients that differ in the last bits can flip a step where |g| is near eps)
    moved = max((want[k] - before[k]).abs().max().item() for k in want)
    errors = {k: (mine[k] - want[k]).abs().max().item() for k in want}
    assert 0.5e-2 < moved < 2e-2
    assert max(errors.values()) < 2e-4, {k: v for k, v in errors.items() if v >= 2e-4}


def cp_greedy_decode(path, steps):
    """Runs on every rank: distlab's CP prefill + decode (ring over every rank) from a converted checkpoint."""
    from distlab.infer import generate
    from distlab.model import checkpoint
    from distlab.model.parallel import ParallelLlama
    from distlab.runtime import Layout

    cfg = checkpoint.saved_config(path)
    ref = checkpoint.load_weights(path, cfg)
    layout = Layout(comm.group_size(), ring=comm.group_size())
    tokens, _ = generate(ParallelLlama(ref, layout, layout.build_mesh("cpu")), hf_batch(seq=16)[0], steps)
    return tokens


@pytest.mark.parametrize("name", ["llama3.1-tied-headdim", "mixtral"])
@pytest.mark.parametrize("world", [2, 4])
def test_greedy_decode_from_a_converted_checkpoint_equals_transformers_generate(pools, tmp_path, name, world):
    pytest.importorskip("transformers")
    from distlab.model.convert import from_hf

    hf = hf_model(name)
    hf.save_pretrained(tmp_path / "hf")
    from_hf(str(tmp_path / "hf"), str(tmp_path / "step_0"))
    ids = hf_batch(seq=16)[0]
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:]
    for tokens in pools(world).run(cp_greedy_decode, str(tmp_path / "step_0"), 12, timeout_s=300):
        assert torch.equal(tokens, want), (tokens, want)


def test_converter_refuses_what_distlab_cannot_express(tmp_path):
    pytest.importorskip("transformers")
    from distlab.model.convert import config_from_hf

    base = hf_model("llama").config.to_dict()
    for change, feature in [({"hidden_act": "gelu"}, "activation"), ({"attention_bias": True}, "attention bias"),
                            ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
                            ({"model_type": "qwen2_moe"}, "not one distlab converts")]:
        with pytest.raises(ValueError, match=feature):
            config_from_hf({**base, **change})
    proc = subprocess.run([sys.executable, "-m", "distlab.model.convert", "--from-hf", str(tmp_path), "--to",
                           str(tmp_path / "x")], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2 and "no config.json" in proc.stderr and "Traceback" not in proc.stderr


def test_hf_balancing_loss_is_topk_times_distlabs_aux_loss():
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from distlab.moe.router import load_balancing_loss, route

    logits = torch.randn(40, 6, generator=torch.Generator().manual_seed(0))
    for k in (1, 2, 3):
        _, experts, scores = route(logits, k)
        hf = load_balancing_loss_func((logits,), 6, k)
        assert torch.allclose(hf, k * load_balancing_loss(scores, experts, 6), rtol=1e-6)
