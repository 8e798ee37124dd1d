#!/usr/bin/env bash
# One-GPU check of distlab, in one call: the whole test suite (GPU kernel tests included, gloo tests on the
# host's CPUs under the GPU box's torch), the attention-backend benchmark against cuDNN/flash SDPA, and
# the ring study at world size 1 on the GPU (NCCL group of one) with --check.
#
#   bash launch/gpu_check.sh OUTDIR        # writes logs and JSON into OUTDIR (default: $OUT or ./out)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/gpu.txt"
$py -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])' | tee -a "$out/gpu.txt"

echo "== tests =="
$py -m pytest -q -p no:cacheprovider tests > "$out/pytest.log" 2>&1 || status=1
tail -30 "$out/pytest.log"

echo "== attention backends, B1 H32 S8192 D128 causal bf16 =="
$py -m distlab.kernels.bench --seq 8192 --heads 32 --head-dim 128 --causal --dtype bf16 --json "$out/bench_mha.json" || status=1
echo "== same, GQA 32/8 (Llama-3-8B attention) =="
$py -m distlab.kernels.bench --seq 8192 --heads 32 --kv-heads 8 --head-dim 128 --causal --dtype bf16 --json "$out/bench_gqa.json" || status=1

echo "== ring study, W=1 on the GPU =="
$py -m distlab.cp.ring --seq 8192 --check --json "$out/ring_w1.json" || status=1

echo "== one rank's kernel work per CP method, W=8, S=8192 and 32768 =="
$py -m distlab.cp.local_kernels --world 8 --seq 8192 32768 --json "$out/local_kernels.json" || status=1
exit $status
