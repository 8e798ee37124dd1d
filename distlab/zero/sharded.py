"""ZeRO-1/2/3 for the sharded mini Llama, by hand: what each rank keeps, when it gathers and reduces.

    distlab run --nproc 4 -m distlab.train --config tiny --dp-shard 4                 # ZeRO-3
    distlab run --nproc 4 -m distlab.train --config tiny --dp-shard 2 --zero 2 --tp 2
    distlab run --nproc 4 -m distlab.train --config tiny --dp-shard 2 --dp-replicate 2  # HSDP

``ZeroEngine(model, layout, mesh)`` takes a ``ParallelLlama`` (TP, CP and EP already applied) and shards
what the data-parallel ranks would otherwise replicate, over the mesh's ``shard`` group (dp_shard × cp: the
CP ranks hold the same weights, as torchtitan shards them too). Units: each block, and the root (embedding,
final norm, LM head); MoE experts are already one per rank (EP) and stay as they are.

- **ZeRO-1** (optimizer state): every rank keeps full parameters and full gradients; after the backward the
  gradients are averaged (one all-reduce per unit), each rank's AdamW updates its piece, and the pieces are
  all-gathered back into the parameters.
- **ZeRO-2** (+ gradients): as a block's backward finishes (the last of its parameters' gradients
  accumulated), its gradients are reduce-scattered, asynchronously, and the full gradients freed; one
  reduce-scatter is in flight while the next block's backward computes.
- **ZeRO-3** (+ parameters): a block's parameters are all-gathered just before its forward and released
  after it, gathered again just before its backward (a hook on the block's output gradient) and released
  after the reduce-scatter. Prefetch: the next block's all-gather (forward: i+1; backward: i−1) is issued
  when block i starts, so it runs while block i computes. The root stays gathered from the start of the
  forward to the end of its backward (its head is the first thing the backward needs), as FSDP2's root.

HSDP: with ``dp_replicate`` > 1 the pieces (gradients) are then all-reduced over the replicas, once per step
in one flattened call. Gradients are divided by the dp × cp ranks holding the same weights: the model's loss
is scaled so that this mean is the one-device gradient. TP's own gradient fix-ups (replicated kv heads, the
router under TP) run on each block's full gradients just before its reduce-scatter.

``optimizer_parameters()`` is what AdamW steps (the pieces and the experts); ``finish_gradients()`` (after
``backward``) waits for the reductions and gives each piece its gradient; ``clip_grad_norm`` computes the
one-device norm from the pieces; ``after_step()`` re-gathers ZeRO-1/2's parameters; ``full_tensors(get)``
gathers ``get(piece)`` (a weight, a gradient, an AdamW moment) back into the one-device names, which is how
checkpoints stay consolidated and reshardable. ``counts`` holds the collectives and hook calls of a step.
"""

from __future__ import annotations

import collections

import torch

from distlab import comm
from distlab.zero.flat import FlatUnit


class ZeroEngine:
    def __init__(self, model, layout, mesh, prefetch: bool = True):
        self.model, self.zero, self.prefetch = model, layout.zero, prefetch
        self.shard_group, self.replicate_group = mesh.get_group("shard"), mesh.get_group("dp_replicate")
        self.mean_over = comm.group_size(mesh.get_group("dp_cp"))
        self.tp_group, self.ep_group = model.tp_group, model.ep_group
        keep_full = self.zero < 3
        seen = set()

        def own(params):
            out = [p for p in params if p.distlab_sharding != "ep" and id(p) not in seen]
            seen.update(id(p) for p in out)
            return out

        self.blocks = list(model.blocks)
        self.units = [FlatUnit(f"blocks.{i}", own(b.parameters()), self.shard_group, keep_full)
                      for i, b in enumerate(self.blocks)]
        self.root = FlatUnit("root", own(model.parameters()), self.shard_group, keep_full)
        self.experts = model.parameters_tagged("ep")
        self.counts = collections.Counter()
        self._unit_of = {id(p): u for u in self.units + [self.root] for p in u.params}
        self._fixup = {id(u): b for u, b in zip(self.units, self.blocks)}
        self._gathering, self._reducing, self._pieces = {}, None, {}
        self._arrived = collections.Counter()
        if self.zero >= 2:
            for u in self.units + [self.root]:
                for p in u.params:
                    p.register_post_accumulate_grad_hook(self._grad_arrived)
        if self.zero == 3:
            model.register_forward_pre_hook(self._root_forward)
            model.register_forward_hook(self._root_forward_done)
            for i, block in enumerate(self.blocks):
                block.register_forward_pre_hook(lambda m, args, i=i: self._block_forward(i))
                block.register_forward_hook(lambda m, args, out, i=i: self._block_forward_done(i, out))

    # ---- what the optimizer and the checkpoints see -------------------------------------------------------
    def optimizer_parameters(self) -> list:
        return [u.shard for u in self.units + [self.root]] + self.experts

    @torch.no_grad()
    def full_tensors(self, get) -> dict:
        """``get(p)`` of every optimizer parameter, gathered into the one-device names (collective)."""
        full = {}
        for u in self.units + [self.root]:
            for p, v in zip(u.params, u.views(u.gather(get(u.shard)).wait())):
                full[id(p)] = v
        return self.model.full_tensors(lambda p: full[id(p)] if id(p) in full else get(p))

    # ---- ZeRO-3: gather just in time, release after use -----------------------------------------------
    def _ensure(self, unit) -> None:
        if unit.gathered:
            return
        pending = self._gathering.pop(id(unit), None)
        if pending is None:
            pending = unit.gather()
            self.counts["all_gather"] += 1
        unit.install(pending.wait())

    def _start_gather(self, unit) -> None:
        if self.prefetch and not unit.gathered and id(unit) not in self._gathering:
            self._gathering[id(unit)] = unit.gather(async_op=True)
            self.counts["all_gather"] += 1

    def _root_forward(self, model, args):
        self.counts["hooks"] += 1
        self._ensure(self.root)
        if self.units:
            self._start_gather(self.units[0])

    def _root_forward_done(self, model, args, out):
        if not torch.is_grad_enabled():
            self.root.release()

    def _block_forward(self, i):
        self.counts["hooks"] += 1
        self._ensure(self.units[i])
        if i + 1 < len(self.units):
            self._start_gather(self.units[i + 1])

    def _block_forward_done(self, i, out):
        self.counts["hooks"] += 1
        self.units[i].release()
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._block_backward(i))

    def _block_backward(self, i):
        self.counts["hooks"] += 1
        self._ensure(self.units[i])
        if i > 0:
            self._start_gather(self.units[i - 1])

    # ---- ZeRO-2/3: reduce-scatter a unit's gradients as soon as its backward is done ----------------
    def _grad_arrived(self, p) -> None:
        self.counts["hooks"] += 1
        unit = self._unit_of[id(p)]
        self._arrived[id(unit)] += 1
        if self._arrived[id(unit)] == len(unit.params):
            self._reduce(unit)

    def _reduce(self, unit) -> None:
        block = self._fixup.get(id(unit))
        if block is not None:   # TP's fix-ups need the block's full gradients
            block.sync_replicated_kv_grads()
            block.sync_router_grads()
        if self._reducing is not None:   # one reduce-scatter in flight: the previous unit's finishes now
            self._pieces[id(self._reducing[0])] = self._reducing[1].wait()
        self._reducing = (unit, unit.reduce_scatter([p.grad for p in unit.params], async_op=True))
        self.counts["reduce_scatter"] += 1
        for p in unit.params:
            p.grad = None
        if self.zero == 3:
            unit.release()

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """After ``backward``: every piece's gradient, averaged over the ranks holding the same weights."""
        units = self.units + [self.root]
        if self.zero == 1:
            for block in self.blocks:
                block.sync_replicated_kv_grads()
                block.sync_router_grads()
            for u in units:   # full gradients, averaged in one all-reduce per unit; each rank keeps its piece
                flat = u.flatten([p.grad for p in u.params])
                summed = comm.all_reduce_raw(flat, self.model.replica_group)
                self.counts["all_reduce"] += 1
                self._pieces[id(u)] = summed[u.rank * u.chunk:(u.rank + 1) * u.chunk].clone()   # the full sum freed
                for p in u.params:
                    p.grad = None
        else:
            for u in units:   # a unit whose gradients never all arrived (a parameter without one)
                if id(u) not in self._pieces and (self._reducing is None or self._reducing[0] is not u):
                    self._reduce(u)
            if self._reducing is not None:
                self._pieces[id(self._reducing[0])] = self._reducing[1].wait()
                self._reducing = None
            if comm.group_size(self.replicate_group) > 1:   # HSDP: the pieces over the replicas, one call
                flat = comm.all_reduce_raw(torch.cat([self._pieces[id(u)] for u in units]), self.replicate_group)
                self.counts["all_reduce"] += 1
                for u, piece in zip(units, flat.split([u.chunk for u in units])):
                    self._pieces[id(u)] = piece
        for u in units:   # each piece is a fresh tensor (a collective's output): divided in place
            u.shard.grad = self._pieces.pop(id(u)).div_(self.mean_over)
        for p in self.experts:   # an expert lives on one rank and holds every token's part
            if p.grad is not None:
                p.grad /= self.mean_over
        self._arrived.clear()

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The one-device 2-norm from the pieces: replicated weights once, tp slices summed over tp (a kv head
        copied on c tp ranks counted 1/c), experts over ep."""
        device = self.root.shard.device
        rep = torch.zeros((), dtype=torch.float64, device=device)
        tp = torch.zeros((), dtype=torch.float64, device=device)
        for u in self.units + [self.root]:
            g = u.shard.grad
            for p, start, stop, lo, hi in u.owned_pieces():
                sq = g[lo:hi].double().square()
                if p.distlab_sharding == "replicated":
                    rep += sq.sum()
                    continue
                tp += sq.sum()
                kv_from, copies = getattr(p, "distlab_kv_copies", (None, 1))
                if copies > 1 and stop > kv_from:   # elements of the kv-head copies
                    tp -= sq[max(kv_from - start, 0):].sum() * (1 - 1 / copies)
        both = comm.all_reduce_raw(torch.stack([rep, tp]), self.shard_group)
        ep = sum((p.grad.double().square().sum() for p in self.experts if p.grad is not None),
                 torch.zeros((), dtype=torch.float64, device=device))
        total = both[0] + comm.all_reduce_raw(both[1], self.tp_group) + comm.all_reduce_raw(ep, self.ep_group)
        return total.sqrt()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        norm = self.grad_norm().item()
        scale = min(1.0, max_norm / (norm + 1e-6))
        for p in self.optimizer_parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        return norm

    @torch.no_grad()
    def after_step(self) -> None:
        """ZeRO-1/2: the updated pieces all-gathered into the resident full parameters."""
        if self.zero < 3:
            for u in self.units + [self.root]:
                u.gather(out=u.full).wait()
                self.counts["all_gather"] += 1

    def step_counts(self) -> dict:
        """The collectives and hook calls since the last call (a step's worth when called once a step)."""
        out = dict(self.counts)
        self.counts.clear()
        return out
