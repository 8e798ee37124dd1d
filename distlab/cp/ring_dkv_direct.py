"""A fused ring backward's dK/dV sent straight to their owners and summed there once (``dkv_route="direct"``).

    python -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --rank all --variant '' RING_DKV_ROUTE=direct
    DISTLAB_RING_DKV_ROUTE=direct distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --backend torch --check

The classic ring's backward sends a float32 (dK, dV) accumulator one hop a step: each rank adds its block's
share into the accumulator of the K/V it holds and passes it on, and after W hops it is home. Every add reads
the share and the float32 accumulator and writes the accumulator back (W=8, S32768, 8 kv heads of 128: 80 MiB,
~45 µs on the H100, seven of them a rank), beside the next group's kernels or, for the last group, after them.

Here K/V still travel the ring, but at step s rank r sends its share of rank (r − s)'s dK/dV straight to that
rank, in the share's own dtype (bf16 for FA4's folded blocks), and receives from rank (r + s) its share of
this rank's dK/dV, into one buffer per key range. After the last step the owner sums its own share and the
W − 1 received ones at once (``finish``): one read of each share, one float32 result, converted to k's dtype.
Traffic a rank: at most W − 1 shares of one shard's K/V size, in q's dtype, against W float32 hops of the
ring (W=8, bf16: 112 MiB against 256 at S32768). Every rank talks to every other once a backward (an
all-to-all spread over the steps): fine inside an NVLink/NVSwitch node, not what a ring across nodes wants.
The answer is the same sum in another order (float64 parity on gloo: ``tests/test_ring.py``).

Only the fused ring backward (``distlab.cp.ring_fused``: FA4, cuDNN, torch with launch groups of several
steps) has this route. FA4's shares are bf16 ``(2, B, keys, kv_heads, dim)`` in a folding ring, else its
float32 accumulator layout, where a fused block's key range is strided (copied to be sent) and the owner's
sum is converted by FA4's postprocess (``FA4RingBackward.finish_dkv``).
"""

from __future__ import annotations

import torch

from distlab.cp.ring import group_plans

ROUTES = ("ring", "direct")


def check_route(route):
    if route not in ROUTES:
        raise ValueError(f"dkv_route={route!r}: one of {', '.join(ROUTES)}")
    return route


def direct_bytes(rank, world, shard, causal, layout, steps_per_launch, batch, kv_heads, head_dim, itemsize):
    """Bytes rank ``rank`` (``shard`` rows) sends by the direct route in one backward: its dK/dV shares of the other ranks' keys
    (``distlab.cp.cost`` counts the K/V hops; a causal zigzag rank r sends r half shards and W − 1 − r whole)."""
    keys = sum(c.stop - c.start for steps, plan in group_plans(rank, world, shard, causal, layout, steps_per_launch)
               for _, _, pieces in plan for st, c in pieces if st > 0)
    return 2 * batch * keys * kv_heads * head_dim * itemsize


class DirectDkv:
    """One rank's direct dK/dV delivery: ``send(step, parts)`` after a step's blocks, ``finish(own)`` at the
    end. ``shape``: ``(rank, world, seq, causal, layout, steps_per_launch, max_keys)``, as ``group_plans``
    takes it; ``k`` this rank's K; ``like`` its step-0 share, whose layout and dtype every share has: dK or
    dV alone ``(B, keys, Hkv, D)`` (the per-block backends, sent as a pair), or both along a leading dimension
    of 2 (FA4: ``(2, B, keys, Hkv, D)`` folded, or its float32 accumulator layout ``(2, B, Hkv, keys·c)``, a key
    range a slice of the last dimension). ``own_slot``: the owner's share is summed with the others in one
    reduction (it is in their dtype)."""

    def __init__(self, ring, shape, k, like, own_slot=False):
        rank, world = ring.rank, ring.size
        self.ring, self.k = ring, k
        base = tuple(like.shape) if own_slot else (2, *like.shape)
        keys = k.shape[1]
        # where the keys are: dim 2 of (2, B, keys, Hkv, D); else the last dim, c values a key
        self.dim, self.per_key = (2, 1) if len(base) == 5 else (len(base) - 1, base[-1] // keys)
        # what rank r + s computed at its step s against this rank's K/V: the key ranges of its shares
        self.incoming = {}
        for step in range(1, world):
            sender = (rank + step) % world
            cols = [c for steps, plan in group_plans(sender, *shape[1:]) for _, _, pieces in plan
                    for st, c in pieces if st == step]
            if cols:
                self.incoming[step] = cols
        counts: dict = {}
        for cols in self.incoming.values():
            for c in cols:
                counts[(c.start, c.stop)] = counts.get((c.start, c.stop), 0) + 1
        self.whole = (0, keys)
        self.own_slot = own_slot and self.whole in counts   # own share copied in: one reduction over all of them
        if self.own_slot:
            counts[self.whole] += 1
        self.inbox = {}   # one receive buffer per key range: the shares summed in one reduction each
        for (a, b), n in counts.items():
            slot = list(base)
            slot[self.dim] = (b - a) * self.per_key
            self.inbox[(a, b)] = torch.empty((n, *slot), dtype=like.dtype, device=k.device)
        self.filled = dict.fromkeys(self.inbox, 0)
        self.pending = []

    def send(self, step, parts):
        """Post step ``step``'s exchange: this rank's shares ``parts`` (``[(cols, dK, dV)]``, or ``(cols, both,
        None)``) to their owner, rank − step, and the shares of this rank's keys from rank + step into the
        inbox (a strided share, as FA4's float32 layout cuts a key range, is copied to be sent)."""
        send = []
        for _, dk, dv in parts:
            send += [dk[0], dk[1]] if dv is None else [dk, dv]
        recv = []
        for c in self.incoming.get(step, []):
            key = (c.start, c.stop)
            slot = self.inbox[key][self.filled[key]]
            self.filled[key] += 1
            recv += [slot[0], slot[1]]
        if send or recv:
            self.pending.append(self.ring.shift_exchange(send, step, recv, "ring_dkv_direct"))

    def finish(self, own, acc_dtype):
        """This rank's dK and dV along a leading dimension of 2, in the shares' layout: ``own`` (its step-0 share
        over every key: with ``own_slot`` in the shares' dtype, else its accumulator in ``acc_dtype``, fresh
        memory, as one tensor or ``(dK, dV)``) plus every received share, summed in ``acc_dtype`` (with
        ``own_slot`` and one key range, one reduction whose bf16 result is rounded once)."""
        for p in self.pending:
            p.wait()
        if self.own_slot:
            self.inbox[self.whole][-1].copy_(own)
            if len(self.inbox) == 1:   # every share over every key: one reduction (bf16 is added in float32 on
                # the GPU and the CPU alike, and rounded once)
                return self.inbox[self.whole].sum(0, dtype=acc_dtype if acc_dtype == torch.float64 else None)
            total = self.inbox[self.whole].sum(0, dtype=acc_dtype)
        else:
            total = own.to(acc_dtype, copy=True) if torch.is_tensor(own) else torch.stack(own)
        for key, buf in self.inbox.items():
            if self.own_slot and key == self.whole:
                continue
            part = buf.sum(0, dtype=acc_dtype)
            if key == self.whole:
                total += part
            else:
                total.narrow(self.dim, key[0] * self.per_key, (key[1] - key[0]) * self.per_key).add_(part)
        return total
