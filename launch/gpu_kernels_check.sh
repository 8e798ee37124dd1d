#!/usr/bin/env bash
# One-GPU checks behind docs/PERF.md for the Triton kernels, the ring emulator, the grouped GEMM and the model.
#   bash launch/gpu_kernels_check.sh OUTDIR correctness   # GPU tests of the kernels, attention tile sweep,
#                                                         # grouped-GEMM band/tile sweep
#   bash launch/gpu_kernels_check.sh OUTDIR speed         # kernels.bench, cp.emulate, train small + the
#                                                         # llama-block model on one GPU, infer
# Every command's full output goes to OUTDIR/<name>.log (and JSON where the command writes one).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${1:-${OUT:-out}}; part=${2:-correctness}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}; status=0
run() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS
        "$@" > "$out/$name.log" 2>&1 || { echo "   FAILED ($name)"; status=1; }
        tail -n 4 "$out/$name.log"; echo "   ($((SECONDS - t0)) s)"; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > "$out/gpu.txt" 2>&1
if [ "$part" = correctness ]; then
  run gpu_tests $py -m pytest -q -x -m gpu tests/test_triton_kernels.py tests/test_attention_kernels.py -p no:cacheprovider
  run tune_attention $py -m kernels.tune_attention --json "$out/tune_attention.json"
  for gm in 1 4 8 16; do
    for skew in 0 1.5; do
      DISTLAB_GROUPED_GEMM_GROUP_M=$gm run gg_gm${gm}_skew$skew $py -m kernels.grouped_gemm --skew $skew --json "$out/gg_gm${gm}_skew$skew.json"
    done
  done
  for cfg in 128,256,64,8,4 256,128,64,8,3 128,128,64,4,4; do
    DISTLAB_GROUPED_GEMM_CONFIG=$cfg run gg_cfg${cfg//,/_} $py -m kernels.grouped_gemm --json "$out/gg_cfg${cfg//,/_}.json"
  done
fi
if [ "$part" = speed ]; then
  run bench $py -m kernels.bench --kv-heads 32 --json "$out/bench.json"
  run bench_gqa $py -m kernels.bench --kv-heads 8 --only attention --json "$out/bench_gqa.json"
  run emulate $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --layout zigzag contiguous \
      --backend triton sdpa-cudnn sdpa-flash --json "$out/emulate.json"
  run emulate_nograph $py -m distlab.cp.emulate --world 8 --seq 8192 --backend triton sdpa-cudnn --no-graphs \
      --json "$out/emulate_nograph.json"
  run train_small $py -m distlab.train --config small --steps 120 --json "$out/train_small.json"
  run train_block $py -m distlab.train --config llama-block-8gpu --tp 1 --ring 1 --ulysses 1 --steps 6 \
      --json "$out/train_block.json"
  run infer_check $py -m distlab.infer --config small --steps 32 --check --json "$out/infer_check.json"
  run infer_bf16 $py -m distlab.infer --config small --dtype bfloat16 --prompt-len 4096 --steps 64 --json "$out/infer_bf16.json"
fi
exit $status
