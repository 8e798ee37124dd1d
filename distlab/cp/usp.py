"""USP (unified sequence parallelism): Ulysses inside, ring across, on a 2-D mesh of U × R ranks.

    distlab run --nproc 4 -m distlab.cp.usp --ulysses 2 --ring 2 --seq 8192 --check
    torchrun --nproc-per-node 8 -m distlab.cp.usp --ulysses 4 --ring 2 --seq 65536 --layout zigzag

Each rank holds a 1/(U·R) piece of the sequence (``shard_sequence(x, ring_group, layout,
ulysses_group=...)``). A Ulysses all-to-all over the U ranks of its row turns the pieces into the row's
ring shard for H/U heads; ring attention (contiguous or zigzag) runs over the R ranks of its column on
those heads; a last all-to-all returns sequence pieces with all heads. The piece order (see
``distlab.cp.layout``) makes the all-to-all rebuild exactly a ring shard, so zigzag stays balanced and
correct. U=1 is pure ring; R=1 is pure Ulysses.

Which split? Ulysses moves 4·(U−1)/U of the local activations per forward regardless of the sequence
length, ring moves K/V R−1 times but hides it behind compute once a block is large enough; Ulysses is
capped by the head count. ``distlab.cp.compare`` measures every split on the same problem and
``distlab.cp.cost`` gives the bytes each sends.
"""

from __future__ import annotations

from distlab import comm
from distlab.cp.layout import check_layout
from distlab.cp.ring import ring_attention
from distlab.cp.documents import Documents, check_call_everywhere
from distlab.cp.ulysses import check_ulysses_inputs, to_head_shards, to_sequence_shards


def usp_attention(q, k, v, ulysses_group, ring_group, causal=False, layout="contiguous", backend="auto",
                  softmax_scale=None, cu_seqlens=None, window=None):
    """Attention over the whole sequence from this rank's USP piece (differentiable).

    q: ``(batch, seq/(U·R), heads, head_dim)``; k, v: ``(batch, seq/(U·R), kv_heads, head_dim)``.
    ``cu_seqlens`` / ``window``: packed documents (``distlab.cp.documents``), handled by the ring axis.
    """
    check_call_everywhere("usp_attention", [ulysses_group, ring_group], q, k, v, causal, layout, cu_seqlens, window)
    u = comm.group_size(ulysses_group)
    check_layout(layout)
    masked = cu_seqlens is not None or window is not None or layout == "balanced"
    backend = check_ulysses_inputs(q, k, v, u, backend, masked=masked)
    if layout != "contiguous" and (q.shape[1] * u) % 2:
        raise ValueError(f"a {layout} ring shard ({u} x {q.shape[1]} tokens) holds two or more equal chunks, so "
                         f"its length must be even")
    Documents.from_args(q.shape[1] * u * comm.group_size(ring_group), cu_seqlens, causal, window)   # before any a2a
    qh, kh, vh = to_head_shards(q, k, v, ulysses_group)
    out = ring_attention(qh, kh, vh, ring_group, causal, layout, backend, softmax_scale, cu_seqlens=cu_seqlens,
                         window=window)
    return to_sequence_shards(out, ulysses_group)


if __name__ == "__main__":   # the study is this method's command line; run, not imported (no cycle)
    import runpy

    runpy.run_module("distlab.cp.study", init_globals={"ALGORITHM": "usp"}, run_name="__main__")
