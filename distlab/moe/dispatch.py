"""Expert-parallel dispatch and combine: tokens to the ranks holding their experts, and back.

    python -m pytest tests/test_moe.py -k dispatch

EP group of P ranks, E experts, rank r holds experts ``[r·E/P, (r+1)·E/P)``. Each token has k
assignments (token, expert, weight). Dispatch:

1. (optional) capacity: each expert keeps its first ``C = ceil(capacity_factor · T·k / E)`` assignments in
   token order on this rank and drops the rest (reported); dropless by default;
2. sort the assignments by expert (stable: token order inside an expert) and count them per expert;
3. exchange the counts (an all-to-all of E integers) so every rank knows how many rows it will receive,
   per source rank and local expert;
4. ``all_to_all_single`` the token rows with uneven splits (rows for rank j = its experts' counts);
5. permute the received rows from (source rank, expert) order to (expert, source rank) order, so each
   local expert's rows are one contiguous segment for the grouped GEMM.

Combine is the exact inverse (permute back, all-to-all back, unsort), then each row is multiplied by its
router weight and summed into its token (dropped assignments add nothing). Everything is autograd ops or
``distlab.comm.all_to_all_uneven``, so the backward is the same path reversed, and the router weights get
their gradient from the combine.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from distlab import comm


@dataclasses.dataclass
class DispatchState:
    token: torch.Tensor          # (A,) token index of each kept assignment, in expert-sorted order
    weight: torch.Tensor         # (A,) its router weight
    send_splits: list            # rows sent to each rank
    recv_splits: list            # rows received from each rank
    to_expert_order: torch.Tensor  # permutation: received (source, expert) order -> (expert, source) order
    tokens_per_expert: list      # rows of each local expert, in the grouped GEMM's order
    num_tokens: int
    dropped: int


def capacity_keep(experts_flat, num_experts, capacity):
    """Mask of assignments kept when each expert takes its first ``capacity`` (in token order)."""
    order = torch.sort(experts_flat, stable=True).indices
    sorted_e = experts_flat[order]
    first = torch.searchsorted(sorted_e, sorted_e, right=False)     # index of each expert's first assignment
    position = torch.arange(len(order), device=order.device) - first
    keep = torch.zeros_like(experts_flat, dtype=torch.bool)
    keep[order] = position < capacity
    return keep


def dispatch(x, experts, weights, num_experts, group=None, capacity_factor=None):
    """x (T, H), experts/weights (T, k) -> (rows (R, H) grouped by local expert, DispatchState)."""
    p = comm.group_size(group)
    if num_experts % p:
        raise ValueError(f"{num_experts} experts cannot be split over {p} expert-parallel ranks")
    t, k = experts.shape
    local = num_experts // p
    token = torch.arange(t, device=x.device).repeat_interleave(k)
    e_flat, w_flat = experts.flatten(), weights.flatten()
    dropped = 0
    if capacity_factor is not None:
        keep = capacity_keep(e_flat, num_experts, math.ceil(capacity_factor * t * k / num_experts))
        dropped = int((~keep).sum())
        token, e_flat, w_flat = token[keep], e_flat[keep], w_flat[keep]
    order = torch.sort(e_flat, stable=True).indices
    token, e_sorted, w_sorted = token[order], e_flat[order], w_flat[order]
    counts = torch.bincount(e_sorted, minlength=num_experts)                     # (E,) on this rank
    if p > 1:
        recv_counts = comm.all_to_all_uneven_raw(counts.view(p, local), [1] * p, [1] * p, group)
    else:
        recv_counts = counts.view(1, local)
    recv_counts_list = recv_counts.tolist()                                      # (P, local) from each source
    send_splits = counts.view(p, local).sum(1).tolist()
    recv_splits = [sum(row) for row in recv_counts_list]
    rows = comm.all_to_all_uneven(x[token], send_splits, recv_splits, group)   # (source, expert) order
    # received block of source s, expert j starts at offset[s][j]; expert order wants (j, s)
    flat = torch.tensor(recv_counts_list, dtype=torch.int64).flatten()
    starts = torch.cumsum(flat, 0) - flat
    starts = starts.view(p, local).t().flatten()
    lengths = flat.view(p, local).t().flatten()
    perm = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), lengths.tolist())]) if rows.shape[0] \
        else torch.zeros(0, dtype=torch.int64)
    perm = perm.to(x.device)
    state = DispatchState(token, w_sorted, send_splits, recv_splits, perm,
                          [sum(recv_counts_list[s][j] for s in range(p)) for j in range(local)], t, dropped)
    return rows[perm], state


def combine(y, state: DispatchState, group=None):
    """Inverse of ``dispatch`` for expert outputs ``y`` (R, H'), weighted by the router: returns (T, H')."""
    back = torch.empty_like(y)
    back = back.index_copy(0, state.to_expert_order, y) if y.shape[0] else y
    rows = comm.all_to_all_uneven(back, state.recv_splits, state.send_splits, group)
    out = y.new_zeros(state.num_tokens, y.shape[-1])
    return out.index_add(0, state.token, rows * state.weight.unsqueeze(-1).to(rows.dtype))
