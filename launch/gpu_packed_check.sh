#!/usr/bin/env bash
# One-GPU check of packed documents and windows (issue #23): the masked Triton kernel at real sizes in bf16
# and fp16 against the float64 torch loop, the ring study with documents on the GPU (--check), and the
# packed emulator (a ring rank's schedule vs one call, W=8, 32q/8kv, head_dim 128, lognormal mean 2k).
#
#   bash launch/gpu_packed_check.sh OUTDIR       # logs and JSON into OUTDIR (default: $OUT or ./out)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"

echo "== masked kernel, bf16 and fp16, S8192 32q/8kv D128 =="
$py tests/kernel_checks.py masked --device cuda --dtype bfloat16 --big || status=1
$py tests/kernel_checks.py masked --device cuda --dtype float16 --big || status=1

echo "== ring study with documents and a window, W=1 on the GPU =="
$py -m distlab.cp.ring --seq 16384 --docs lognormal:mean=2048,seed=0 --window 4096 --check \
    --json "$out/ring_docs_w1.json" || status=1

echo "== a ring rank's packed schedule vs one call, W=8 =="
$py -m distlab.cp.emulate_packed --world 8 --seq 32768 65536 --json "$out/packed.json" || status=1
exit $status
