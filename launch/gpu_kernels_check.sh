#!/usr/bin/env bash
# The one-GPU runs behind docs/PERF.md's kernel figures, in device calls of under 10 minutes each:
#   bash launch/gpu_kernels_check.sh OUTDIR [all|check|attention|ring|memory|gemm|model|curriculum]
# check: the GPU tests of the Triton kernels and the kernel checks at real sizes (bf16 and fp16);
# attention: one call of each backend, MHA and GQA (PERF "Attention kernels");
# ring: one W=8 ring rank emulated, triton and cuDNN, PDL off and on (PERF "One ring rank emulated");
# memory: RMSNorm, RoPE, SwiGLU and the LSE merge against copy bandwidth and torch.compile;
# gemm: the grouped GEMM against torch._grouped_mm (uniform, skewed) and the MoE layer (gpu_moe_check.sh);
# model: the small preset and the Llama-3-8B-shaped block training (MFU), and infer --check;
# curriculum: fused linear CE (peak memory and time vs plain and Liger), the softmax ladder, FP8 GEMMs
#    (error and speed), paged decode (% of copy, eager and graphed); Liger rows need its wheel on PYTHONPATH.
# all = check, attention, ring, memory (about 8 minutes); gemm and model are a second call, curriculum a third.
# The passes that led to these defaults (tile sweeps, TMA, PDL, steps per launch) are in docs/PERF-archive.md
# and in this file's git history. Every command's output goes to OUTDIR/<name>.log (and JSON where it
# writes one), all of it packed into OUTDIR/logs.tar.gz. TAIL=n shows n lines of each log; BUDGET=s skips
# commands after s seconds.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"   # $out, $py, $status, the multicast variables, pack_logs
part=${2:-all}
run() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS   # each command at most $LIMIT s
        if [ $SECONDS -gt "${BUDGET:-540}" ]; then echo "   skipped: past the call's ${BUDGET:-540} s"; status=1; return; fi
        timeout "${LIMIT:-240}" "$@" > "$out/$name.log" 2>&1 || { echo "   FAILED or timed out ($name)"; status=1; }
        tail -n ${TAIL:-4} "$out/$name.log"; echo "   ($((SECONDS - t0)) s)"; }
wants() { [ "$part" = "$1" ] || { [ "$part" = all ] && [[ " check attention ring memory " == *" $1 "* ]]; }; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > "$out/gpu.txt" 2>&1

if wants check; then
  LIMIT=110 run gpu_tests $py -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_attention_kernels.py \
      tests/test_faults.py -p no:cacheprovider
  for dt in bfloat16 float16; do
    LIMIT=100 run checks_$dt $py tests/kernel_checks.py attention accumulate merge masked rmsnorm rope swiglu \
        --device cuda --dtype $dt --big
  done
fi
if wants attention; then
  LIMIT=40 run attention_mha $py -m distlab.kernels.bench --kv-heads 32 --only attention --json "$out/attention_mha.json"
  LIMIT=40 run attention_gqa $py -m distlab.kernels.bench --kv-heads 8 --only attention --json "$out/attention_gqa.json"
fi
if wants ring; then
  for pdl in 0 1; do
    LIMIT=100 run emulate_pdl$pdl env DISTLAB_TRITON_ATTN_PDL=$pdl $py -m distlab.cp.emulate --world 8 \
        --seq 8192 32768 --backend triton sdpa-cudnn --iters 10 --json "$out/emulate_pdl$pdl.json"
  done
fi
if wants memory; then
  LIMIT=80 run memory $py -m distlab.kernels.bench --only memory --iters 10 --json "$out/memory.json"
fi
if wants gemm; then
  for skew in 0 1.5; do
    LIMIT=60 run gg_skew$skew $py -m distlab.kernels.grouped_gemm --skew $skew --cooldown 1 --rounds 5 \
        --json "$out/gg_skew$skew.json"
  done
  LIMIT=120 run moe_check bash launch/gpu_moe_check.sh "$out"
fi
if wants model; then
  LIMIT=50 run train_small $py -m distlab.train --config small --steps 60 --json "$out/train_small.json"
  LIMIT=50 run train_block $py -m distlab.train --config llama-block-8gpu --tp 1 --ring 1 --ulysses 1 --steps 3 \
      --json "$out/train_block.json"
  LIMIT=30 run infer_check $py -m distlab.infer --config small --steps 32 --check --json "$out/infer_check.json"
fi
if wants curriculum; then
  LIMIT=120 run fused_ce $py -m distlab.kernels.fused_linear_ce --vocab 32000 128256 --chunks 256 1024 4096 \
      --json "$out/fused_ce.json" --plot "$out/fused_ce.png"
  LIMIT=60 run softmax $py -m distlab.kernels.softmax --json "$out/softmax.json"
  LIMIT=60 run fp8 $py -m distlab.kernels.fp8 --json "$out/fp8.json"
  LIMIT=60 run paged $py -m distlab.kernels.paged_attention --json "$out/paged.json"
fi
pack_logs
exit $status
