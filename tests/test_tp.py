"""Tensor and sequence parallelism on real gloo groups against the one-device layers.

Every rank builds the one-device module from the same seed, shards it with ``from_linear`` / the TP block's
constructor, runs both, and compares the output, the input's gradient and every parameter's gradient
(gathered back to the one-device layout) at 1e-5 relative in float32 vs float64. A missing all-reduce of a
replicated parameter's gradient under SP (Megatron-LM #1446), a wrong shard of a fused projection, or a
wrong adjoint (all-gather vs reduce-scatter) moves a gradient by O(1).
"""

import pytest
import torch
import torch.nn.functional as F

from distlab import comm
from distlab.tp.block import LlamaBlock, TPLlamaBlock
from distlab.tp.linear import ColumnParallelLinear, RowParallelLinear
from distlab.tp.norm import RMSNorm
from distlab.tp.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def seq_shard(x, sp):
    return comm.split_to_group(x, None, 1).detach() if sp else x


def seq_gather(x, sp):
    return comm.all_gather_raw(x, None, 1) if sp else x


# ------------------------------------------------------------------------------------------------------
# column + row pair
# ------------------------------------------------------------------------------------------------------
def linear_pair(sp, gather_output):
    torch.manual_seed(0)
    col_ref, row_ref = torch.nn.Linear(12, 24, dtype=torch.float64), torch.nn.Linear(24, 12, dtype=torch.float64)
    x = torch.randn(2, 12, 12, dtype=torch.float64)
    w = torch.randn(2, 12, 12, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    ((row_ref(F.gelu(col_ref(xr)))) * w).sum().backward()

    col = ColumnParallelLinear.from_linear(col_ref, None, gather_output=gather_output, sequence_parallel=sp)
    row = RowParallelLinear.from_linear(row_ref, None, input_is_parallel=not gather_output, sequence_parallel=sp)
    for m in (col, row):
        m.float()
    xl = seq_shard(x.float(), sp).requires_grad_(True)
    with comm.CommLog() as log:
        y = row(F.gelu(col(xl)))
    (y * seq_shard(w.float(), sp)).sum().backward()
    got = {"y": seq_gather(y.detach(), sp), "dx": seq_gather(xl.grad, sp),
           "col.w": comm.all_gather_raw(col.weight.grad, None, 0),
           "col.b": comm.all_gather_raw(col.bias.grad, None, 0),
           "row.w": comm.all_gather_raw(row.weight.grad, None, 1), "row.b": row.bias.grad}
    want = {"y": row_ref(F.gelu(col_ref(x))).detach(), "dx": xr.grad, "col.w": col_ref.weight.grad,
            "col.b": col_ref.bias.grad, "row.w": row_ref.weight.grad, "row.b": row_ref.bias.grad}
    return {k: rel(got[k], want[k]) for k in want}, dict(log.calls)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["tp", "sp", "gather_output"])
def test_column_row_pair_matches_one_device(pools, world, mode):
    for errors, calls in pools(world).run(linear_pair, mode == "sp", mode == "gather_output"):
        assert max(errors.values()) < 1e-5, errors
        if world > 1:
            want = {"tp": {"all_reduce": 1}, "sp": {"all_gather": 1, "reduce_scatter": 1},
                    "gather_output": {"all_gather": 1, "all_reduce": 1}}[mode]
            assert calls == want


# ------------------------------------------------------------------------------------------------------
# SP RMSNorm: the replicated weight's gradient is summed over TP
# ------------------------------------------------------------------------------------------------------
def sp_norm_grads():
    torch.manual_seed(1)
    ref = RMSNorm(16, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    x, w = torch.randn(2, 8, 16, dtype=torch.float64), torch.randn(2, 8, 16, dtype=torch.float64)
    (ref(x) * w).sum().backward()
    results = {}
    for sp in (True, False):  # sequence_parallel=False here = the bug: the shard-local gradient only
        norm = RMSNorm.from_norm(ref, None, sequence_parallel=sp)
        xl = seq_shard(x, True).requires_grad_(True)
        (norm(xl) * seq_shard(w, True)).sum().backward()
        results[sp] = (rel(seq_gather(norm(xl).detach(), True), ref(x).detach()), rel(norm.weight.grad, ref.weight.grad))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_sp_rmsnorm_weight_grad_is_all_reduced(pools, world):
    for res in pools(world).run(sp_norm_grads):
        out_err, grad_err = res[True]
        assert out_err < 1e-12 and grad_err < 1e-12
        assert res[False][1] > 1e-2          # without the all-reduce each rank has only its tokens' part


# ------------------------------------------------------------------------------------------------------
# vocab-parallel embedding and cross-entropy
# ------------------------------------------------------------------------------------------------------
def vocab_parallel(sp, smoothing=0.0):
    torch.manual_seed(2)
    vocab, dim = 24, 8
    emb_ref, head_ref = torch.nn.Embedding(vocab, dim, dtype=torch.float64), torch.nn.Linear(dim, vocab, bias=False,
                                                                                             dtype=torch.float64)
    ids = torch.randint(0, vocab, (2, 12))
    target = torch.randint(0, vocab, (2, 12))
    target[0, :3] = -100                                        # ignored tokens
    loss_ref = F.cross_entropy(head_ref(emb_ref(ids)).view(-1, vocab), target.view(-1), ignore_index=-100,
                               label_smoothing=smoothing)
    loss_ref.backward()
    emb = VocabParallelEmbedding.from_embedding(emb_ref, None, sequence_parallel=sp)
    head = ColumnParallelLinear.from_linear(head_ref, None, sequence_parallel=sp)
    hidden = emb(ids)                                           # replicated, or this rank's sequence shard
    logits = head(hidden)                                       # (2, 12, vocab/tp): never gathered
    loss = vocab_parallel_cross_entropy(logits, target, None, ignore_index=-100, label_smoothing=smoothing)
    loss.backward()
    return {"loss": rel(loss.detach(), loss_ref.detach()),
            "emb": rel(comm.all_gather_raw(emb.weight.grad, None, 0), emb_ref.weight.grad),
            "head": rel(comm.all_gather_raw(head.weight.grad, None, 0), head_ref.weight.grad),
            "logits_width": logits.shape[-1]}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("sp,smoothing", [(False, 0.0), (True, 0.0), (False, 0.1)], ids=["tp", "sp", "tp-smoothing"])
def test_vocab_parallel_embedding_and_cross_entropy(pools, world, sp, smoothing):
    for res in pools(world).run(vocab_parallel, sp, smoothing):
        assert res["logits_width"] == 24 // world
        assert max(res["loss"], res["emb"], res["head"]) < 1e-12, res


def bad_vocab_input(case):
    """Uneven vocabulary slices, and ids / targets outside the vocabulary: refused on every rank."""
    comm.forget_agreed()
    world, rank = comm.group_size(), comm.group_rank()
    target = torch.randint(0, 8 * world, (2, 5), generator=torch.Generator().manual_seed(0))
    try:
        if case == "uneven_slices":   # an unpadded vocabulary of 8·W - 1: the last rank holds one row fewer
            vocab_parallel_cross_entropy(torch.randn(2, 5, 8 - (rank == world - 1)), target)
        elif case == "target_out_of_range":
            vocab_parallel_cross_entropy(torch.randn(2, 5, 8), target.index_fill(1, torch.tensor([2]), 8 * world))
        elif case == "negative_target":
            vocab_parallel_cross_entropy(torch.randn(2, 5, 8), target.index_fill(1, torch.tensor([2]), -3))
        elif case == "ignored_targets_pass":
            return str(vocab_parallel_cross_entropy(torch.randn(2, 5, 8), target.index_fill(1, torch.tensor([2]), -100)).item())
        elif case == "id_out_of_range":
            VocabParallelEmbedding(8 * world, 4)(torch.tensor([[0, 8 * world]]))
        elif case == "negative_id":
            VocabParallelEmbedding(8 * world, 4)(torch.tensor([[-1, 3]]))
        return "no error"
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("case,message", [("uneven_slices", "different inputs"),
                                          ("target_out_of_range", "outside the vocabulary"),
                                          ("negative_target", "outside the vocabulary"),
                                          ("id_out_of_range", "outside the vocabulary"),
                                          ("negative_id", "outside the vocabulary")])
def test_bad_vocabulary_inputs_are_refused_on_every_rank(pools, case, message):
    for rank, text in enumerate(pools(3).run(bad_vocab_input, case, timeout_s=60)):
        assert message in text, (rank, text)


def test_ignore_index_stays_allowed(pools):
    assert all(float(x) > 0 for x in pools(2).run(bad_vocab_input, "ignored_targets_pass"))


def test_vocab_cross_entropy_is_stable_for_huge_logits():
    logits = torch.tensor([[1000.0, 0.0, -1000.0], [0.0, 3.0, 1.0]], dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 1])
    loss = vocab_parallel_cross_entropy(logits, target)
    ref = F.cross_entropy(logits, target)
    assert torch.isfinite(loss) and torch.allclose(loss, ref)


# ------------------------------------------------------------------------------------------------------
# the whole Llama block
# ------------------------------------------------------------------------------------------------------
BLOCK_SHAPES = {1: (64, 128, 8, 2), 2: (64, 128, 8, 2), 3: (48, 96, 6, 3), 4: (64, 128, 8, 2)}


def block_vs_one_device(sp, kv_heads=None, async_tp=False):
    tp = comm.group_size()
    hidden, ffn, heads, kv = BLOCK_SHAPES[tp]
    kv = kv_heads or kv
    torch.manual_seed(3)
    ref = LlamaBlock(hidden, ffn, heads, kv, dtype=torch.float64)
    with torch.no_grad():
        for n in (ref.norm1, ref.norm2):
            n.weight.uniform_(0.5, 1.5)
    x, w = torch.randn(2, 12, hidden, dtype=torch.float64), torch.randn(2, 12, hidden, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    out_ref = ref(xr)
    (out_ref * w).sum().backward()

    block = TPLlamaBlock(ref, None, sequence_parallel=sp, async_tp=async_tp).float()
    xl = seq_shard(x.float(), sp).requires_grad_(True)
    with comm.CommLog() as log_fwd:
        out = block(xl)
    with comm.CommLog() as log_bwd:
        (out * seq_shard(w.float(), sp)).sum().backward()
    block.sync_replicated_kv_grads()
    got = block.full_grads()
    errors = {f"grad {k}": rel(got[k], getattr(ref, k).weight.grad) for k in got}
    errors["out"] = rel(seq_gather(out.detach(), sp), out_ref.detach())
    errors["dx"] = rel(seq_gather(xl.grad, sp), xr.grad)
    return errors, dict(log_fwd.calls), dict(log_bwd.calls), block.kv_copies


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_llama_block_matches_one_device(pools, world, sp):
    for errors, fwd, bwd, copies in pools(world).run(block_vs_one_device, sp):
        assert max(errors.values()) < 1e-5, errors
        if world == 1:
            continue
        # the design's collectives: TP fwd 2 all-reduces; SP fwd 2 all-gathers + 2 reduce-scatters
        assert fwd == ({"all_gather": 2, "reduce_scatter": 2} if sp else {"all_reduce": 2})
        # backward: the adjoints, plus (SP) the all-reduce of each norm weight's gradient
        # (SP keeps only the local input of each column GEMM and all-gathers it again for dW, as Megatron)
        assert bwd == ({"all_gather": 4, "reduce_scatter": 2, "all_reduce": 2} if sp else {"all_reduce": 2})
        assert copies == (2 if world == 4 else 1)               # 2 kv heads on 4 ranks: each copied twice


@pytest.mark.parametrize("world", [2, 3, 4])
def test_async_tp_block_matches_one_device(pools, world):
    """Ring-step all-gather/reduce-scatter overlapped with chunk GEMMs: same numbers as the plain SP path."""
    for errors, fwd, bwd, _ in pools(world).run(block_vs_one_device, True, None, True):
        assert max(errors.values()) < 1e-5, errors
        assert fwd == {"async_tp_ag": 2 * (world - 1), "async_tp_rs": 2 * (world - 1)}
        assert bwd == {"async_tp_ag": 4 * (world - 1), "async_tp_rs": 2 * (world - 1), "all_reduce": 2}


def test_llama_block_kv_heads_divisible_by_tp(pools):
    for errors, _, _, copies in pools(4).run(block_vs_one_device, True, 4):
        assert copies == 1 and max(errors.values()) < 1e-5, errors


def tp_errors(case):
    if case == "features":
        return ColumnParallelLinear(8, 10, group=None)
    if case == "row_features":
        return RowParallelLinear(10, 8, group=None)
    if case == "heads":
        return TPLlamaBlock(LlamaBlock(40, 64, 5, 5))
    if case == "vocab":
        return VocabParallelEmbedding(25, 8)


@pytest.mark.parametrize("case,message", [("features", "output features (10) is not divisible by the tensor-parallel size 4"),
                                          ("row_features", "input features (10) is not divisible"),
                                          ("heads", "q heads (5) are not divisible"),
                                          ("vocab", "vocabulary size (25) is not divisible")])
def test_indivisible_dims_refused_on_every_rank(pools, case, message):
    outcome = pools(4).run_all(tp_errors, case, timeout_s=30)
    assert all(not ok and message in msg for ok, msg in outcome), outcome


ENV = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}


def test_tp_study_cli(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "tp.json"
    base = [sys.executable, "-m", "distlab", "run", "--nproc", "2", "-m", "distlab.tp", "--hidden", "64", "--ffn", "128",
            "--heads", "4", "--kv-heads", "2", "--seq", "32", "--device", "cpu", "--iters", "1", "--check"]
    results = {}
    for flags in ([], ["--sp"], ["--sp", "--async-tp"]):
        proc = subprocess.run(base + flags + ["--json", str(out)], capture_output=True, text=True, timeout=120, env=ENV)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "PASS" in proc.stdout and "activation memory" in proc.stdout
        results[" ".join(flags)] = json.loads(out.read_text())
    assert results[""]["comm_forward"]["calls"] == {"all_reduce": 2}
    assert results["--sp"]["comm_forward"]["calls"] == {"all_gather": 2, "reduce_scatter": 2}
    # SP keeps less for backward than plain TP (norms and residual are sharded too)
    assert results["--sp"]["ranks"][0]["activation_bytes"] < results[""]["ranks"][0]["activation_bytes"]
    bad = subprocess.run(base[:-1] + ["--heads", "3", "--kv-heads", "3", "--hidden", "48"], capture_output=True, text=True,
                         timeout=120, env=ENV)
    assert bad.returncode != 0 and bad.stderr.count("error (ranks 0, 1): q heads (3) are not divisible by the tensor-parallel size 2") == 1
