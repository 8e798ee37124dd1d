"""Training: the loss falls, data parallelism equals one device, a resumed run is bit-identical, a
checkpoint saved in one layout resumes in another, model-parallel training follows the DP loss curve."""

import json
import os
import subprocess
import sys

import pytest
import torch

from distlab import comm
from distlab.model import Llama, ModelConfig
from distlab.model.config import TrainConfig, load_config
from distlab.model.data import batch, corpus, decode, encode

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def dp_step_vs_one_device(moe):
    """One AdamW step: each rank its half of the batch + averaged grads == one device on the whole batch."""
    from distlab.train import make_optimizer, train_step

    w, r = comm.group_size(), comm.group_rank()
    mcfg = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, moe_experts=4 if moe else 0)
    tcfg = TrainConfig(seq=16, batch=4, steps=3, warmup=1)
    ids, targets = batch(corpus(), 0, tcfg.batch, tcfg.seq)
    torch.manual_seed(0)
    ref = Llama(mcfg, dtype=torch.float64)
    model = Llama(mcfg, dtype=torch.float64)
    model.load_state_dict(ref.state_dict())
    opt_ref, opt = make_optimizer(ref, tcfg), make_optimizer(model, tcfg)
    loss_ref = train_step(ref, opt_ref, ids, targets, 0, tcfg, group=comm.NO_GROUP)
    per = tcfg.batch // w
    loss = train_step(model, opt, ids[r * per:(r + 1) * per], targets[r * per:(r + 1) * per], 0, tcfg)
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                for a, b in zip(model.parameters(), ref.parameters()))
    return abs(loss - loss_ref), worst


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_data_parallel_step_equals_one_device(pools, world, moe):
    # The weights' bound is AdamW's, not the all-reduce's: its first step moves an element by lr·g/(|g|+eps),
    # so where a gradient cancels to |g| ≲ eps the reduction order's rounding of the summed terms (~1e-16 of
    # max|g| ≈ 2) moves the weight by up to lr·2e-16/eps ≈ 6e-11 of it (one CI run: 1.6e-12, MoE, W=4).
    for loss_diff, weight_err in pools(world).run(dp_step_vs_one_device, moe):
        assert loss_diff < 1e-12 and weight_err < 1e-10, (loss_diff, weight_err)


def test_loss_falls_on_the_shipped_corpus(tmp_path):
    out = tmp_path / "losses.json"
    proc = subprocess.run([sys.executable, "-m", "distlab.train", "--config", "tiny", "--steps", "60", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads(out.read_text())["losses"]
    first, last = losses["0"], min(losses[str(s)] for s in range(50, 60))
    assert first > 5.0 and last < first - 2.0, (first, last)      # from ~ln(256) to well below
    assert "tok/s" in proc.stdout


def test_configs_and_tokenizer():
    from distlab.model.config import CONFIG_DIR, load_layout

    for name in sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json")):
        mcfg, tcfg = load_config(name)                  # every preset parses and validates
        layout = load_layout(name)
        world = layout.get("tp", 1) * layout.get("ring", 1) * layout.get("ulysses", 1)
        assert mcfg.heads % layout.get("tp", 1) == 0 and tcfg.seq % world == 0, name
    assert load_layout("tp2-cp2") == {"tp": 2, "sp": True, "ring": 2}
    mcfg, tcfg = load_config("tiny")
    assert mcfg.vocab == 256 and tcfg.batch % 2 == 0
    assert decode(encode("distlab — ok")) == "distlab — ok"
    with pytest.raises(ValueError, match="no config 'nope'"):
        load_config("nope")
    with pytest.raises(ValueError, match="must split into"):
        ModelConfig(hidden=30, heads=4)


def test_model_parallel_training_follows_the_data_parallel_loss_curve(tmp_path):
    def losses(*flags):
        out = tmp_path / f"{'_'.join(flags) or 'dp'}.json"
        cmd = [sys.executable, "-m", "distlab", "run", "--nproc", "4", "-m", "distlab.train", "--config", "tiny",
               "--steps", "6", "--device", "cpu", "--json", str(out), *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(out.read_text())["losses"]

    dp = losses()
    curve = losses("--tp", "2", "--sp", "--ring", "2")
    assert all(abs(curve[s] - dp[s]) < 1e-4 for s in dp), (curve, dp)            # fp32 summation order only


def test_checkpoint_saved_in_one_layout_resumes_in_another(tmp_path):
    def run(nproc, config, *extra):
        out = tmp_path / f"run{len(list(tmp_path.glob('*.json')))}.json"
        cmd = [sys.executable, "-m", "distlab", "run", "--nproc", str(nproc), "-m", "distlab.train", "--config",
               config, "--steps", "8", "--device", "cpu", "--json", str(out), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(out.read_text())["losses"]

    straight = run(4, "tp2-cp2", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_4", "step_8"]
    same = run(4, "tp2-cp2", "--resume", str(tmp_path / "ckpt" / "step_4"))
    assert sorted(same, key=int) == ["4", "5", "6", "7"]
    assert {s: straight[s] for s in same} == same                       # resumed mid-run: bit for bit
    # TP 2 x CP 2 -> DP 2, stopped ("killed") after two steps: it checkpoints where it stops
    other = run(2, "tiny", "--resume", str(tmp_path / "ckpt" / "step_4"), "--stop-after", "2", "--checkpoint-dir",
                str(tmp_path / "ckpt2"))
    assert sorted(other, key=int) == ["4", "5"] and [p.name for p in (tmp_path / "ckpt2").iterdir()] == ["step_6"]
    assert all(abs(other[s] - straight[s]) < 1e-4 for s in other), (other, straight)


@pytest.mark.parametrize("experts", [0, 4])
def test_flops_per_token_counts_the_weights_a_token_meets(experts):
    from distlab.train import flops_per_token

    cfg = ModelConfig(vocab=256, layers=3, hidden=64, heads=4, kv_heads=2, ffn=96, moe_experts=experts, moe_topk=2)
    model = Llama(cfg)
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("embed"))
    if experts:   # a token meets 2 of the 4 experts (a MoE block has no dense MLP)
        assert all(b.gate_up is None for b in model.blocks)
        weights -= sum(p.numel() for b in model.blocks for p in (b.moe.w_gate, b.moe.w_up, b.moe.w_down)) // 2
    assert flops_per_token(cfg, seq=128) == 6 * weights + 12 * 3 * 64 * 128
