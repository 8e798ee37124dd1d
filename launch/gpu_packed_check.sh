#!/usr/bin/env bash
# One-GPU check of packed documents and windows (issue #23): the masked Triton kernel at real sizes in bf16
# and fp16 against the float64 torch loop, the ring study with documents on the GPU (--check), and the
# packed emulator (a ring rank's schedule vs one call, W=8, 32q/8kv, head_dim 128, lognormal mean 2k).
#
#   bash launch/gpu_packed_check.sh OUTDIR [PART]   # logs and JSON into OUTDIR; PART: all (default),
#                                                   # fulltiles (the masked kernel with/without its fast path) or
#                                                   # accumulate (the kernels merging/adding in place: checks, 64k ring),
#                                                   # placement (every candidate of the balanced layout timed, with
#                                                   # the kernel profile of the balanced layout's slowest rank)
#                                                   # order (the masked forward's tile order, rows vs lpt),
#                                                   # backward (the packed ring's streams, forward and
#                                                   # backward, A/B, with the GPU checks of every mode)
#                                                   # or verify (the checks, then the default schedule, A/B:
                                                  # launch groups, the dQ's old path; seed 3)
#                                                   # or seeds (the default schedule over five packs)
#                                                   # or allgather (all-gather CP's compute on the packs, each
#                                                   # query tile's gap skipped and not, A/B)
#                                                   # or agorder (all-gather CP's rank, its tiles longest first
#                                                   # against row order, A/B; seeds 0 and 1)
#                                                   # or agfa4 (all-gather CP's rank on FA4 varlen, copies of
#                                                   # shared keys; FA4's GPU tests first; needs /opt/fa4)
#                                                   # or agprof (all-gather's FA4 rank: kernels and timeline
#                                                   # beside one call's; then the contiguous copies A/B) or agchunks
#                                                   # (one kv-head group) or agsum (the copies' dK/dV summed in
#                                                   # one Triton pass against the torch path, A/B; needs /opt/fa4)
#                                                   # or agverify (FA4's GPU tests, then one and two kv-head groups)
#                                                   # or agkeep (the forward's key copies kept for the backward,
#                                                   # knob FA4_KEEP_KEY_COPIES, A/B; then a profile; needs /opt/fa4;
#                                                   # SEEDS, RUNS, NO_PROFILE=1 narrow it)
#                                                   # or fa4 (FA4's varlen path for masks: its GPU tests, the packed
#                                                   # ring rank on FA4 blocks against one FA4 call; needs /opt/fa4 from
#                                                   # ../shared/tools/fa4-carry's two calls on this warm machine)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
part=${2:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"

if [ "$part" = fa4 ]; then
  export PYTHONPATH=/opt/fa4:/opt/fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  timeout -s ABRT 200 $py -m pytest -q -m gpu tests/test_fa4_varlen.py -p no:cacheprovider || status=1
  timeout -s ABRT 120 $py -m distlab.cp.ring --seq 16384 --docs lognormal:mean=2048,seed=0 --backend fa4 --check \
    --json "$out/ring_docs_w1_fa4.json" || status=1
  for backend in fa4 triton; do
    timeout -s ABRT 200 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 --layouts zigzag balanced \
      --backend $backend --rate-means 2048 512 --iters 5 --warmup 1 --json "$out/packed_$backend.json" || status=1
  done
  pack_logs
  exit $status
fi

if [ "$part" = order ]; then   # A/B: the masked forward's query tiles in row order vs longest first (lpt)
  for order in rows lpt; do
    DISTLAB_TRITON_MASKED_ORDER=$order timeout -s ABRT 150 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 \
      --layouts zigzag balanced units --backend triton --rate-means 2048 --iters 5 --warmup 1 \
      --json "$out/order_$order.json" || status=1
  done
  pack_logs
  exit $status
fi

if [ "$part" = verify ]; then   # the masked kernels and the packed ring checked in bf16 (each row's first dQ
  # kernel writing, its last writing the final dQ; the forward and dQ by launch groups, 2026-12-05), then the
  # default schedule timed (64k, W=8: one launch a step), and the A/Bs
  timeout -s ABRT 240 $py tests/kernel_checks.py masked packed_ring --device cuda --dtype bfloat16 --big \
    2>&1 | tee "$out/checks.log" || status=1
  timeout -s ABRT 150 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 --layouts zigzag balanced units \
    --backend triton --iters 5 --warmup 2 --rate-means --json "$out/default.json" 2>&1 | tee "$out/default.log" || status=1
  # A/B: the forward and dQ by launch groups 0 | 1 2 3 | 4 5 6 7 (opt-in; H100 2026-12-05: slower)
  DISTLAB_RING_STEPS_PER_LAUNCH=4 timeout -s ABRT 150 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 \
    --layouts balanced units --backend triton --iters 5 --warmup 2 --rate-means --json "$out/steps_4.json" 2>&1 \
    | tee "$out/steps_4.log" || status=1
  # A/B: the dQ zero-filled and converted after the ring (before 2026-12-05)
  DISTLAB_RING_DQ_FINAL=0 timeout -s ABRT 150 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 --layouts \
    balanced --backend triton --iters 5 --warmup 2 --rate-means --json "$out/dq_final_off.json" 2>&1 \
    | tee "$out/dq_final_off.log" || status=1
  # another pack (seed 3), launch groups against one launch a step
  for n in 4 1; do
    DISTLAB_RING_STEPS_PER_LAUNCH=$n timeout -s ABRT 120 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 \
      --docs lognormal:mean=2048,seed=3 --layouts balanced units --backend triton --iters 5 --warmup 2 --rate-means \
      --json "$out/seed3_steps_$n.json" 2>&1 | tee "$out/seed3_steps_$n.log" || status=1
  done
  pack_logs
  exit $status
fi

if [ "$part" = seeds ]; then   # the default schedule over five packs (lognormal mean 2048, seeds 0-4): #23's
  # figure as a median, not one pack's (the wave model's spread over ten packs: docs/PERF.md)
  for seed in 0 1 2 3 4; do
    timeout -s ABRT 120 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 --docs lognormal:mean=2048,seed=$seed \
      --layouts balanced units --backend triton --iters 5 --warmup 2 --json "$out/seed$seed.json" 2>&1 \
      | tee "$out/seed$seed.log" || status=1
  done
  pack_logs
  exit $status
fi

if [ "$part" = backward ]; then   # the packed ring's streams: forward 1 or 2, backward 1, 2 or 4 (A/B)
  timeout -s ABRT 200 $py tests/kernel_checks.py masked packed_ring --device cuda --dtype bfloat16 --big \
    2>&1 | tee "$out/checks.log" || status=1
  # ring blocks' tiles longest first (auto); each pair "fwd,bwd" a run of zigzag and balanced: 1,2 (the default
  # until 2026-12-05), 1,4 (the default since: H100, docs/PERF.md) with units and the slowest balanced rank's
  # kernel profile and timeline (its streams' kernels overlapping); STREAMS="1,2 2,2 1,4 2,4" runs them all
  for ab in ${STREAMS:-1,2 1,4}; do
    fwd=${ab%,*} bwd=${ab#*,}
    layouts="zigzag balanced" extra=""
    [ "$ab" = 1,4 ] && layouts="zigzag balanced units" extra="--profile balanced --timeline balanced"
    DISTLAB_PACKED_FWD_STREAMS=$fwd DISTLAB_PACKED_BWD_STREAMS=$bwd timeout -s ABRT 150 $py \
      -m distlab.cp.emulate_packed --world 8 --seq 65536 --layouts $layouts --backend triton --rate-means \
      --iters 5 --warmup 2 $extra --json "$out/streams_${fwd}_$bwd.json" 2>&1 | tee "$out/streams_${fwd}_$bwd.log" \
      || status=1
  done
  # the wave model (docs/PERF.md, fitted on the H200's 2026-12-05b figures) beside what this run measured:
  # 1,2 is its lpt+dq, 1,4 its bwd4
  $py -m distlab.cp.waves --measured "$out/streams_1_2.json:lpt+dq" "$out/streams_1_4.json:bwd4" \
    --json "$out/waves_vs_measured.json" 2>&1 | tee "$out/waves_vs_measured.log" || status=1
  # two more packs, both schedules (the model, bwd4 f+b, balanced: seed 3 88.4%, seed 1 93.4%; measured on
  # the H100 2026-12-05, seed 3 with 1,2 and 2,4: docs/PERF.md)
  for seed in 3 1; do
    for ab in 1,2 1,4; do
      fwd=${ab%,*} bwd=${ab#*,}
      DISTLAB_PACKED_FWD_STREAMS=$fwd DISTLAB_PACKED_BWD_STREAMS=$bwd timeout -s ABRT 120 $py \
        -m distlab.cp.emulate_packed --world 8 --seq 65536 --docs lognormal:mean=2048,seed=$seed --layouts \
        balanced units --backend triton --iters 5 --warmup 2 --json "$out/seed${seed}_${fwd}_$bwd.json" 2>&1 \
        | tee "$out/seed${seed}_${fwd}_$bwd.log" || status=1
    done
    $py -m distlab.cp.waves --docs lognormal:mean=2048,seed=$seed --layouts balanced units --measured \
      "$out/seed${seed}_1_2.json:lpt+dq" "$out/seed${seed}_1_4.json:bwd4" \
      --json "$out/waves_vs_measured_seed$seed.json" 2>&1 | tee "$out/waves_vs_measured_seed$seed.log" || status=1
  done
  pack_logs
  exit $status
fi

if [ "$part" = allgather ]; then   # all-gather CP's compute on packed layouts, each query tile's gap skipped or not
  timeout -s ABRT 150 $py tests/kernel_checks.py masked --device cuda --dtype bfloat16 --big \
    2>&1 | tee "$out/checks_masked.log" || status=1
  for gaps in 1 0; do   # the model (distlab.cp.waves, all-gather column): balanced f+b 72.9% with gaps skipped
    DISTLAB_TRITON_MASKED_GAPS=$gaps timeout -s ABRT 150 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 \
      --method allgather --layouts zigzag balanced units --backend triton --iters 5 --warmup 1 \
      --json "$out/allgather_gaps$gaps.json" 2>&1 | tee "$out/allgather_gaps$gaps.log" || status=1
  done
  pack_logs
  exit $status
fi

if [ "$part" = agorder ]; then   # (24th session) all-gather CP's rank with its tiles longest first (auto: a rank's
  # rows against more keys than it holds) against row order (the model, distlab.cp.waves: balanced f+b 72.9 ->
  # 91.6%, units 82.1 -> 94.3%; measured in row order 57.8 / 64.2%); the one call keeps row order both times
  timeout -s ABRT 150 $py tests/kernel_checks.py masked --device cuda --dtype bfloat16 --big \
    2>&1 | tee "$out/checks_masked.log" || status=1
  for spec in rows:0 auto:0 auto:1; do
    order=${spec%%:*} seed=${spec##*:}
    DISTLAB_TRITON_MASKED_ORDER=$order timeout -s ABRT 150 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 \
      --method allgather --docs lognormal:mean=2048,seed=$seed --layouts balanced units --backend triton \
      --rate-means --iters 5 --warmup 1 --json "$out/allgather_${order}_seed$seed.json" \
      2>&1 | tee "$out/allgather_${order}_seed$seed.log" || status=1
  done
  pack_logs
  exit $status
fi

if [ "$part" = agfa4 ]; then   # (24th session) all-gather CP's rank on FA4 varlen: sequences that share a
  # document's first keys read copies of them (fa4_varlen.key_index), so every rank of the balanced and units
  # layouts is FA4 sequences; against one FA4 varlen call on the pack. Needs /opt/fa4 (fa4-carry's two calls)
  export PYTHONPATH=/opt/fa4:/opt/fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  timeout -s ABRT 200 $py -m pytest -q -m gpu tests/test_fa4_varlen.py -p no:cacheprovider 2>&1 \
    | tee "$out/gpu_tests.log" || status=1
  for seed in 0 1; do
    timeout -s ABRT 150 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 --method allgather \
      --docs lognormal:mean=2048,seed=$seed --layouts balanced units --backend fa4 --rate-means --iters 5 \
      --warmup 1 --json "$out/allgather_fa4_seed$seed.json" 2>&1 | tee "$out/allgather_fa4_seed$seed.log" || status=1
  done
  pack_logs
  exit $status
fi

if [ "$part" = agprof ]; then   # (25th session) where all-gather CP's FA4 rank goes: its kernels and timeline
  # beside one FA4 varlen call's, with the copies' dK/dV summed over the rows read only; two kv-head groups
  # (the default) against one; the masked Triton kernel with one group. Needs /opt/fa4 (fa4-carry's two calls)
  export PYTHONPATH=/opt/fa4:/opt/fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  timeout -s ABRT 200 $py -m pytest -q -m gpu tests/test_fa4_varlen.py -p no:cacheprovider 2>&1 \
    | tee "$out/gpu_tests.log" || status=1
  timeout -s ABRT 150 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 --method allgather --layouts balanced \
    units --backend fa4 --rate-means --iters 5 --warmup 1 --profile balanced --timeline balanced \
    --json "$out/allgather_fa4_prof.json" 2>&1 | tee "$out/allgather_fa4_prof.log" || status=1
  # A/B (26th session): the backward's contiguous copies of the head groups' q, out and dO (the default since:
  # FA4 takes the strided views)
  DISTLAB_FA4_MASKED_CONTIGUOUS=1 timeout -s ABRT 120 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 \
    --method allgather --layouts balanced units --backend fa4 --rate-means --iters 5 --warmup 1 \
    --json "$out/allgather_fa4_copies.json" 2>&1 | tee "$out/allgather_fa4_copies.log" || status=1
  pack_logs
  exit $status
fi

if [ "$part" = agsum ]; then   # (27th session) the copies' dK/dV summed in one Triton pass (knob FA4_COPIES_KERNEL)
  # against the torch path's five, all-gather CP's FA4 rank at 64k, seeds 0 and 1, A B A B. Needs /opt/fa4
  export PYTHONPATH=/opt/fa4:/opt/fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  timeout -s ABRT 60 $py tests/kernel_checks.py copies --device cuda --dtype bfloat16 --big 2>&1 \
    | tee "$out/copies_check.log" || status=1
  timeout -s ABRT 200 $py -m pytest -q -m gpu tests/test_fa4_varlen.py -p no:cacheprovider 2>&1 \
    | tee "$out/gpu_tests.log" || status=1
  for seed in 0 1; do
    for run in 0a 1a 0b 1b; do
      kernel=${run:0:1}
      DISTLAB_FA4_COPIES_KERNEL=$kernel timeout -s ABRT 100 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 \
        --method allgather --docs lognormal:mean=2048,seed=$seed --layouts balanced units --backend fa4 \
        --rate-means --iters 5 --warmup 1 --json "$out/allgather_fa4_seed${seed}_kernel${run}.json" 2>&1 \
        | tee "$out/allgather_fa4_seed${seed}_kernel${run}.log" || status=1
    done
  done
  DISTLAB_FA4_COPIES_KERNEL=1 timeout -s ABRT 100 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 \
    --method allgather --layouts balanced --backend fa4 --rate-means --iters 5 --warmup 1 --profile balanced \
    --json "$out/allgather_fa4_kernel_prof.json" 2>&1 | tee "$out/allgather_fa4_kernel_prof.log" || status=1
  pack_logs
  exit $status
fi

if [ "$part" = agverify ]; then   # (27th session) FA4's GPU tests with the copies kernel the default; then
  # all-gather CP's FA4 rank with one kv-head group and two, seeds 0 and 1. Needs /opt/fa4
  export PYTHONPATH=/opt/fa4:/opt/fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  timeout -s ABRT 200 $py -m pytest -q -m gpu tests/test_fa4_varlen.py -p no:cacheprovider 2>&1 \
    | tee "$out/gpu_tests.log" || status=1
  for seed in 0 1; do
    for chunks in 2 1; do
      timeout -s ABRT 100 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 --method allgather \
        --docs lognormal:mean=2048,seed=$seed --layouts balanced units --backend fa4 --chunks $chunks --rate-means \
        --iters 5 --warmup 1 --json "$out/allgather_fa4_seed${seed}_chunks$chunks.json" 2>&1 \
        | tee "$out/allgather_fa4_seed${seed}_chunks$chunks.log" || status=1
    done
  done
  pack_logs
  exit $status
fi

if [ "$part" = agkeep ]; then   # (28th session) all-gather CP's FA4 rank: the forward's copies of shared keys kept
  # for the backward (default) against gathered again (FA4_KEEP_KEY_COPIES=0), seeds 0 and 1, A B A B; then the
  # kernels of one run (the gathers: 8 launches before, 4 now). Needs /opt/fa4
  export PYTHONPATH=/opt/fa4:/opt/fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  timeout -s ABRT 200 $py -m pytest -q -m gpu tests/test_fa4_varlen.py -p no:cacheprovider 2>&1 \
    | tee "$out/gpu_tests.log" || status=1
  for seed in ${SEEDS:-0 1}; do
    for run in ${RUNS:-1a 0a 1b 0b}; do
      DISTLAB_FA4_KEEP_KEY_COPIES=${run:0:1} timeout -s ABRT 100 $py -m distlab.cp.emulate_packed --world 8 \
        --seq 65536 --method allgather --docs lognormal:mean=2048,seed=$seed --layouts balanced units --backend fa4 \
        --rate-means --iters 5 --warmup 1 --json "$out/allgather_fa4_seed${seed}_keep${run}.json" 2>&1 \
        | tee "$out/allgather_fa4_seed${seed}_keep${run}.log" || status=1
    done
  done
  [ -n "${NO_PROFILE:-}" ] || timeout -s ABRT 150 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 --method \
    allgather --layouts balanced --backend fa4 --rate-means --iters 5 --warmup 1 --profile balanced \
    --json "$out/allgather_fa4_keep_prof.json" 2>&1 | tee "$out/allgather_fa4_keep_prof.log" || status=1
  pack_logs
  exit $status
fi

if [ "$part" = agchunks ]; then   # all-gather CP's rank with one kv-head group, FA4 and masked Triton (/opt/fa4)
  export PYTHONPATH=/opt/fa4:/opt/fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  for chunks in 1; do
    for backend in fa4 triton; do
      timeout -s ABRT 150 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 --method allgather --layouts \
        balanced units --backend $backend --chunks $chunks --rate-means --iters 5 --warmup 1 \
        --json "$out/allgather_${backend}_chunks$chunks.json" 2>&1 | tee "$out/allgather_${backend}_chunks$chunks.log" \
        || status=1
    done
  done
  pack_logs
  exit $status
fi

if [ "$part" = accumulate ]; then
  timeout -s ABRT 110 $py tests/kernel_checks.py masked --device cuda --dtype bfloat16 --big || status=1
  timeout -s ABRT 170 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 --rate-means --iters 5 --warmup 1 \
    --json "$out/packed_accumulate.json" || status=1
  pack_logs
  exit $status
fi

if [ "$part" = placement ]; then   # the slowest rank's kernels per layout; the units deal against balanced
  DISTLAB_TRITON_LAUNCH=check timeout -s ABRT 150 $py tests/kernel_checks.py masked --device cuda --dtype bfloat16 \
    --big || status=1   # the masked kernels' cached launch, checked against Triton's own binding
  # every candidate of the balanced layout, timed against each other beside its tile bound and block count (the
  # CPU's figures): which criterion should pick among them (docs/PERF.md, #23)
  timeout -s ABRT 420 $py -m distlab.cp.emulate_packed --world 8 --seq 32768 65536 --layouts zigzag balanced units \
    docs-first:0.5 docs-first:0.25 docs-first:0.125 docs-first:0 --profile balanced --rate-means --iters 5 --warmup 1 \
    --json "$out/placement.json" || status=1
  pack_logs
  exit $status
fi

if [ "$part" = fulltiles ]; then
  $py tests/kernel_checks.py masked --device cuda --dtype bfloat16 --big || status=1
  for full in 0 1; do
    echo "== DISTLAB_TRITON_MASKED_FULL_TILES=$full: causal as a mask (TFLOP/s on visible pairs), packed ring rank =="
    DISTLAB_TRITON_MASKED_FULL_TILES=$full $py -c "
import torch
from distlab.plan.calibration import measure_attention
f, b = measure_attention(torch.device('cuda'), torch.bfloat16, 32, 8, 128, [4096, 16384, 32768], 'auto', True, 10, 3, masked=True)
print('fwd', [round(r / 1e12) for _, r in f], 'bwd', [round(r / 1e12) for _, r in b])" || status=1
    DISTLAB_TRITON_MASKED_FULL_TILES=$full $py -m distlab.cp.emulate_packed --world 8 --seq 65536 \
      --json "$out/packed_full$full.json" 2>&1 | tail -6 || status=1
  done
  exit $status
fi

echo "== masked kernel, bf16 and fp16, S8192 32q/8kv D128 =="
$py tests/kernel_checks.py masked --device cuda --dtype bfloat16 --big || status=1
$py tests/kernel_checks.py masked --device cuda --dtype float16 --big || status=1

echo "== ring study with documents and a window, W=1 on the GPU =="
$py -m distlab.cp.ring --seq 16384 --docs lognormal:mean=2048,seed=0 --window 4096 --check \
    --json "$out/ring_docs_w1.json" || status=1

echo "== a ring rank's packed schedule vs one call, W=8 =="
$py -m distlab.cp.emulate_packed --world 8 --seq 32768 65536 --json "$out/packed.json" || status=1
exit $status
