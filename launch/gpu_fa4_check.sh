#!/usr/bin/env bash
# FlashAttention-4 as distlab's "fa4" backend on one H200: the GPU parity tests, one call beside cuDNN and the
# Triton kernel, the ring study at W=1 on FA4 blocks with --check, and one W=8 ring rank on FA4 blocks.
# FA4 reaches the device through ../shared/tools/fa4-carry (two carried folders, two device calls):
#   call 1 (carry .fa4-a): mkdir -p /opt/fa4 && tar -xJf .fa4-a/ir.tar.xz -C /opt/fa4
#   call 2 (carry .fa4-b): tar -xJf .fa4-b/rest.tar.xz -C /opt/fa4 && bash launch/gpu_fa4_check.sh $OUT
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"   # $out, $py, $status, the multicast variables, pack_logs
export PYTHONPATH=/opt/fa4:/opt/fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
run() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS
        timeout "${LIMIT:-200}" "$@" > "$out/$name.log" 2>&1 || { echo "   FAILED or timed out ($name)"; status=1; }
        tail -n ${TAIL:-6} "$out/$name.log"; echo "   ($((SECONDS - t0)) s)"; }
$py -c 'import flash_attn.cute.interface, flash_attn; print("flash_attn", getattr(flash_attn, "__version__", "?"))' \
    > "$out/fa4_import.log" 2>&1 || { cat "$out/fa4_import.log"; echo "FA4 is not importable"; exit 1; }
LIMIT=200 run fa4_tests $py -m pytest -q -m gpu tests/test_attention_kernels.py -k fa4 -p no:cacheprovider
LIMIT=120 run bench_gqa $py -m distlab.kernels.bench --seq 8192 --heads 32 --kv-heads 8 --head-dim 128 --causal \
    --only attention --json "$out/bench_gqa.json"
LIMIT=120 run ring_w1 $py -m distlab.cp.ring --seq 32768 --heads 32 --kv-heads 8 --backend fa4 --check \
    --json "$out/ring_w1_fa4.json"
LIMIT=60 run host_cost $py -m distlab.kernels.host_cost --json "$out/host_cost.json"
LIMIT=150 run emulate_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 sdpa-cudnn triton \
    --iters 10 --json "$out/emulate_fa4_gpu.json"
LIMIT=150 run emulate $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 sdpa-cudnn triton --iters 10 --wall \
    --json "$out/emulate_fa4.json"
pack_logs
exit $status
