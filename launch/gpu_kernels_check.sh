#!/usr/bin/env bash
# One-GPU checks behind docs/PERF.md for the Triton kernels, the ring emulator, the grouped GEMM and the model,
# in one device call of under 10 minutes (each command under its own time limit, most important first):
#   bash launch/gpu_kernels_check.sh OUTDIR all
# GPU tests of the Triton kernels; attention backends vs cuDNN/flash SDPA; one ring rank emulated at W=8;
# Triton grouped GEMM vs torch._grouped_mm; training the small preset and the llama-block model on one GPU
# (MFU); the memory-bound kernels vs copy bandwidth and torch.compile; CP decode's --check on the GPU.
# Other parts, one device call each (docs/PERF.md names the part behind each figure): tune (attention tile
# sweep), final, gg (grouped GEMM variants), sweep (launch knobs of every kernel), final2 (the chosen
# defaults, MoE layer), swiglu, emulate (the emulator with each backend's own anchor), next (TMA K/V
# tiles in the attention kernels vs pointers, and the emulator, both ways; dW of the grouped GEMM with TMA),
# ring2 (TMA per attention kernel, TMA reduce-add dQ, the ring backward's in-kernel accumulation, PDL), ring3
# (the ring rank with PDL: forward tiles, dK/dV split per q head or not; the ring's kernels alone), ring4
# (64-row forward tiles: checked, one call, the ring rank; dQ/dK/dV tiles), ring5 (one-FMA scores, PDL in the
# backward, the ring rank's kernel timeline), ring6 (longest-first grids, final rows in bf16, one-launch GQA
# partial sums), ring7 (64-row forward default; the ring step's block kernel swept on its own shape), ring9
# (the final defaults' GPU tests; the ring backward with 32x64 dK/dV tiles), ring10 (two ring steps per forward
# launch, checked and timed; one-call attention after that change), ring13 (dK/dV summed into the received
# accumulator: checked and timed), ring14 (the ring step's dQ / dK/dV tiles swept on its blocks and in the rank),
# ring15-ring18 (see each part), ring19 (the forward's next-tile scores issued before this tile's softmax; the
# knob is gone after commit 73fc197), ring20 (the forward's refactor: checked, one call, the rank).
# Every command's full output goes to OUTDIR/<name>.log (and JSON where the command writes one); all of it
# is packed into OUTDIR/logs.tar.gz. TAIL=n shows n lines of each log; BUDGET=s skips commands after s seconds.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"   # $out, $py, $status, the multicast variables, pack_logs
part=${2:-all}
run() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS   # each command at most $LIMIT s
        if [ $SECONDS -gt "${BUDGET:-540}" ]; then echo "   skipped: past the call's ${BUDGET:-540} s"; status=1; return; fi
        timeout "${LIMIT:-240}" "$@" > "$out/$name.log" 2>&1 || { echo "   FAILED or timed out ($name)"; status=1; }
        tail -n ${TAIL:-4} "$out/$name.log"; echo "   ($((SECONDS - t0)) s)"; }
emulate_defaults() {   # ring12, ring13: the triton ring rank at the defaults, PDL off / on, and an S8192 timeline
  for pdl in 0 1; do
    LIMIT=100 run emulate_pdl$pdl env DISTLAB_TRITON_ATTN_PDL=$pdl $py -m distlab.cp.emulate --world 8 \
        --seq 8192 32768 --backend triton --iters 10 --json "$out/emulate_pdl$pdl.json"
  done
  LIMIT=60 run timeline_8k env DISTLAB_TRITON_ATTN_PDL=1 $py -m distlab.cp.emulate --world 8 --seq 8192 \
      --backend triton --iters 5 --timeline
}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > "$out/gpu.txt" 2>&1
if [ "$part" = all ]; then   # one call of under 10 minutes, in order of importance
  LIMIT=110 run gpu_tests $py -m pytest -v -m gpu tests/test_triton_kernels.py tests/test_attention_kernels.py -k triton \
      -p no:cacheprovider --timeout 40 -o faulthandler_timeout=35
  LIMIT=60 run bench_attention $py -m distlab.kernels.bench --kv-heads 32 --only attention --json "$out/bench_attention.json"
  LIMIT=90 run emulate $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton sdpa-cudnn \
      --iters 10 --json "$out/emulate.json"
  for run_ in "8 0" "8 1.5" "1 0"; do set -- $run_
    LIMIT=35 run gg_gm$1_skew$2 env DISTLAB_GROUPED_GEMM_GROUP_M=$1 $py -m distlab.kernels.grouped_gemm --skew $2 --iters 10 \
        --json "$out/gg_gm$1_skew$2.json"
  done
  LIMIT=50 run train_small $py -m distlab.train --config small --steps 60 --json "$out/train_small.json"
  LIMIT=50 run train_block $py -m distlab.train --config llama-block-8gpu --tp 1 --ring 1 --ulysses 1 --steps 3 \
      --json "$out/train_block.json"
  LIMIT=80 run bench_memory $py -m distlab.kernels.bench --only memory --iters 10 --json "$out/bench_memory.json"
  LIMIT=30 run infer_check $py -m distlab.infer --config small --steps 32 --check --json "$out/infer_check.json"
fi
if [ "$part" = tune ]; then   # second call: GPU tests (bf16/fp16 at real sizes), tile sweep, emulator, memory kernels
  LIMIT=150 run gpu_tests2 $py -m pytest -v -m gpu tests/test_triton_kernels.py tests/test_attention_kernels.py \
      -k "triton and not float32" -p no:cacheprovider --timeout 140 -o faulthandler_timeout=130
  LIMIT=110 run tune_attention $py -m distlab.kernels.tune_attention --json "$out/tune_attention.json"
  LIMIT=60 run emulate2 $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton sdpa-cudnn \
      --iters 10 --json "$out/emulate2.json"
  LIMIT=60 run bench_memory2 $py -m distlab.kernels.bench --only memory --iters 10 --json "$out/bench_memory2.json"
fi
if [ "$part" = final ]; then   # third call: tuned tiles, GQA split dK/dV, warps sweep of the memory kernels
  LIMIT=35 run emulate3 $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton sdpa-cudnn \
      --iters 10 --json "$out/emulate3.json"
  LIMIT=25 run bench_attention3 $py -m distlab.kernels.bench --kv-heads 32 --only attention --iters 10 --json "$out/bench_attention3.json"
  LIMIT=25 run bench_gqa3 $py -m distlab.kernels.bench --kv-heads 8 --only attention --iters 10 --json "$out/bench_gqa3.json"
  LIMIT=35 run bench_memory3 $py -m distlab.kernels.bench --only memory --iters 10 --json "$out/bench_memory3.json"
  LIMIT=35 run bench_memory3_w8 env DISTLAB_KERNEL_WARPS=8 $py -m distlab.kernels.bench --only memory --iters 10 \
      --json "$out/bench_memory3_w8.json"
  LIMIT=60 run gpu_tests3 $py -m pytest -v -m gpu tests/test_triton_kernels.py -k "bfloat16" \
      -p no:cacheprovider --timeout 55
  LIMIT=12 run gg_cfg4 env DISTLAB_GROUPED_GEMM_CONFIG=128,256,64,8,4 $py -m distlab.kernels.grouped_gemm --iters 10
  LIMIT=12 run gg_gm16 env DISTLAB_GROUPED_GEMM_GROUP_M=16 $py -m distlab.kernels.grouped_gemm --iters 10
fi
if [ "$part" = gg ]; then   # the grouped GEMM's kernels, every variant timed in the same interleaved rounds
  c4=CONFIG=128x256x64x8x4
  vs=(--variant ptr:TMA=0 --variant tma: --variant gm16:GROUP_M=16 --variant ws:WS=1 --variant ws_gm16:WS=1,GROUP_M=16
      --variant np:PERSISTENT=0 --variant split4:SPLIT_EPILOGUE=1,$c4 --variant split4_ws:SPLIT_EPILOGUE=1,WS=1,$c4
      --variant split4_ws_gm16:SPLIT_EPILOGUE=1,WS=1,GROUP_M=16,$c4 --variant np_split4:PERSISTENT=0,SPLIT_EPILOGUE=1,$c4
      --variant split3_ws:SPLIT_EPILOGUE=1,WS=1)
  LIMIT=150 run gg_uniform $py -m distlab.kernels.grouped_gemm "${vs[@]}" --json "$out/gg_uniform.json"
  LIMIT=150 run gg_skew $py -m distlab.kernels.grouped_gemm --skew 1.5 "${vs[@]}" --json "$out/gg_skew.json"
fi
if [ "$part" = sweep ]; then   # launch-latency-free timing; knob sweeps of attention (atomic dQ),
  # the memory-bound kernels (warps, rows/tokens/block per program) and the grouped GEMM (also after idling)
  LIMIT=90 run gpu_tests $py -m pytest -q -m gpu tests/test_triton_kernels.py -k "bfloat16" -p no:cacheprovider --timeout 80
  gv=(--variant ptr:TMA=0 --variant tma: --variant gm16:GROUP_M=16 --variant ws:WS=1 --variant ws_gm16:WS=1,GROUP_M=16
      --variant split4:SPLIT_EPILOGUE=1,CONFIG=128x256x64x8x4 --variant split4_ws:SPLIT_EPILOGUE=1,WS=1,CONFIG=128x256x64x8x4)
  LIMIT=100 run gg_sustained $py -m distlab.kernels.grouped_gemm "${gv[@]}" --json "$out/gg_sustained.json"
  LIMIT=100 run gg_cooldown $py -m distlab.kernels.grouped_gemm "${gv[@]}" --cooldown 1 --rounds 3 --json "$out/gg_cooldown.json"
  for v in "base DQ_MODE=kernel" "atomic DQ_MODE=atomic" "atomic_s2 DQ_MODE=atomic DKV=64,128,8,2"; do
    set -- $v; name=$1; shift; envs=(); for kv in "$@"; do envs+=("DISTLAB_TRITON_ATTN_$kv"); done
    LIMIT=50 run attn_$name env "${envs[@]}" $py -m distlab.kernels.bench --kv-heads 32 --only attention --iters 10 \
        --json "$out/attn_$name.json"
  done
  LIMIT=100 run mem_base $py -m distlab.kernels.bench --only memory --json "$out/mem_base.json"
  for v in "w4 WARPS=4" "w8 WARPS=8" "w16 WARPS=16" \
           "r2 RMSNORM_ROWS=2 ROPE_TOKENS=2 SWIGLU_BLOCK=1024 MERGE_BLOCK=64 RMSNORM_BWD_ROWS=1" \
           "r4 RMSNORM_ROWS=4 ROPE_TOKENS=4 SWIGLU_BLOCK=4096 MERGE_BLOCK=16 RMSNORM_BWD_ROWS=4" \
           "r4w16 RMSNORM_ROWS=4 ROPE_TOKENS=8 SWIGLU_BLOCK=8192 MERGE_BLOCK=128 RMSNORM_BWD_ROWS=8 WARPS=16" \
           "r2w4 RMSNORM_ROWS=2 ROPE_TOKENS=4 SWIGLU_BLOCK=512 MERGE_BLOCK=8 WARPS=4"; do
    set -- $v; name=$1; shift; envs=(); for kv in "$@"; do envs+=("DISTLAB_KERNEL_$kv"); done
    LIMIT=40 run mem_$name env "${envs[@]}" $py -m distlab.kernels.bench --only memory --no-compile --json "$out/mem_$name.json"
  done
  LIMIT=60 run gg_skew_cooldown $py -m distlab.kernels.grouped_gemm --skew 1.5 "${gv[@]}" --cooldown 1 --rounds 3 \
      --json "$out/gg_skew_cooldown.json"
  LIMIT=70 run emulate $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton sdpa-cudnn \
      --iters 10 --json "$out/emulate.json"
fi
if [ "$part" = final2 ]; then   # the chosen defaults: GPU tests, attention, memory kernels, grouped GEMM, MoE, emulator
  LIMIT=100 run gpu_tests $py -m pytest -q -m gpu tests/test_triton_kernels.py -k "bfloat16" -p no:cacheprovider --timeout 90
  LIMIT=40 run attention $py -m distlab.kernels.bench --kv-heads 32 --only attention --json "$out/attention.json"
  LIMIT=40 run attention_gqa $py -m distlab.kernels.bench --kv-heads 8 --only attention --json "$out/attention_gqa.json"
  LIMIT=60 run memory $py -m distlab.kernels.bench --only memory --json "$out/memory.json"
  for v in "evict SWIGLU_EVICT=1" "b8192w16 SWIGLU_BLOCK=8192 WARPS=16" "evict_b8192w16 SWIGLU_EVICT=1 SWIGLU_BLOCK=8192 WARPS=16"; do
    set -- $v; name=$1; shift; envs=(); for kv in "$@"; do envs+=("DISTLAB_KERNEL_$kv"); done
    LIMIT=30 run swiglu_$name env "${envs[@]}" $py -m distlab.kernels.bench --only memory --kernel swiglu --json "$out/swiglu_$name.json"
  done
  for skew in 0 1.5; do
    LIMIT=60 run gg_skew$skew $py -m distlab.kernels.grouped_gemm --skew $skew --variant triton: --variant pointer:TMA=0 \
        --cooldown 1 --rounds 5 --json "$out/gg_skew$skew.json"
  done
  LIMIT=40 run emulate $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton sdpa-cudnn \
      --iters 10 --json "$out/emulate.json"
  LIMIT=120 run moe_check bash launch/gpu_moe_check.sh "$out"
fi
if [ "$part" = swiglu ]; then   # SwiGLU on a 1-d row-major grid: correctness at real size, then vs torch.compile
  LIMIT=60 run swiglu_check $py tests/kernel_checks.py swiglu rmsnorm rope --device cuda --dtype bfloat16 --big
  LIMIT=60 run memory $py -m distlab.kernels.bench --only memory --json "$out/memory.json"
  LIMIT=40 run swiglu_b8192w16 env DISTLAB_KERNEL_SWIGLU_BLOCK=8192 DISTLAB_KERNEL_WARPS=16 $py -m distlab.kernels.bench \
      --only memory --kernel swiglu --json "$out/swiglu_b8192w16.json"
fi
if [ "$part" = emulate ]; then   # the emulator with each backend's own fused anchor
  LIMIT=100 run emulate $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton sdpa-cudnn \
      --iters 10 --json "$out/emulate.json"
fi
if [ "$part" = next ]; then   # to run next: K/V tiles through TMA descriptors (DISTLAB_TRITON_ATTN_TMA=1) vs
  # pointers, checked at real sizes first; the emulator with each backend's own anchor, both ways
  LIMIT=150 run gpu_tests $py -m pytest -q -m gpu tests/test_triton_kernels.py -k "bfloat16" -p no:cacheprovider --timeout 140
  for tma in 0 1; do
    LIMIT=40 run attention_tma$tma env DISTLAB_TRITON_ATTN_TMA=$tma $py -m distlab.kernels.bench --kv-heads 32 --only attention \
        --json "$out/attention_tma$tma.json"
    LIMIT=40 run attention_gqa_tma$tma env DISTLAB_TRITON_ATTN_TMA=$tma $py -m distlab.kernels.bench --kv-heads 8 \
        --only attention --json "$out/attention_gqa_tma$tma.json"
    LIMIT=60 run emulate_tma$tma env DISTLAB_TRITON_ATTN_TMA=$tma $py -m distlab.cp.emulate --world 8 --seq 8192 32768 \
        --backend triton sdpa-cudnn --iters 10 --json "$out/emulate_tma$tma.json"
  done
  # S8192's ring blocks are small (512-1024 rows): smaller tiles fill more of the 132 SMs?
  for t in "FWD=64,64,4,3 DKV=32,64,4,3 DQ=64,64,4,3" "DKV=32,128,4,3 DQ=64,64,4,3"; do
    envs=(); for kv in $t; do envs+=("DISTLAB_TRITON_ATTN_$kv"); done
    LIMIT=40 run "emulate8k_$(echo $t | tr ' =,' '___')" env "${envs[@]}" $py -m distlab.cp.emulate --world 8 --seq 8192 \
        --backend triton --iters 10 --json "$out/emulate8k_$(echo $t | tr ' =,' '___').json"
  done
  mkdir -p "$out/moe_wgrad_tma"   # dW of the grouped GEMM with TMA loads: GPU correctness, then the MoE layer's fwd+bwd
  LIMIT=120 run moe_wgrad_tma env DISTLAB_GROUPED_GEMM_WGRAD_TMA=1 bash launch/gpu_moe_check.sh "$out/moe_wgrad_tma"
fi
if [ "$part" = ring2 ]; then   # TMA per kernel, dQ by TMA reduce-adds, the ring backward's in-kernel accumulation,
  # and programmatic dependent launch of the ring's accumulating forwards (DISTLAB_TRITON_ATTN_PDL=1)
  LIMIT=120 run check_emulate $py tests/kernel_checks.py emulate --device cuda --dtype bfloat16 --big
  LIMIT=150 run check_attention $py tests/kernel_checks.py attention accumulate --device cuda --dtype bfloat16 --big
  for v in "fwd TMA=fwd" "fwd_dq TMA=fwd,dq" "fwd_dkv TMA=fwd,dkv" "reduce DQ_MODE=tma-reduce" \
           "reduce_dkv DQ_MODE=tma-reduce TMA=fwd,dkv"; do
    set -- $v; name=$1; shift; envs=(); for kv in "$@"; do envs+=("DISTLAB_TRITON_ATTN_$kv"); done
    LIMIT=40 run attn_$name env "${envs[@]}" $py -m distlab.kernels.bench --kv-heads 8 --only attention --json "$out/attn_$name.json"
  done
  for v in "base PDL=0" "pdl PDL=1" "pdl_reduce PDL=1 DQ_MODE=tma-reduce"; do
    set -- $v; name=$1; shift; envs=(); for kv in "$@"; do envs+=("DISTLAB_TRITON_ATTN_$kv"); done
    LIMIT=50 run emulate_$name env "${envs[@]}" $py -m distlab.cp.emulate --world 8 --seq 8192 32768 \
        --backend triton --iters 10 --json "$out/emulate_$name.json"
  done
fi
if [ "$part" = ring3 ]; then   # the ring rank with PDL: forward tiles (2 stages may fit two programs per SM, so one's
  # float32 accumulate epilogue overlaps the other's loop), dK/dV programs per q head or per kv head; the kernels alone
  for v in "pdl PDL=1" "fwd128x64s2 PDL=1 FWD=128,64,8,2" "fwd128x128s2 PDL=1 FWD=128,128,8,2" \
           "fwd64x64w4 PDL=1 FWD=64,64,4,3" "nosplit PDL=1 SPLIT_GROUPS=0"; do
    set -- $v; name=$1; shift; envs=(); for kv in "$@"; do envs+=("DISTLAB_TRITON_ATTN_$kv"); done
    LIMIT=50 run emulate_$name env "${envs[@]}" $py -m distlab.cp.emulate --world 8 --seq 8192 32768 \
        --backend triton --iters 10 --json "$out/emulate_$name.json"
  done
  LIMIT=60 run local_triton $py -m distlab.cp.local_kernels --world 8 --seq 8192 32768 --backend triton \
      --json "$out/local_triton.json"
  LIMIT=60 run emulate_both env DISTLAB_TRITON_ATTN_PDL=1 $py -m distlab.cp.emulate --world 8 --seq 8192 32768 \
      --backend triton sdpa-cudnn --iters 10 --json "$out/emulate_both.json"
fi
if [ "$part" = ring4 ]; then   # 64-row forward tiles (4 warps): one call, correctness at real sizes, the ring rank
  f64=FWD=64,64,4,3
  LIMIT=30 run attn_fwd64_kv32 env DISTLAB_TRITON_ATTN_$f64 $py -m distlab.kernels.bench --kv-heads 32 --only attention \
      --json "$out/attn_fwd64_kv32.json"
  LIMIT=90 run check_fwd64 env DISTLAB_TRITON_ATTN_$f64 DISTLAB_TRITON_ATTN_PDL=1 $py tests/kernel_checks.py emulate \
      accumulate --device cuda --dtype bfloat16 --big
  LIMIT=40 run emulate_fwd64 env DISTLAB_TRITON_ATTN_PDL=1 DISTLAB_TRITON_ATTN_$f64 $py -m distlab.cp.emulate --world 8 \
      --seq 8192 32768 --backend triton --iters 10 --json "$out/emulate_fwd64.json"
  LIMIT=30 run attn_fwd64_kv8 env DISTLAB_TRITON_ATTN_$f64 $py -m distlab.kernels.bench --kv-heads 8 --only attention \
      --json "$out/attn_fwd64_kv8.json"
fi
if [ "$part" = ring5 ]; then   # one-FMA scores, the backward's kernels as programmatic dependents, and the
  # kernel-by-kernel timeline of the ring rank against its backend's fused call
  f64=FWD=64,64,4,3
  LIMIT=150 run check_ring env DISTLAB_TRITON_ATTN_$f64 $py tests/kernel_checks.py emulate accumulate --device cuda \
      --dtype bfloat16 --big
  for v in "fma FMA=1" "nofma FMA=0" "fma_fwd64 FMA=1 $f64"; do
    set -- $v; name=$1; shift; envs=(); for kv in "$@"; do envs+=("DISTLAB_TRITON_ATTN_$kv"); done
    LIMIT=30 run attn_$name env "${envs[@]}" $py -m distlab.kernels.bench --kv-heads 8 --only attention --iters 10 \
        --json "$out/attn_$name.json"
  done
  LIMIT=100 run timeline env DISTLAB_TRITON_ATTN_PDL=1 DISTLAB_TRITON_ATTN_$f64 $py -m distlab.cp.emulate --world 8 \
      --seq 8192 32768 --backend triton --iters 10 --timeline --json "$out/timeline.json"
  LIMIT=45 run emulate_base $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton --iters 10 \
      --json "$out/emulate_base.json"
  LIMIT=90 run check_attention $py tests/kernel_checks.py attention --device cuda --dtype bfloat16
fi
if [ "$part" = ring6 ]; then   # longest-first grids (heads fastest), PDL from the ring's first forward, final rows
  # written in bf16 by their last block, the GQA dK/dV partials summed in one launch: checked, then timed
  f64=FWD=64,64,4,3
  LIMIT=100 run check_ring env DISTLAB_TRITON_ATTN_$f64 $py tests/kernel_checks.py emulate accumulate --device cuda \
      --dtype bfloat16 --big
  LIMIT=100 run check_attention $py tests/kernel_checks.py attention --device cuda --dtype bfloat16
  LIMIT=80 run timeline env DISTLAB_TRITON_ATTN_PDL=1 DISTLAB_TRITON_ATTN_$f64 $py -m distlab.cp.emulate --world 8 \
      --seq 8192 32768 --backend triton --iters 10 --timeline --json "$out/timeline.json"
  LIMIT=45 run emulate_base $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton --iters 10 \
      --json "$out/emulate_base.json"
  for kv in 8 32; do
    LIMIT=30 run attn_fwd64_kv$kv env DISTLAB_TRITON_ATTN_$f64 $py -m distlab.kernels.bench --kv-heads $kv --only attention \
        --iters 10 --json "$out/attn_fwd64_kv$kv.json"
  done
fi
if [ "$part" = ring7 ]; then   # 64-row forward tiles now the default: the ring step's block kernel swept on its own
  # shape (accumulating, 2048 queries x 4096 keys, and x 32768 keys: what short key loops cost), the backward
  # tiles again with the longest-first grids, the ring rank with and without PDL
  blk=(--seq 2048 --seq-k 4096 --no-causal --kv-heads 8 --only FWD)
  fw=(); for c in 64,64,4,3 64,64,4,2 64,32,4,3 64,32,4,4 64,128,4,2 128,64,8,3 64,64,8,3; do fw+=(--config FWD=$c); done
  LIMIT=70 run tune_step_acc $py -m distlab.kernels.tune_attention "${blk[@]}" --accumulate "${fw[@]}" --json "$out/tune_step_acc.json"
  LIMIT=25 run tune_step_plain $py -m distlab.kernels.tune_attention "${blk[@]}" --config FWD=64,64,4,3 --json "$out/tune_step_plain.json"
  LIMIT=30 run tune_long_acc $py -m distlab.kernels.tune_attention --seq 2048 --seq-k 32768 --no-causal --kv-heads 8 --only FWD \
      --accumulate --config FWD=64,64,4,3 --json "$out/tune_long_acc.json"
  LIMIT=80 run tune_bwd $py -m distlab.kernels.tune_attention --kv-heads 8 --only DKV DQ --json "$out/tune_bwd.json"
  LIMIT=80 run tune_step_bwd $py -m distlab.kernels.tune_attention --seq 2048 --seq-k 4096 --no-causal --kv-heads 8 --only DKV DQ \
      --json "$out/tune_step_bwd.json"
  for v in "base PDL=0" "pdl PDL=1"; do
    set -- $v; name=$1; shift; envs=(); for kv in "$@"; do envs+=("DISTLAB_TRITON_ATTN_$kv"); done
    LIMIT=45 run emulate_$name env "${envs[@]}" $py -m distlab.cp.emulate --world 8 --seq 8192 32768 \
        --backend triton --iters 10 --json "$out/emulate_$name.json"
  done
fi
if [ "$part" = ring9 ]; then   # the final defaults: GPU tests of the Triton kernels, then the ring rank's backward
  # with the dK/dV tiles that were fastest on a ring step's block (32,64,4,3) against the default
  LIMIT=200 run gpu_tests $py -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_attention_kernels.py -k triton \
      -p no:cacheprovider --timeout 190
  for v in "pdl PDL=1" "pdl_dkv32x64 PDL=1 DKV=32,64,4,3"; do
    set -- $v; name=$1; shift; envs=(); for kv in "$@"; do envs+=("DISTLAB_TRITON_ATTN_$kv"); done
    LIMIT=45 run emulate_$name env "${envs[@]}" $py -m distlab.cp.emulate --world 8 --seq 8192 32768 \
        --backend triton --iters 10 --json "$out/emulate_$name.json"
  done
fi
if [ "$part" = ring10 ]; then   # two ring steps per forward launch (flash_forward_blocks), dK/dV tiles of ring steps
  LIMIT=240 run check_ring $py tests/kernel_checks.py accumulate emulate --device cuda --dtype bfloat16 --big
  for v in "base PDL=0" "pdl PDL=1"; do
    set -- $v; name=$1; shift; envs=(); for kv in "$@"; do envs+=("DISTLAB_TRITON_ATTN_$kv"); done
    LIMIT=90 run emulate_$name env "${envs[@]}" $py -m distlab.cp.emulate --world 8 --seq 8192 32768 \
        --backend triton --steps-per-launch 1 2 --iters 10 --json "$out/emulate_$name.json"
  done
  LIMIT=40 run bench_gqa $py -m distlab.kernels.bench --kv-heads 8 --only attention --iters 10 --json "$out/bench_gqa.json"
  LIMIT=40 run bench_mha $py -m distlab.kernels.bench --kv-heads 32 --only attention --iters 10 --json "$out/bench_mha.json"
  LIMIT=60 run timeline env DISTLAB_TRITON_ATTN_PDL=1 $py -m distlab.cp.emulate --world 8 --seq 32768 --backend triton \
      --steps-per-launch 2 --iters 5 --timeline
fi
if [ "$part" = ring11 ]; then   # defaults only: steps_per_launch from distlab.cp.ring (triton: 2), PDL off / on
  LIMIT=240 run check_ring $py tests/kernel_checks.py accumulate emulate --device cuda --dtype bfloat16 --big
  for pdl in 0 1; do
    LIMIT=100 run emulate_pdl$pdl env DISTLAB_TRITON_ATTN_PDL=$pdl $py -m distlab.cp.emulate --world 8 \
        --seq 8192 32768 --backend triton sdpa-cudnn --iters 10 --json "$out/emulate_pdl$pdl.json"
  done
  LIMIT=60 run timeline_8k env DISTLAB_TRITON_ATTN_PDL=1 $py -m distlab.cp.emulate --world 8 --seq 8192 \
      --backend triton --iters 5 --timeline
fi
if [ "$part" = ring12 ]; then   # ring11's timing, the dK/dV adds back to two add_ launches
  emulate_defaults
fi
if [ "$part" = ring13 ]; then   # dkv_into: split partials summed straight into the received dK/dV accumulator
  LIMIT=150 run check_ring $py tests/kernel_checks.py accumulate emulate --device cuda --dtype bfloat16 --big
  LIMIT=200 run check_attention $py tests/kernel_checks.py attention --device cuda --dtype bfloat16 --big
  emulate_defaults
fi
if [ "$part" = ring14 ]; then   # the ring step's dQ (and dK/dV) tiles, swept on its blocks, then in the rank
  for shape in "1024 512" "512 1024" "4096 2048" "2048 4096"; do set -- $shape
    LIMIT=80 run tune_dq_$1x$2 $py -m distlab.kernels.tune_attention --seq $1 --seq-k $2 --no-causal --kv-heads 8 \
        --ring-step --only DQ --json "$out/tune_dq_$1x$2.json"
  done
  LIMIT=60 run tune_dkv_1024x512 $py -m distlab.kernels.tune_attention --seq 1024 --seq-k 512 --no-causal --kv-heads 8 \
      --ring-step --only DKV --config DKV=32,64,4,3 --config DKV=16,64,4,3 --config DKV=32,32,4,3 \
      --config DKV=32,64,4,4 --config DKV=64,64,4,3 --json "$out/tune_dkv_1024x512.json"
  for knob in DQ_RING=64,64,4,3 DQ_RING=128,32,4,3 DQ_RING=64,32,4,3 TMA=fwd,dq; do
    LIMIT=70 run emulate_$knob env DISTLAB_TRITON_ATTN_PDL=1 DISTLAB_TRITON_ATTN_$knob $py -m distlab.cp.emulate \
        --world 8 --seq 8192 32768 --backend triton --iters 10 --json "$out/emulate_$knob.json"
  done
fi
if [ "$part" = ring15 ]; then   # the forward's lazy rescale, the split sum in the dQ kernel, TMA K/V tiles in dQ:
  # timed in the rank (one process, same anchors) and in one call, then checked in bf16 at real sizes (the lazy
  # rescale was slower and is gone after commit 9fed998: RESCALE is no knob any more, its runs repeat the default)
  LIMIT=220 run emulate_variants env DISTLAB_TRITON_ATTN_PDL=1 $py -m distlab.cp.emulate --world 8 --seq 8192 32768 \
      --backend triton --iters 10 --variant '' 'SPLIT_SUM=dq' 'SPLIT_SUM=dq;TMA=fwd,dq' 'RESCALE=lazy' \
      'RESCALE=lazy;SPLIT_SUM=dq;TMA=fwd,dq' --json "$out/emulate_variants.json"
  for r in always lazy; do
    LIMIT=50 run bench_$r env DISTLAB_TRITON_ATTN_RESCALE=$r $py -m distlab.kernels.bench --kv-heads 8 --only attention \
        --iters 10 --json "$out/bench_$r.json"
  done
  LIMIT=150 run check_attention $py tests/kernel_checks.py attention --device cuda --dtype bfloat16 --big
  LIMIT=150 run check_ring env DISTLAB_TRITON_ATTN_RESCALE=lazy DISTLAB_TRITON_ATTN_SPLIT_SUM=dq \
      DISTLAB_TRITON_ATTN_TMA=fwd,dq $py tests/kernel_checks.py emulate accumulate --device cuda --dtype bfloat16 --big
fi
if [ "$part" = ring16 ]; then   # up to four ring steps a forward launch; step 0 alone, then growing groups
  LIMIT=220 run check_ring $py tests/kernel_checks.py accumulate emulate --device cuda --dtype bfloat16 --big
  LIMIT=150 run emulate_groups env DISTLAB_TRITON_ATTN_PDL=1 $py -m distlab.cp.emulate --world 8 --seq 8192 32768 \
      --backend triton --iters 10 --no-backward --steps-per-launch 1 2 4 2,2,2,2 1,3,4 2,2,4 1,1,3,3 \
      --json "$out/emulate_groups.json"
  LIMIT=80 run emulate_default env DISTLAB_TRITON_ATTN_PDL=1 $py -m distlab.cp.emulate --world 8 --seq 8192 32768 \
      --backend triton --iters 10 --steps-per-launch 2 4 --json "$out/emulate_default.json"
  LIMIT=60 run timeline env DISTLAB_TRITON_ATTN_PDL=1 $py -m distlab.cp.emulate --world 8 --seq 32768 --backend triton \
      --steps-per-launch 4 --iters 5 --no-backward --timeline
fi
if [ "$part" = ring17 ]; then   # the final defaults (triton: 0 | 1 2 3 | 4 5 6 7): checked, one call, the rank
  LIMIT=220 run check_ring $py tests/kernel_checks.py accumulate emulate --device cuda --dtype bfloat16 --big
  LIMIT=50 run bench_gqa $py -m distlab.kernels.bench --kv-heads 8 --only attention --iters 10 --json "$out/bench_gqa.json"
  emulate_defaults
fi
if [ "$part" = ring18 ]; then   # the ring backward's first step writes dQ (no zero fill) and its split partials
  # are summed by the dQ kernel (the one call's too): checked, then the rank PDL off / on and an S8192 timeline
  LIMIT=200 run check_attention $py tests/kernel_checks.py attention --device cuda --dtype bfloat16 --big
  LIMIT=150 run check_ring $py tests/kernel_checks.py emulate --device cuda --dtype bfloat16 --big
  emulate_defaults
fi
if [ "$part" = ring19 ]; then   # the forward with the next tile's scores issued before this tile's softmax
  # (DISTLAB_TRITON_ATTN_OVERLAP=1, commit 73fc197, reverted: 2x slower): one call, the rank's forward, checked
  for ov in 0 1; do
    LIMIT=60 run bench_overlap$ov env DISTLAB_TRITON_ATTN_OVERLAP=$ov $py -m distlab.kernels.bench --kv-heads 8 \
        --only attention --iters 10 --json "$out/bench_overlap$ov.json"
  done
  LIMIT=150 run emulate_overlap $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton --iters 10 \
      --no-backward --variant '' 'OVERLAP=1' 'OVERLAP=1;FWD=128,64,8,2' 'OVERLAP=1;FWD=64,64,4,2' \
      --json "$out/emulate_overlap.json"
  LIMIT=60 run bench_overlap1_128 env DISTLAB_TRITON_ATTN_OVERLAP=1 DISTLAB_TRITON_ATTN_FWD=128,64,8,2 $py -m \
      distlab.kernels.bench --kv-heads 8 --only attention --iters 10 --json "$out/bench_overlap1_128.json"
  LIMIT=200 run check_overlap env DISTLAB_TRITON_ATTN_OVERLAP=1 $py tests/kernel_checks.py accumulate emulate \
      --device cuda --dtype bfloat16 --big
fi
if [ "$part" = ring20 ]; then   # the forward kernel's refactor (one _fwd_all_keys for every unmasked block) and
  # ea7bcd8's host code: checked in bf16 at real sizes, then one call and the rank at the defaults, PDL off / on
  LIMIT=200 run check_ring $py tests/kernel_checks.py accumulate emulate --device cuda --dtype bfloat16 --big
  LIMIT=60 run bench_gqa $py -m distlab.kernels.bench --kv-heads 8 --only attention --iters 10 --json "$out/bench_gqa.json"
  for pdl in 0 1; do
    LIMIT=100 run emulate_pdl$pdl env DISTLAB_TRITON_ATTN_PDL=$pdl $py -m distlab.cp.emulate --world 8 \
        --seq 8192 32768 --backend triton --iters 10 --json "$out/emulate_pdl$pdl.json"
  done
fi
pack_logs
exit $status
