"""Tree attention (speculative decoding's verify): block-sparse against dense masked attention, skipped tiles
counted, and the mini Llama's one-forward verify against decoding each branch separately."""

import pytest
import torch

from distlab import comm
from distlab.kernels.tree_attention import ancestor_mask, depths, tree_attention, tree_attention_reference
from distlab.model import Llama, ModelConfig
from distlab.model.parallel import ParallelLlama
from distlab.runtime import Layout
from distlab.speculative import verify_tree

PARENTS = [-1, 0, 0, 1, 1, 2, 5, -1, 7, 3, 9, 9, 11]   # two roots, depths up to 5, a long chain


def test_mask_and_depths():
    mask = ancestor_mask(PARENTS)
    assert mask[6].nonzero().flatten().tolist() == [0, 2, 5, 6]
    assert mask[12].nonzero().flatten().tolist() == [0, 1, 3, 9, 11, 12]
    assert depths(PARENTS).tolist() == [0, 1, 1, 2, 2, 2, 3, 0, 1, 3, 4, 4, 5]


@pytest.mark.parametrize("block", [1, 4, 16])
@pytest.mark.parametrize("prefix", [0, 9])
def test_block_sparse_matches_dense(block, prefix):
    g = torch.Generator().manual_seed(block + prefix)
    n, h, kv, d = len(PARENTS), 4, 2, 8
    q = torch.randn(2, n, h, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, n, kv, d, generator=g, dtype=torch.float64) for _ in range(2))
    kp, vp = (torch.randn(2, prefix, kv, d, generator=g, dtype=torch.float64) for _ in range(2))
    stats = {}
    got = tree_attention(q, k, v, PARENTS, kp if prefix else None, vp if prefix else None, block=block, stats=stats,
                         backend="torch")
    want = tree_attention_reference(q, k, v, PARENTS, kp if prefix else None, vp if prefix else None)
    assert (got - want).abs().max().item() < 1e-12
    if block == 1:   # one pair a tile: exactly the ancestor pairs are computed
        assert stats["tiles"] == int(ancestor_mask(PARENTS).sum()) < stats["all_tiles"]


def test_bad_parents_are_refused():
    q = torch.zeros(1, 3, 2, 4)
    with pytest.raises(ValueError, match="earlier token"):
        tree_attention(q, q[:, :, :1], q[:, :, :1], [-1, 2, 0])
    with pytest.raises(ValueError, match="one entry per tree token"):
        tree_attention(q, q[:, :, :1], q[:, :, :1], [-1, 0])


def verify_vs_branches(tp):
    """Every tree token's logits from one verify forward against the one-device model decoding its branch."""
    cfg = ModelConfig(vocab=64, layers=2, hidden=32, heads=4, kv_heads=2, ffn=48)
    torch.manual_seed(0)
    ref = Llama(cfg, dtype=torch.float64)
    layout = Layout.for_model(comm.group_size(), tp=tp)
    model = ParallelLlama(ref, layout, layout.build_mesh("cpu"))
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 64, (1, 11), generator=g)
    tree = torch.randint(0, 64, (1, len(PARENTS)), generator=g)
    logits = comm.all_gather_raw(verify_tree(model, prefix, tree, PARENTS), model.tp_group, -1)
    worst = 0.0
    for i in range(len(PARENTS)):
        path, j = [], i
        while j >= 0:
            path.append(int(tree[0, j]))
            j = PARENTS[j]
        ids = torch.cat([prefix, torch.tensor([path[::-1]])], 1)
        with torch.no_grad():
            want = ref(ids)[0, -1]
        worst = max(worst, ((logits[i] - want).abs().max() / want.abs().max()).item())
    return worst


@pytest.mark.parametrize("tp", [1, 2])
def test_verify_matches_decoding_each_branch(pools, tp):
    for worst in pools(tp).run(verify_vs_branches, tp):
        assert worst < 1e-12, worst
