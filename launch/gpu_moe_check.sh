#!/usr/bin/env bash
# One-GPU check of the MoE pieces: the grouped GEMM backends (Triton vs torch._grouped_mm) and the MoE layer
# at the Mixtral-proxy shape (EP=1), plus the Triton grouped GEMM's correctness on the GPU.
#   bash launch/gpu_moe_check.sh OUTDIR
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${1:-${OUT:-out}}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}; status=0
$py - <<'PY' || status=1
import torch
from distlab.kernels.grouped_gemm import grouped_mm
for dtype, tol in ((torch.float32, 2e-2), (torch.bfloat16, 2e-2)):   # fp32 dots run as tf32 on the GPU
    counts = [0, 300, 1, 1024, 0, 77]
    x = torch.randn(sum(counts), 512, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(len(counts), 512, 384, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(sum(counts), 384, device="cuda", dtype=dtype)
    res = {}
    for b in ("loop", "triton"):
        xx, ww = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        grouped_mm(xx, ww, counts, b).backward(dy)
        res[b] = (grouped_mm(xx, ww, counts, b).detach(), xx.grad, ww.grad)
    errs = [((a.float() - c.float()).abs().max() / c.float().abs().max()).item() for a, c in zip(res["triton"], res["loop"])]
    print("triton grouped GEMM vs loop on GPU", dtype, "rel err y/dx/dw", [f"{e:.1e}" for e in errs])
    assert max(errs) < tol
PY
for skew in 0 1.5; do
  $py -m distlab.kernels.grouped_gemm --experts 8 --rows 32768 --k-dim 4096 --n-dim 7168 --skew $skew || status=1
done
for b in torch triton; do
  $py -m distlab.moe --experts 8 --topk 2 --hidden 4096 --ffn 14336 --tokens 4096 --backend $b --json "$out/moe_$b.json" || status=1
done
exit $status
