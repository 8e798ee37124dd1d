"""The anchor: PyTorch's FSDP2 (``fully_shard``) on the same sharded mini Llama, behind the same interface.

    distlab run --nproc 4 -m distlab.train --config tiny --dp-shard 4 --fsdp-impl torch

``TorchFSDP(model, layout, mesh)`` calls ``fully_shard`` on each block and then on the whole model (the
root: embedding, final norm, head), over the same ``shard`` group the hand-written ``ZeroEngine`` uses
(dp_shard × cp), or the 2-D (dp_replicate, shard) mesh for HSDP. FSDP2 is ZeRO-3 (``reshard_after_forward``
True) or ZeRO-2 (False); it averages the gradients over the mesh itself, which is the mean over the ranks
holding the same weights when tp is 1. It runs where FSDP2 takes the model as it is: tp 1 (our TP layers
are plain tensors, not DTensors, and their kv-head fix-ups would need the full gradients FSDP2 never
shows) and a dense MLP (experts are one per rank, which FSDP2 would average). Anything else is refused.

The parameters become DTensors: ``optimizer_parameters()`` is the model's parameters, ``clip_grad_norm`` is
torch's own, and ``full_tensors(get)`` calls ``full_tensor()`` on each, so checkpoints are the same
consolidated files as the hand-written path's.
"""

from __future__ import annotations

import torch


def check_supported(layout, cfg) -> None:
    if layout.zero == 1:
        raise ValueError("--fsdp-impl torch: FSDP2 shards gradients and parameters (--zero 2 or 3), not ZeRO-1")
    if layout.tp > 1:
        raise ValueError("--fsdp-impl torch runs with --tp 1 (distlab's TP layers hold plain tensors, not DTensors); "
                         "use the hand-written --fsdp-impl hand with TP")
    if cfg.moe_experts:
        raise ValueError("--fsdp-impl torch runs dense models only (experts are one per rank under EP); use "
                         "--fsdp-impl hand for MoE")


class TorchFSDP:
    def __init__(self, model, layout, mesh):
        from torch.distributed.fsdp import fully_shard

        check_supported(layout, model.cfg)
        self.model = model
        shard_mesh = self._fsdp_mesh(mesh, layout.dp_replicate)
        reshard = layout.zero == 3
        for block in model.blocks:
            fully_shard(block, mesh=shard_mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=shard_mesh, reshard_after_forward=reshard)

    @staticmethod
    def _fsdp_mesh(mesh, replicas):
        """The 1-D shard mesh, or HSDP's 2-D (dp_replicate, shard) one, built from the mesh's existing groups:
        slicing two flattened dims out of the root mesh left a group behind that a later mesh (a test's next
        task, after the first's groups were destroyed) tried to reuse."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        shard = mesh.get_group("shard")
        if replicas == 1:
            return DeviceMesh.from_group(shard, mesh.device_type, mesh_dim_names=("shard",))
        replicate = mesh.get_group("dp_replicate")
        rows = [None] * replicas
        dist.all_gather_object(rows, dist.get_process_group_ranks(shard), group=replicate)
        return DeviceMesh.from_group([replicate, shard], mesh.device_type, mesh=torch.tensor(rows),
                                     mesh_dim_names=("dp_replicate", "shard"))

    def optimizer_parameters(self) -> list:
        return list(self.model.parameters())

    def finish_gradients(self) -> None:   # FSDP2 reduced them in its post-backward hooks
        pass

    def after_step(self) -> None:
        pass

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    @torch.no_grad()
    def full_tensors(self, get) -> dict:
        def full(p):
            t = get(p)
            return t.full_tensor() if hasattr(t, "full_tensor") else t

        return self.model.full_tensors(full)

    def step_counts(self) -> dict:
        return {}
