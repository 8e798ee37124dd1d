#!/usr/bin/env bash
# One-GPU checks behind docs/PERF.md for the Triton kernels, the ring emulator, the grouped GEMM and the model,
# in one device call of under 10 minutes (each command under its own time limit, most important first):
#   bash launch/gpu_kernels_check.sh OUTDIR all
# GPU tests of the Triton kernels; attention backends vs cuDNN/flash SDPA; one ring rank emulated at W=8;
# Triton grouped GEMM vs torch._grouped_mm; training the small preset and the llama-block model on one GPU
# (MFU); the memory-bound kernels vs copy bandwidth and torch.compile; CP decode's --check on the GPU.
# (The attention tile sweep, python -m kernels.tune_attention, is a separate call.)
# Every command's full output goes to OUTDIR/<name>.log (and JSON where the command writes one).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${1:-${OUT:-out}}; part=${2:-all}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}; status=0
run() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS   # each command at most $LIMIT s
        timeout "${LIMIT:-240}" "$@" > "$out/$name.log" 2>&1 || { echo "   FAILED or timed out ($name)"; status=1; }
        tail -n 4 "$out/$name.log"; echo "   ($((SECONDS - t0)) s)"; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > "$out/gpu.txt" 2>&1
if [ "$part" = all ]; then   # one call of under 10 minutes, in order of importance
  LIMIT=110 run gpu_tests $py -m pytest -v -m gpu tests/test_triton_kernels.py tests/test_attention_kernels.py -k triton \
      -p no:cacheprovider --timeout 40 -o faulthandler_timeout=35
  LIMIT=60 run bench_attention $py -m kernels.bench --kv-heads 32 --only attention --json "$out/bench_attention.json"
  LIMIT=90 run emulate $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton sdpa-cudnn \
      --iters 10 --json "$out/emulate.json"
  for run_ in "8 0" "8 1.5" "1 0"; do set -- $run_
    LIMIT=35 run gg_gm$1_skew$2 env DISTLAB_GROUPED_GEMM_GROUP_M=$1 $py -m kernels.grouped_gemm --skew $2 --iters 10 \
        --json "$out/gg_gm$1_skew$2.json"
  done
  LIMIT=50 run train_small $py -m distlab.train --config small --steps 60 --json "$out/train_small.json"
  LIMIT=50 run train_block $py -m distlab.train --config llama-block-8gpu --tp 1 --ring 1 --ulysses 1 --steps 3 \
      --json "$out/train_block.json"
  LIMIT=80 run bench_memory $py -m kernels.bench --only memory --iters 10 --json "$out/bench_memory.json"
  LIMIT=30 run infer_check $py -m distlab.infer --config small --steps 32 --check --json "$out/infer_check.json"
fi
if [ "$part" = tune ]; then   # second call: GPU tests (bf16/fp16 at real sizes), tile sweep, emulator, memory kernels
  LIMIT=150 run gpu_tests2 $py -m pytest -v -m gpu tests/test_triton_kernels.py tests/test_attention_kernels.py \
      -k "triton and not float32" -p no:cacheprovider --timeout 140 -o faulthandler_timeout=130
  LIMIT=110 run tune_attention $py -m kernels.tune_attention --json "$out/tune_attention.json"
  LIMIT=60 run emulate2 $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton sdpa-cudnn \
      --iters 10 --json "$out/emulate2.json"
  LIMIT=60 run bench_memory2 $py -m kernels.bench --only memory --iters 10 --json "$out/bench_memory2.json"
fi
if [ "$part" = final ]; then   # third call: tuned tiles, GQA split dK/dV, warps sweep of the memory kernels
  LIMIT=35 run emulate3 $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton sdpa-cudnn \
      --iters 10 --json "$out/emulate3.json"
  LIMIT=25 run bench_attention3 $py -m kernels.bench --kv-heads 32 --only attention --iters 10 --json "$out/bench_attention3.json"
  LIMIT=25 run bench_gqa3 $py -m kernels.bench --kv-heads 8 --only attention --iters 10 --json "$out/bench_gqa3.json"
  LIMIT=35 run bench_memory3 $py -m kernels.bench --only memory --iters 10 --json "$out/bench_memory3.json"
  LIMIT=35 run bench_memory3_w8 env DISTLAB_KERNEL_WARPS=8 $py -m kernels.bench --only memory --iters 10 \
      --json "$out/bench_memory3_w8.json"
  LIMIT=60 run gpu_tests3 $py -m pytest -v -m gpu tests/test_triton_kernels.py -k "bfloat16" \
      -p no:cacheprovider --timeout 55
  LIMIT=12 run gg_cfg4 env DISTLAB_GROUPED_GEMM_CONFIG=128,256,64,8,4 $py -m kernels.grouped_gemm --iters 10
  LIMIT=12 run gg_gm16 env DISTLAB_GROUPED_GEMM_GROUP_M=16 $py -m kernels.grouped_gemm --iters 10
fi
if [ "$part" = gg ]; then   # the grouped GEMM's TMA kernel: persistent or not, stages, flatten, warp specialisation
  for v in "ptr DISTLAB_GROUPED_GEMM_TMA=0" "tma DISTLAB_GROUPED_GEMM_TMA=1" \
           "tma_s4 DISTLAB_GROUPED_GEMM_CONFIG=128,256,64,8,4" "tma_np DISTLAB_GROUPED_GEMM_PERSISTENT=0" \
           "tma_flat DISTLAB_GROUPED_GEMM_FLATTEN=1" "tma_ws DISTLAB_GROUPED_GEMM_WS=1" \
           "tma_s4_flat DISTLAB_GROUPED_GEMM_CONFIG=128,256,64,8,4 DISTLAB_GROUPED_GEMM_FLATTEN=1" \
           "tma_128 DISTLAB_GROUPED_GEMM_CONFIG=128,128,64,8,4" "tma_gm16 DISTLAB_GROUPED_GEMM_GROUP_M=16"; do
    set -- $v; name=$1; shift
    LIMIT=40 run gg_$name env "$@" $py -m kernels.grouped_gemm --iters 20 --json "$out/gg_$name.json"
  done
  LIMIT=40 run gg_tma_skew env DISTLAB_GROUPED_GEMM_TMA=1 $py -m kernels.grouped_gemm --skew 1.5 --iters 20 \
      --json "$out/gg_tma_skew.json"
  LIMIT=150 run moe_check bash launch/gpu_moe_check.sh "$out"
fi
# the device tool returns at most 8 files: pack everything into one (built outside $out, which it reads)
tar czf /tmp/logs.tar.gz -C "$out" . && rm -rf "${out:?}"/* && mv /tmp/logs.tar.gz "$out/"
exit $status
