#!/usr/bin/env bash
# Host cost and wall clock on one H200 (#24), and the CUDA-graphed decode step (#29), in two parts:
#   bash launch/gpu_host_check.sh OUTDIR kernels   # no FA4 needed: the Triton GPU tests in cached and check
#                                                  # launch modes, the graphed-decode test, graph vs eager decode
#   bash launch/gpu_host_check.sh OUTDIR timing    # FA4 present (../shared/tools/fa4-carry): its GPU tests with
#                                                  # the replayed forward, host_cost, the W=8 ring rank wall/GPU
#                                                  # (and with DISTLAB_RING_MERGE_BLOCKS=0 beside it)
#   bash launch/gpu_host_check.sh OUTDIR first     # no FA4: bf16 real-size kernel checks, host_cost, the Triton
#                                                  # ring rank's wall clock, the packed 64k rank (logs unpacked)
#   bash launch/gpu_host_check.sh OUTDIR fa4       # FA4 present: its GPU tests, the ring rank and the packed 64k
#                                                  # rank on FA4 blocks, host_cost (logs unpacked)
#   bash launch/gpu_host_check.sh OUTDIR fa4ring   # FA4 present: the W=8 ring rank on FA4 blocks against Triton's,
#                                                  # wall and GPU, the FA4 rank's kernel timeline at S32768, host_cost
#   bash launch/gpu_host_check.sh OUTDIR fa4accum  # FA4 present: the FA4 ring backward with its accumulators kept
#                                                  # (GPU test, A/B wall and GPU, timeline, host_cost)
#   bash launch/gpu_host_check.sh OUTDIR fa4why    # FA4 present: the FA4 ring rank's kernels (kept and not, S8192)
#                                                  # and its host time a step at S8192's shapes, profiled
#   bash launch/gpu_host_check.sh OUTDIR fa4pick   # FA4 present: the FA4 ring's GPU test, FA4 vs Triton ring ranks
#                                                  # at S8192, 16384, 32768 (wall): auto's ring pick
#   bash launch/gpu_host_check.sh OUTDIR fa4host   # FA4 present: after the host cuts, the FA4 ring's GPU test, merge
#                                                  # keys checked, the FA4 rank (wall), host time a step at S8192
#   bash launch/gpu_host_check.sh OUTDIR fa4fuse   # FA4 present: a launch group's blocks fused (ring_fused): GPU
#                                                  # tests, merge keys, the W=8 FA4 rank by groups 1/2/4 (wall, GPU)
#   bash launch/gpu_host_check.sh OUTDIR fa4land   # FA4 present: K/V received into the fused blocks' buffers
#                                                  # (ring_landing) vs concatenated: GPU tests, host, W=8 rank 0 / 7
#                                                  # (fa4land2: after its host cuts, both orders, rank 0 and 7)
#   bash launch/gpu_host_check.sh OUTDIR fa4keep   # FA4 present: the landing buffers kept per ring shape: GPU
#                                                  # tests, W=8 rank landing on/off wall, host_cost (fa4zero: the
#                                                  # dK/dV scratch zeroed ahead: tests, GPU clock, wall)
#   bash launch/gpu_host_check.sh OUTDIR fa4keepmin # the same, S8192 and S32768 landing on/off wall and host_cost only
#   bash launch/gpu_host_check.sh OUTDIR fa4cudnn  # the FA4 rank against cuDNN's one call, both orders, wall
#   bash launch/gpu_host_check.sh OUTDIR fa4s8k    # the S8192 rank's wall in four processes (after a warm-up row)
#   bash launch/gpu_host_check.sh OUTDIR fa4confirm # FA4 present: every FA4 GPU test, the S8192 rank's wall in four
#                                                  # processes, the rank against cuDNN's one call at S32768
#   bash launch/gpu_host_check.sh OUTDIR fa4kept   # FA4 present: the block outputs kept, merges bound (ring_kept):
#                                                  # GPU tests, W=8 rank on/off wall both orders, GPU clock, the
#                                                  # fused forward's host profile, the S8192 wall in 3 processes
#   bash launch/gpu_host_check.sh OUTDIR fa4waves  # FA4 present: the launch groups against FA4's backward waves
#                                                  # (1|3|4, 1|2|5, 1|5|2, 1|7 at S32768, wall and GPU; rank 7; S8192)
#   bash launch/gpu_host_check.sh OUTDIR fa4paired # FA4 present: the W=8 rank and the H/W anchor timed in turn
#                                                  # (emulate --paired), wall and GPU, rank 0 and 7, the SM clock
#   bash launch/gpu_host_check.sh OUTDIR fa4ranks  # FA4 present: every rank of the W=8 ring, paired, wall and GPU
#                                                  # (fa4ranks8k: S8192's ranks, GPU clock and two wall processes)
#   bash launch/gpu_host_check.sh OUTDIR fa4fold   # FA4 present: unmasked ring blocks folded into MHA: GPU tests,
#                                                  # bf16 errors, A/B wall and GPU, every rank, a timeline
#                                                  # (fa4fold2: the auto policy, every rank against fold off)
#   bash launch/gpu_host_check.sh OUTDIR fold8k    # FA4 present: S8192's ranks folded (FA4_RING_FOLD=1) and not,
#                                                  # GPU and wall; rank 0's and rank 1's kernels (half8k: only
#                                                  # the half-shard row sets folded, FA4_RING_FOLD=half)
#   bash launch/gpu_host_check.sh OUTDIR dqsweep   # FA4 present: the dQ finish's sweep, host_cost, timelines
#   bash launch/gpu_host_check.sh OUTDIR final8k   # FA4 present: the defaults: GPU test, S8192 wall x4, host_cost
#   bash launch/gpu_host_check.sh OUTDIR origins   # FA4 present: two ranks' timelines, each kernel's op and stream
#                                                  # (origins33: the defaults' slowest ranks, S32768 r6/r4, S8192 r1)
#   bash launch/gpu_host_check.sh OUTDIR fold33    # FA4 present: every unmasked set folded (FA4_RING_FOLD=1) or the
#                                                  # defaults at S32768, every rank wall, a timeline (foldgpu33: the
#                                                  # same A/B on the GPU clock, both orders)
#   bash launch/gpu_host_check.sh OUTDIR foldpre34 # FA4 present: a folded set's fold and preprocess in one pass (GPU
#                                                  # tests, the pass's benchmark; every rank S32768, GPU clock, with
#                                                  # and without, fold auto/1; foldpre34s: ranks 4-6, a short lease)
#   bash launch/gpu_host_check.sh OUTDIR dqearly36 # FA4 present: dQ's other row sets finished and the forward's
#                                                  # earlier blocks merged beside the last kernels, the folded sets'
#                                                  # dQ accumulators zeroed beside step 0 (GPU test; every
#                                                  # rank S32768 wall and GPU clock, S16384, rank 4's kernels)
#   bash launch/gpu_host_check.sh OUTDIR preonce35 # FA4 present: every row set's preprocess in one pass (GPU tests;
#                                                  # every rank S32768 wall and GPU clock with and without; rank 4)
#                                                  # (preonce35s: a short lease's, the pass's test, S32768 wall)
#   bash launch/gpu_host_check.sh OUTDIR defaults35 # FA4 present: the 35th session's defaults against the 34th's
#                                                  # (GPU tests; every rank S32768 and S16384, wall, paired 3)
#   bash launch/gpu_host_check.sh OUTDIR foldpre35w # FA4 present: foldpre34's A/B on the wall clock (every rank S32768
#                                                  # and S16384, paired 3; rank 4's kernels folded, both knobs)
#   bash launch/gpu_host_check.sh OUTDIR sharepre  # FA4 present: A/Bs of the ring backward (GPU test, every rank
#                                                  # S8192 / S32768, a timeline): one preprocess for the unfolded
#                                                  # row sets or one each (dqfused: dQ finished in one Triton
#                                                  # kernel or by FA4's postprocesses; zerobeside: the later sets'
#                                                  # dQ accumulators zeroed on the side stream or not)
#   bash launch/gpu_host_check.sh OUTDIR glue      # FA4 present: a folding ring's glue in Triton against torch's
#                                                  # (tests, the passes, every rank at S32768, a timeline, host)
#                                                  # (glue2: its A/B in a second process, S8192's wall, host)
#   bash launch/gpu_host_check.sh OUTDIR keep      # FA4 present: the later dK/dV scratch kept per ring shape or not
#                                                  # (GPU test, every rank S32768 / S8192 wall, host_cost)
#   bash launch/gpu_host_check.sh OUTDIR fa4adds   # FA4 present: every rank with the dK/dV adds, without (a timing
#                                                  # bound) and by the direct route at S32768, wall, paired; the
#                                                  # adds alone (fa4adds8k: with and without at S8192; fa4direct:
#                                                  # the direct route against the ring's, every rank, S32768, S8192)
#   bash launch/gpu_host_check.sh OUTDIR fa4tail   # FA4 present: every rank at S32768, groups 1|3|4 and 1|5|2, by
#                                                  # the ring's and the direct dK/dV route (wall, paired)
#   bash launch/gpu_host_check.sh OUTDIR ringcheck # no FA4: the ring's kernels (attention, emulate) checked in bf16,
#                                                  # launch keys checked; part triton: then host_cost and the Triton
#                                                  # ring rank (emulate, wall and GPU)
#   bash launch/gpu_host_check.sh OUTDIR verify    # no FA4: the kernel checks (bf16) with the cached launch and in
#                                                  # check mode, host_cost, the Triton ring rank's wall clock
#                                                  # (and with DISTLAB_TRITON_ATTN_SPLIT_SUM=kernel beside it)
# With the FA4 carry, part `kernels` goes with call 1 (carry .fa4-a: mkdir -p /opt/fa4 && tar -xJf
# .fa4-a/ir.tar.xz -C /opt/fa4 && bash launch/gpu_host_check.sh $OUT kernels) and part `timing` with call 2
# (carry .fa4-b: tar -xJf .fa4-b/rest.tar.xz -C /opt/fa4 && bash launch/gpu_host_check.sh $OUT timing).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"   # $out, $py, $status, the multicast variables, pack_logs
export PYTHONPATH=/opt/fa4:/opt/fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
part=${2:-kernels}
run() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS
        timeout "${LIMIT:-200}" "$@" > "$out/$name.log" 2>&1 || { echo "   FAILED or timed out ($name)"; status=1; }
        tail -n ${TAIL:-6} "$out/$name.log"; echo "   ($((SECONDS - t0)) s)"; }
if [ "$part" = kernels ]; then
  LIMIT=420 run triton_tests $py -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_paged_attention.py \
      -p no:cacheprovider
  LIMIT=120 run graph_test $py -m pytest -q -m gpu tests/test_infer.py -k cuda_graph -p no:cacheprovider
  for dt in float32 bfloat16; do
    for mode in eager graph; do
      flag=$([ $mode = graph ] && echo --cuda-graph)
      LIMIT=120 TAIL=4 run "infer_${dt}_$mode" $py -m distlab.infer --config small --steps 64 --check --dtype $dt \
          $flag --json "$out/infer_${dt}_$mode.json"
    done
  done
elif [ "$part" = first ]; then   # no FA4: real-size checks of what changed on the CPU, then the headline clocks;
  # each log straight into OUTDIR (no archive), so a run cut at the device's limit still returns what it wrote
  LIMIT=240 TAIL=12 run checks $py tests/kernel_checks.py attention accumulate merge masked emulate --device cuda \
      --dtype bfloat16 --big
  LIMIT=80 TAIL=20 run host_cost $py -m distlab.kernels.host_cost --rounds 3 --json "$out/host_cost.json"
  LIMIT=90 TAIL=8 run emulate $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton --iters 10 \
      --wall --json "$out/emulate_wall.json"
  LIMIT=150 TAIL=16 run packed $py -m distlab.cp.emulate_packed --world 8 --seq 65536 --layouts zigzag balanced \
      units --backend triton --rate-means --iters 5 --warmup 1 --json "$out/packed_triton.json"
  exit $status
elif [ "$part" = fa4 ]; then   # FA4 present: its GPU tests (bshd and varlen), the W=8 ring rank on FA4 blocks (wall),
  # the packed 64k rank on FA4 blocks, host_cost's FA4 rows; logs straight into OUTDIR as in part first
  LIMIT=180 TAIL=8 run fa4_tests $py -m pytest -q -m gpu tests/test_attention_kernels.py tests/test_fa4_varlen.py \
      -k "fa4 or varlen" -p no:cacheprovider
  LIMIT=120 TAIL=10 run emulate_fa4 $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 triton \
      --iters 10 --wall --json "$out/emulate_fa4_wall.json"
  LIMIT=150 TAIL=10 run packed_fa4 $py -m distlab.cp.emulate_packed --world 8 --seq 65536 --layouts zigzag \
      balanced --backend fa4 --rate-means 2048 512 --iters 5 --warmup 1 --json "$out/packed_fa4.json"
  LIMIT=60 TAIL=20 run host_cost_fa4 $py -m distlab.kernels.host_cost --rounds 2 --json "$out/host_cost_fa4.json"
  exit $status
elif [ "$part" = fa4ring ]; then   # FA4 present: #24's headline, the W=8 zigzag ring rank on FA4 blocks, wall and
  # GPU, against the Triton one; one forward and one backward of the FA4 rank at S32768 kernel by kernel
  # (NO_TIMELINE=1 skips that last run). Host time a ring step first (backward: one BackwardSteps a ring
  # backward, and dQ written final by each row's last block, since 2026-12-05), FA4's rows beside
  LIMIT=80 TAIL=20 run host_cost $py -m distlab.kernels.host_cost --rounds 3 --json "$out/host_cost.json"
  LIMIT=120 TAIL=10 run emulate_fa4 $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 triton \
      --iters 10 --wall --json "$out/emulate_fa4_wall.json"
  LIMIT=120 TAIL=10 run emulate_fa4_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 triton \
      --iters 10 --json "$out/emulate_fa4_gpu.json"
  [ -n "${NO_TIMELINE:-}" ] || LIMIT=90 TAIL=80 run emulate_fa4_timeline $py -m distlab.cp.emulate --world 8 \
      --seq 32768 --backend fa4 --iters 5 --timeline --json "$out/emulate_fa4_timeline.json"
elif [ "$part" = fa4accum ]; then   # FA4 present: the ring backward on FA4's kernels with dQ's and dK/dV's
  # float32 accumulators kept across the steps (distlab.kernels.fa4_ring_backward, 2026-12-05): its GPU test
  # (every rank of a W=4 zigzag and a W=2 contiguous ring vs float32, kept and not), A/B wall, GPU, timeline
  LIMIT=240 TAIL=8 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py \
      tests/test_attention_kernels.py -k fa4 -p no:cacheprovider
  for accum in 1 0; do
    LIMIT=120 TAIL=8 run emulate_fa4_accum$accum env DISTLAB_FA4_RING_ACCUM=$accum $py -m distlab.cp.emulate \
        --world 8 --seq 8192 32768 --backend fa4 --iters 10 --wall --json "$out/emulate_fa4_wall_accum$accum.json"
  done
  LIMIT=120 TAIL=10 run emulate_fa4_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 triton \
      --iters 10 --json "$out/emulate_fa4_gpu.json"
  LIMIT=90 TAIL=50 run emulate_fa4_timeline $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --iters 5 \
      --timeline --json "$out/emulate_fa4_timeline.json"
  LIMIT=80 TAIL=20 run host_cost $py -m distlab.kernels.host_cost --rounds 3 --json "$out/host_cost.json"
elif [ "$part" = fa4why ]; then   # FA4 present: where the FA4 ring rank's time goes (2026-12-05): the backward's
  # kernels with the accumulators kept and not (the main kernels ran ~5% longer kept, H100), the S8192 rank's
  # kernels, host time a ring step at S8192's shapes (1024 tokens a rank, 32 q / 8 kv) with cProfile
  LIMIT=150 TAIL=8 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  for accum in 0 1; do
    LIMIT=90 TAIL=4 run timeline_s32k_accum$accum env DISTLAB_FA4_RING_ACCUM=$accum $py -m distlab.cp.emulate \
        --world 8 --seq 32768 --backend fa4 --iters 5 --timeline --json "$out/timeline_s32k_accum$accum.json"
  done
  LIMIT=90 TAIL=4 run timeline_s8k $py -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 --iters 5 \
      --timeline --json "$out/timeline_s8k.json"
  for pass in fwd bwd; do
    LIMIT=90 TAIL=40 run host_cost_s8k_$pass $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 \
        --rounds 2 --calls 100 --profile "ring step W8, fa4/$pass" --json "$out/host_cost_s8k_$pass.json"
  done
elif [ "$part" = fa4pick ]; then   # FA4 present: the FA4 ring's GPU test (a batch-2 ring too), then the W=8 rank on
  # FA4 blocks against Triton's at three shard lengths, wall (where auto's ring pick should switch)
  LIMIT=150 TAIL=4 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=150 TAIL=12 run emulate_pick $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 --backend fa4 \
      triton --iters 10 --wall --json "$out/emulate_pick_wall.json"
elif [ "$part" = fa4host ]; then   # FA4 present: after the host cuts of 2026-12-05 (the merge's plan per layout,
  # a block plan in the FA4 ring backward): the FA4 ring's GPU test, the merges checked with their launch keys,
  # the W=8 FA4 rank (wall) and its host time a step at S8192's shapes
  LIMIT=100 TAIL=3 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=60 TAIL=3 run merge_check env DISTLAB_TRITON_LAUNCH=check $py tests/kernel_checks.py merge --device cuda \
      --dtype bfloat16 --big
  LIMIT=60 TAIL=6 run emulate_fa4_wall $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 --iters 10 \
      --wall --json "$out/emulate_fa4_wall.json"
  LIMIT=60 TAIL=8 run host_cost_s8k $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 2 \
      --calls 100 --json "$out/host_cost_s8k.json"
elif [ "$part" = fa4fuse ]; then   # FA4 present (2026-12-05): a launch group's blocks fused into one FA4 call,
  # forward and backward (distlab.cp.ring_fused): the FA4 ring's GPU tests (fused groups too), the merges checked
  # with their launch keys, the W=8 rank by groups of 1, 2, 4 (wall, then GPU; cuDNN beside it), host_cost at
  # S8192's shapes, the kernel timeline of the fused rank at S8192
  LIMIT=150 TAIL=3 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=60 TAIL=3 run merge_check env DISTLAB_TRITON_LAUNCH=check $py tests/kernel_checks.py merge --device cuda \
      --dtype bfloat16 --big
  LIMIT=150 TAIL=14 run emulate_fuse_wall $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 --backend fa4 \
      --steps-per-launch 1 2 4 --iters 10 --wall --json "$out/emulate_fuse_wall.json"
  LIMIT=100 TAIL=8 run emulate_cudnn_wall $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend sdpa-cudnn \
      triton --steps-per-launch 1 4 --iters 10 --wall --json "$out/emulate_cudnn_wall.json"
  LIMIT=100 TAIL=8 run emulate_fuse_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 \
      --steps-per-launch 1 4 --iters 10 --json "$out/emulate_fuse_gpu.json"
  LIMIT=60 TAIL=8 run timeline_s8k_fused $py -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 \
      --steps-per-launch 4 --iters 5 --timeline --json "$out/timeline_s8k_fused.json"
  LIMIT=60 TAIL=8 run host_cost_s8k $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 2 \
      --calls 100 --json "$out/host_cost_s8k.json"
elif [ "$part" = fa4fuse2 ]; then   # FA4 present: the fused groups' host time (host_cost's fused rows, the fused
  # backward profiled), then the W=8 FA4 rank by groups of 1 and 4 twice over (wall; the S8192 wall is the host's)
  LIMIT=90 TAIL=12 run host_cost_s8k $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 3 \
      --calls 100 --profile "ring step W8, fa4, 4 steps fused/bwd" --json "$out/host_cost_s8k.json"
  for i in 1 2; do
    LIMIT=120 TAIL=8 run emulate_fuse_wall$i $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 --backend fa4 \
        --steps-per-launch 1 4 --iters 20 --wall --json "$out/emulate_fuse_wall$i.json"
  done
elif [ "$part" = fa4side ]; then   # FA4 present: the fused groups' dK/dV adds on a side stream (ring_fused): the FA4
  # ring's GPU tests, the W=8 rank by groups of 1 and 4 (wall, then GPU), the fused rank's kernel timeline at S32768
  LIMIT=150 TAIL=3 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=150 TAIL=12 run emulate_side_wall $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 --backend fa4 \
      --steps-per-launch 1 4 --iters 20 --wall --json "$out/emulate_side_wall.json"
  LIMIT=100 TAIL=8 run emulate_side_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 \
      --steps-per-launch 1 4 --iters 10 --json "$out/emulate_side_gpu.json"
  LIMIT=60 TAIL=4 run timeline_s32k_fused $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 \
      --steps-per-launch 4 --iters 5 --timeline --json "$out/timeline_s32k_fused.json"
elif [ "$part" = fa4cap ]; then   # FA4 present: the fused blocks' key cap (DISTLAB_RING_FUSE_MAX_KEYS, default 8192)
  # against no cap and one step a launch: the W=8 rank at S16384 and S32768, wall then GPU (n=1 twice: the noise)
  for mode in wall gpu; do
    LIMIT=200 TAIL=14 run emulate_cap_$mode $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 --backend fa4 \
        --steps-per-launch 1 4 --variant '' 'RING_FUSE_MAX_KEYS=0' --iters 20 $([ $mode = wall ] && echo --wall) \
        --json "$out/emulate_cap_$mode.json"
  done
elif [ "$part" = fa4final ]; then   # FA4 present: the fused groups as shipped (fa4 default 4 a group, no key cap, dK
  # and dV in one tensor, adds on a side stream): GPU tests, host_cost (fused backward profiled), the W=8 FA4 rank
  # by groups of 1 and 4 beside the Triton rank (auto's pick at shard 1024), wall then GPU
  LIMIT=150 TAIL=3 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=90 TAIL=40 run host_cost_s8k $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 3 \
      --calls 100 --profile "ring step W8, fa4, 4 steps fused/bwd" --json "$out/host_cost_s8k.json"
  LIMIT=150 TAIL=12 run emulate_final_wall $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 --backend fa4 \
      triton --steps-per-launch 1 4 --iters 20 --wall --json "$out/emulate_final_wall.json"
  LIMIT=120 TAIL=12 run emulate_final_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 --backend fa4 \
      --steps-per-launch 1 4 --iters 20 --json "$out/emulate_final_gpu.json"
elif [ "$part" = fa4final2 ]; then   # FA4 present: part fa4final after the side stream's host cut (plain stream
  # switches, step 0 on the compute stream): GPU tests, host_cost, the W=8 FA4 rank by groups of 1 and 4, wall and GPU
  LIMIT=150 TAIL=3 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=90 TAIL=40 run host_cost_s8k $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 3 \
      --calls 100 --profile "ring step W8, fa4, 4 steps fused/bwd" --json "$out/host_cost_s8k.json"
  for mode in wall gpu; do
    LIMIT=120 TAIL=12 run emulate_final2_$mode $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 --backend fa4 \
        --steps-per-launch 1 4 --iters 20 $([ $mode = wall ] && echo --wall) --json "$out/emulate_final2_$mode.json"
  done
elif [ "$part" = fa4land ]; then   # FA4 present: each step's K/V received straight into the fused blocks' buffers
  # (distlab.cp.ring_landing, 2026-12-05) against the concatenation (RING_KV_LANDING=0): GPU tests, host_cost, the W=8
  # rank by groups of 4 (and 1), landing on and off, wall then GPU; rank 7 (first chunks, spare buffers); timelines
  LIMIT=150 TAIL=3 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=90 TAIL=12 run host_cost_s8k $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 3 \
      --calls 100 --json "$out/host_cost_s8k.json"
  for mode in wall gpu; do
    LIMIT=150 TAIL=16 run emulate_land_$mode $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 --backend fa4 \
        --steps-per-launch 4 1 --variant '' 'RING_KV_LANDING=0' --iters 20 $([ $mode = wall ] && echo --wall) \
        --json "$out/emulate_land_$mode.json"
  done
  LIMIT=90 TAIL=8 run emulate_land_rank7 $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 --rank 7 \
      --steps-per-launch 4 --variant '' 'RING_KV_LANDING=0' --iters 20 --wall --json "$out/emulate_land_rank7.json"
  for seq in 8192 32768; do
    LIMIT=60 TAIL=4 run timeline_s${seq}_land $py -m distlab.cp.emulate --world 8 --seq $seq --backend fa4 \
        --steps-per-launch 4 --iters 5 --timeline --json "$out/timeline_s${seq}_land.json"
  done
elif [ "$part" = fa4land2 ]; then   # FA4 present: part fa4land after the landing's host cuts (slots by one unbind,
  # one spare buffer a group), in order of need (a run cut at the device's limit keeps what came first): GPU tests,
  # the W=8 rank 0 landing on/off in both orders (wall), host_cost (fused rows landing vs concatenated), the dK/dV
  # scratch zeroed ahead or not and the shares added by rows (GPU clock), a smaller last launch group (GPU), rank 0
  # and 7 on/off (GPU), the GPU tests again with the row adds, the emulated rank's kernels at real size (bf16)
  LIMIT=150 TAIL=3 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=120 TAIL=12 run emulate_land_wall_a $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 --backend fa4 \
      --steps-per-launch 4 --variant '' 'RING_KV_LANDING=0' --iters 20 --wall --json "$out/emulate_land_wall_a.json"
  LIMIT=120 TAIL=12 run emulate_land_wall_b $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 --backend fa4 \
      --steps-per-launch 4 --variant 'RING_KV_LANDING=0' '' --iters 20 --wall --json "$out/emulate_land_wall_b.json"
  LIMIT=90 TAIL=14 run host_cost_s8k $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 3 \
      --calls 100 --json "$out/host_cost_s8k.json"
  LIMIT=80 TAIL=8 run emulate_zero_ahead_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 \
      --steps-per-launch 4 --variant '' 'RING_ZERO_AHEAD=1' 'RING_DKV_ADD_ROWS=1' --iters 20 \
      --json "$out/emulate_zero_ahead_gpu.json"
  # the backward's tail is the last group's dK/dV adds: a smaller last group (1,4,3; 1,3,2,2) against 1,3,4
  LIMIT=80 TAIL=8 run emulate_groups_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 \
      --steps-per-launch 4 1,4,3 1,3,2,2 --iters 20 --json "$out/emulate_groups_gpu.json"
  for rank in 0 7; do
    LIMIT=90 TAIL=8 run emulate_land_gpu_rank$rank $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 \
        --backend fa4 --rank $rank --steps-per-launch 4 --variant 'RING_KV_LANDING=0' '' --iters 20 \
        --json "$out/emulate_land_gpu_rank$rank.json"
  done
  LIMIT=80 TAIL=3 run fa4_ring_tests_add_rows env DISTLAB_RING_DKV_ADD_ROWS=1 DISTLAB_RING_ZERO_AHEAD=1 $py -m pytest \
      -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=200 TAIL=3 run emulate_check $py tests/kernel_checks.py emulate --device cuda --dtype bfloat16 --big
elif [ "$part" = fa4keep ]; then   # FA4 present (2026-12-06): the landing buffers kept per ring shape (made once, not
  # every pass: the stubbed W=8 forward's bookkeeping 75 -> 35 µs on the CPU machine), in order of need: GPU tests,
  # the W=8 rank landing on/off wall, host_cost's fused rows, the wall in the other order (~4 min on the H100)
  # (the zero-ahead knob rides along as a third variant: part fa4zero's questions in the same call)
  LIMIT=120 TAIL=3 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=60 TAIL=3 run fa4_ring_tests_zero env DISTLAB_RING_ZERO_AHEAD=1 $py -m pytest -q -m gpu \
      tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=150 TAIL=14 run emulate_keep_wall_a $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 --backend fa4 \
      --steps-per-launch 4 --variant '' 'RING_KV_LANDING=0' 'RING_ZERO_AHEAD=1' --iters 20 --wall \
      --json "$out/emulate_keep_wall_a.json"
  LIMIT=80 TAIL=14 run host_cost_s8k $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 3 \
      --calls 100 --json "$out/host_cost_s8k.json"
  LIMIT=150 TAIL=14 run emulate_keep_wall_b $py -m distlab.cp.emulate --world 8 --seq 8192 16384 32768 --backend fa4 \
      --steps-per-launch 4 --variant 'RING_ZERO_AHEAD=1' 'RING_KV_LANDING=0' '' --iters 20 --wall \
      --json "$out/emulate_keep_wall_b.json"
elif [ "$part" = fa4keepmin ]; then   # part fa4keep cut to its first questions, for a short device budget (~3 min)
  LIMIT=60 TAIL=3 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=100 TAIL=10 run emulate_keep_wall_a $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 \
      --steps-per-launch 4 --variant '' 'RING_KV_LANDING=0' --iters 20 --wall --json "$out/emulate_keep_wall_a.json"
  LIMIT=60 TAIL=14 run host_cost_s8k $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 3 \
      --calls 100 --json "$out/host_cost_s8k.json"
elif [ "$part" = fa4cudnn ]; then   # FA4 present (2026-12-06): the FA4 rank (kept landing buffers) against cuDNN's
  # one H/W call in the same process, both orders (#24's >= 100% of cuDNN at S32768), S8192 beside it
  LIMIT=120 TAIL=12 run emulate_fa4_cudnn_wall $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 \
      sdpa-cudnn --steps-per-launch 4 --iters 20 --wall --json "$out/emulate_fa4_cudnn_wall.json"
  LIMIT=120 TAIL=12 run emulate_cudnn_fa4_wall $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend \
      sdpa-cudnn fa4 --steps-per-launch 4 --iters 20 --wall --json "$out/emulate_cudnn_fa4_wall.json"
elif [ "$part" = fa4s8k ]; then   # FA4 present (2026-12-06): #24's S8192 wall in separate processes, the default
  # timed twice after a warm-up row (the copies), to see how reliably it clears 75% (the wall moves by process)
  for i in 1 2 3 4; do
    LIMIT=60 TAIL=4 run emulate_s8k_wall_$i $py -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 \
        --steps-per-launch 4 --variant 'RING_KV_LANDING=0' '' '' --iters 20 --wall --json "$out/emulate_s8k_wall_$i.json"
  done
elif [ "$part" = fa4kept ]; then   # FA4 present (2026-12-06, 19th session): each fused block's FA4 kernel writes
  # into outputs kept per ring shape and the merges are launches bound once (distlab.cp.ring_kept; the stubbed
  # forward on the CPU: ~134 -> ~101 µs a pass): GPU tests (bits equal to the knob off), on/off wall both orders,
  # the GPU clock, the fused forward's host profile, then the S8192 wall in three more processes
  LIMIT=180 TAIL=3 run fa4_kept_tests $py -m pytest -q -m gpu tests/test_ring_kept.py tests/test_fa4_ring_backward.py \
      -p no:cacheprovider
  LIMIT=120 TAIL=10 run emulate_kept_wall_a $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 \
      --steps-per-launch 4 --variant 'RING_KEEP_OUTPUTS=0' '' 'RING_KEEP_OUTPUTS=0' '' --iters 20 --wall \
      --json "$out/emulate_kept_wall_a.json"
  LIMIT=120 TAIL=10 run emulate_kept_wall_b $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 \
      --steps-per-launch 4 --variant '' 'RING_KEEP_OUTPUTS=0' '' 'RING_KEEP_OUTPUTS=0' --iters 20 --wall \
      --json "$out/emulate_kept_wall_b.json"
  LIMIT=100 TAIL=6 run emulate_kept_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 \
      --steps-per-launch 4 --variant '' 'RING_KEEP_OUTPUTS=0' --iters 20 --json "$out/emulate_kept_gpu.json"
  LIMIT=80 TAIL=40 run host_profile_kept_fwd $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 \
      --rounds 3 --calls 100 --profile "ring step W8, fa4, 4 steps fused/fwd" --json "$out/host_cost_kept.json"
  for i in 1 2 3; do
    LIMIT=60 TAIL=4 run emulate_s8k_wall_$i $py -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 \
        --steps-per-launch 4 --variant 'RING_KEEP_OUTPUTS=0' '' '' --iters 20 --wall --json "$out/emulate_s8k_wall_$i.json"
  done
elif [ "$part" = fa4waves ]; then   # FA4 present (2026-12-06, 20th session): FA4's backward is not persistent (one
  # 128-key tile of one head a CTA, one CTA an SM): rank 0's later blocks at S32768 make 1024 CTAs a step, 7.76
  # waves of 132, so 1|3|4 leaves 0.73 + 0.97 of a wave idle at its two launches' ends and 1|2|5 0.48 + 0.21.
  # The FA4 ring's GPU test first (a W=8 ring by 1|2|5 in it), then the groups timed against each other, wall and
  # GPU clock, rank 7, S8192, and one timeline of 1|2|5
  LIMIT=150 TAIL=3 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=150 TAIL=9 run emulate_waves_wall_a $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 \
      --steps-per-launch 1,3,4 1,2,5 1,5,2 1,7 1,3,4 1,2,5 --iters 20 --wall --json "$out/emulate_waves_wall_a.json"
  LIMIT=120 TAIL=9 run emulate_waves_gpu $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 \
      --steps-per-launch 1,2,5 1,3,4 1,7 1,2,5 1,3,4 --iters 20 --json "$out/emulate_waves_gpu.json"
  LIMIT=100 TAIL=9 run emulate_waves_rank7 $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --rank 7 \
      --steps-per-launch 1,3,4 1,2,5 1,3,4 1,2,5 --iters 20 --wall --json "$out/emulate_waves_rank7.json"
  LIMIT=60 TAIL=8 run emulate_waves_s8k $py -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 \
      --steps-per-launch 1,3,4 1,2,5 1,3,4 1,2,5 --iters 20 --wall --json "$out/emulate_waves_s8k.json"
  LIMIT=90 TAIL=3 run timeline_s32k_125 $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 \
      --steps-per-launch 1,2,5 --iters 5 --timeline --json "$out/timeline_s32k_125.json"
elif [ "$part" = fa4paired ]; then   # FA4 present (2026-12-06, 21st session): the H/W anchor is timed once, first,
  # on a cooler GPU than the ring rank timed after it (the larger 'fused H' call between them reads 6-10% under it,
  # a re-timed anchor 0-4% under it); --paired times the rank and the anchor in turn. The SM clock, power and
  # temperature logged beside it (nvidia-smi, read only)
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
      --format=csv -lms 250 > "$out/smi_clocks.csv" 2>&1 & smi=$!
  for i in a b; do
    LIMIT=150 TAIL=10 run emulate_paired_wall_$i $py -m distlab.cp.emulate --world 8 --seq 32768 8192 --backend fa4 \
        --steps-per-launch 1,3,4 1,3,4 --iters 20 --wall --paired 5 --json "$out/emulate_paired_wall_$i.json"
  done
  LIMIT=120 TAIL=10 run emulate_paired_gpu $py -m distlab.cp.emulate --world 8 --seq 32768 8192 --backend fa4 \
      --steps-per-launch 1,3,4 1,3,4 --iters 20 --paired 5 --json "$out/emulate_paired_gpu.json"
  LIMIT=100 TAIL=8 run emulate_paired_rank7 $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --rank 7 \
      --steps-per-launch 1,3,4 1,3,4 --iters 20 --wall --paired 5 --json "$out/emulate_paired_rank7.json"
  kill $smi 2>/dev/null
elif [ "$part" = fa4ranks ]; then   # FA4 present (2026-12-06, 21st session): a real ring runs at its slowest rank's
  # pace, and zigzag's ranks share the FLOPs but not the block shapes (rank 0's later blocks: 2048 rows x 4096 keys;
  # rank 7's: 4096 x 2048) — every rank of the W=8 ring, paired with the H/W anchor, wall and GPU clock
  LIMIT=360 TAIL=18 run emulate_ranks_wall $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 \
      --rank 0 1 2 3 4 5 6 7 --steps-per-launch 1,3,4 --iters 20 --wall --paired 5 --json "$out/emulate_ranks_wall.json"
  LIMIT=200 TAIL=18 run emulate_ranks_gpu $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 \
      --rank 0 1 2 3 4 5 6 7 --steps-per-launch 1,3,4 --iters 20 --paired 5 --json "$out/emulate_ranks_gpu.json"
  LIMIT=150 TAIL=18 run emulate_ranks_s8k $py -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 \
      --rank 0 1 2 3 4 5 6 7 --steps-per-launch 1,3,4 --iters 20 --wall --paired 5 --json "$out/emulate_ranks_s8k.json"
elif [ "$part" = fa4ranks8k ]; then   # FA4 present: S8192's every rank on the GPU clock, and its wall in two processes
  LIMIT=150 TAIL=18 run emulate_ranks_s8k_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 \
      --rank 0 1 2 3 4 5 6 7 --steps-per-launch 1,3,4 --iters 20 --paired 5 --json "$out/emulate_ranks_s8k_gpu.json"
  for i in a b; do
    LIMIT=150 TAIL=18 run emulate_ranks_s8k_wall_$i $py -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 \
        --rank 0 1 2 3 4 5 6 7 --steps-per-launch 1,3,4 --iters 20 --wall --paired 5 \
        --json "$out/emulate_ranks_s8k_wall_$i.json"
  done
elif [ "$part" = sharepre ] || [ "$part" = dqfused ] || [ "$part" = zerobeside ]; then   # FA4 present (29th
  # session): an A/B of the FA4 ring backward, knob a against b — the FA4 ring GPU test, every rank at S8192 (GPU
  # clock in one process, the wall in two, each variant twice in turn: a host's stalls move between rows), S32768
  # (GPU clock), rank 1's kernels at S8192 with a. sharepre: one preprocess for every unfolded row set (the
  # default) against one a set; dqfused (written, not yet run): dQ finished in one Triton kernel
  # (distlab.kernels.triton_dq_finish) against FA4's postprocesses; zerobeside: the later sets' dQ accumulators
  # zeroed on the side stream against on the compute stream (the default)
  case $part in
    sharepre) a=FA4_RING_SHARE_PRE=1; b=FA4_RING_SHARE_PRE=0 ;;
    dqfused) a=FA4_RING_DQ_FUSED=1; b=FA4_RING_DQ_FUSED=0 ;;
    *) a=FA4_RING_ZERO_BESIDE=1; b=FA4_RING_ZERO_BESIDE=0 ;;
  esac
  ring="$py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4"
  LIMIT=240 TAIL=3 run ${part}_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -k float32_reference \
      -p no:cacheprovider
  LIMIT=200 TAIL=40 run ${part}8k_gpu $ring --seq 8192 --rank 0 1 2 3 4 5 6 7 --iters 20 --paired 3 \
      --variant "$a" "$b" --json "$out/${part}8k_gpu.json"
  for i in a b; do
    LIMIT=200 TAIL=6 run ${part}8k_wall_$i $ring --seq 8192 --rank 0 1 2 3 4 5 6 7 --iters 30 --paired 5 --wall \
        --variant "$a" "$b" "$a" "$b" --json "$out/${part}8k_wall_$i.json"
  done
  LIMIT=200 TAIL=40 run ${part}32k_gpu $ring --seq 32768 --rank 0 1 2 3 4 5 6 7 --iters 10 --paired 2 \
      --variant "$a" "$b" --json "$out/${part}32k_gpu.json"
  LIMIT=120 TAIL=80 run ${part}_timeline8k $ring --seq 8192 --rank 1 --iters 5 --timeline --variant "$a" \
      --json "$out/${part}_timeline8k.json"
elif [ "$part" = dqsweep ]; then   # FA4 present (30th session): the one-kernel dQ finish swept over rows a program
  # and warps against FA4's postprocesses (a zigzag middle rank's three row sets, S8192 and S32768 shards); the
  # host cost rows at S8192's shard (the fused FA4 backward step, #24's 60 µs); rank 1 at S8192 and rank 4 at
  # S32768, kernel by kernel, with the defaults
  LIMIT=150 TAIL=40 run dq_sweep $py -m distlab.kernels.triton_dq_finish --json "$out/dq_sweep.json"
  LIMIT=150 TAIL=30 run host_cost $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 3 \
      --calls 100 --json "$out/host_cost.json"
  LIMIT=120 TAIL=80 run timeline32k $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --rank 4 \
      --steps-per-launch 1,3,4 --iters 5 --timeline --json "$out/timeline32k.json"
elif [ "$part" = glue ]; then   # FA4 present (31st session): a folding ring's glue in Triton (FA4_RING_GLUE and
  # FA4_RING_DKV_FINISH, distlab.kernels.triton_ring_glue) — its GPU tests and the FA4 ring's, the passes against
  # torch's at S32768's shapes, every rank at S32768 with the glue (all; the fold and adds alone) against without (GPU clock),
  # the wall in one process (WALLS="a b": two), rank 4's kernels with it, host_cost's fused backward step profiled
  ring="$py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 --seq 32768"
  LIMIT=300 TAIL=3 run glue_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py \
      -k "float32_reference or glue" -p no:cacheprovider
  LIMIT=60 TAIL=8 run glue_bench $py -m distlab.kernels.triton_ring_glue --json "$out/glue_bench.json"
  LIMIT=240 TAIL=40 run glue32k_gpu $ring --rank 0 1 2 3 4 5 6 7 --iters 10 --paired 2 \
      --variant "FA4_RING_GLUE=1;FA4_RING_DKV_FINISH=1" FA4_RING_GLUE=0 FA4_RING_GLUE=1 --json "$out/glue32k_gpu.json"
  for i in ${WALLS-a}; do   # WALLS="": none
    LIMIT=200 TAIL=6 run glue32k_wall_$i $ring --rank 0 1 2 3 4 5 6 7 --iters 10 --paired 3 --wall \
        --variant "FA4_RING_GLUE=1;FA4_RING_DKV_FINISH=1" FA4_RING_GLUE=0 --json "$out/glue32k_wall_$i.json"
  done
  LIMIT=120 TAIL=60 run glue_timeline $ring --rank 4 --iters 5 --timeline \
      --variant "FA4_RING_GLUE=1;FA4_RING_DKV_FINISH=1" \
      --json "$out/glue_timeline.json"
  LIMIT=150 TAIL=60 run host_cost $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 5 \
      --calls 100 --profile "ring step W8, fa4, 4 steps fused/bwd" --json "$out/host_cost.json"
elif [ "$part" = keep ]; then   # FA4 present (32nd session): the later blocks' dK/dV scratch kept per ring shape
  # (FA4_RING_KEEP_SCRATCH, one fill with the later row sets' dQ accumulators) — the FA4 ring's GPU test, every rank
  # at S32768 (wall, paired: defaults, scratch a block, the fill beside step 0), S8192 in two processes (both
  # orders), host_cost (its fused backward step with and without, interleaved)
  ring="$py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4"
  LIMIT=240 TAIL=3 run keep_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -k float32_reference \
      -p no:cacheprovider
  LIMIT=200 TAIL=5 run keep32k_wall $ring --seq 32768 --rank 0 1 2 3 4 5 6 7 --iters 10 --paired 3 --wall \
      --variant FA4_RING_KEEP_SCRATCH=1 FA4_RING_KEEP_SCRATCH=0 FA4_RING_ZERO_BESIDE=1 --json "$out/keep32k_wall.json"
  LIMIT=80 TAIL=4 run keep8k_wall_a $ring --seq 8192 --rank 0 1 2 3 4 5 6 7 --iters 30 --paired 5 --wall \
      --variant FA4_RING_KEEP_SCRATCH=1 FA4_RING_KEEP_SCRATCH=0 --json "$out/keep8k_wall_a.json"
  LIMIT=80 TAIL=4 run keep8k_wall_b $ring --seq 8192 --rank 0 1 2 3 4 5 6 7 --iters 30 --paired 5 --wall \
      --variant FA4_RING_KEEP_SCRATCH=0 FA4_RING_KEEP_SCRATCH=1 --json "$out/keep8k_wall_b.json"
  LIMIT=120 TAIL=40 run host_cost $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 5 \
      --calls 100 --json "$out/host_cost.json"
elif [ "$part" = fold8k2 ]; then   # FA4 present (32nd session): S8192's every rank with the half-shard row sets
  # folded (FA4_RING_FOLD=half) and every unmasked set (1) against the defaults (auto: none at S8192), now that a
  # fold is one Triton launch (triton_ring_glue) — GPU clock, then wall in two processes (both orders), paired
  ring="$py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 --seq 8192 --rank 0 1 2 3 4 5 6 7"
  LIMIT=150 TAIL=4 run fold8k2_gpu $ring --iters 20 --paired 3 --variant "" FA4_RING_FOLD=half FA4_RING_FOLD=1 \
      --json "$out/fold8k2_gpu.json"
  LIMIT=100 TAIL=4 run fold8k2_wall_a $ring --iters 30 --paired 5 --wall --variant "" FA4_RING_FOLD=half \
      FA4_RING_FOLD=1 --json "$out/fold8k2_wall_a.json"
  LIMIT=100 TAIL=4 run fold8k2_wall_b $ring --iters 30 --paired 5 --wall --variant FA4_RING_FOLD=1 \
      FA4_RING_FOLD=half "" --json "$out/fold8k2_wall_b.json"
elif [ "$part" = half8k2 ]; then   # FA4 present (32nd session): after the host cuts of a folding ring (the add's
  # layouts kept, the folded blocks' outputs and the folded sets' buffers kept per ring shape) — the FA4 ring's GPU
  # test, host_cost (its half-folded fused step beside the default), S8192's every rank wall, half folded or not,
  # in two processes (both orders); S16384's every rank on the GPU clock, half folded or not
  ring="$py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 --seq 8192 --rank 0 1 2 3 4 5 6 7"
  LIMIT=240 TAIL=3 run half_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -k float32_reference \
      -p no:cacheprovider
  LIMIT=120 TAIL=40 run host_cost $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 5 \
      --calls 100 --profile "ring step W8, fa4, 4 steps fused, half folded/bwd" --json "$out/host_cost.json"
  LIMIT=100 TAIL=4 run half8k2_wall_a $ring --iters 30 --paired 5 --wall --variant "" FA4_RING_FOLD=half \
      --json "$out/half8k2_wall_a.json"
  LIMIT=100 TAIL=4 run half8k2_wall_b $ring --iters 30 --paired 5 --wall --variant FA4_RING_FOLD=half "" \
      --json "$out/half8k2_wall_b.json"
  LIMIT=120 TAIL=4 run half16k_gpu $py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 \
      --seq 16384 --rank 0 1 2 3 4 5 6 7 --iters 10 --paired 2 --variant "" FA4_RING_FOLD=half \
      --json "$out/half16k_gpu.json"
elif [ "$part" = final32 ]; then   # FA4 present (32nd session): the defaults once more, no variant — S8192's every
  # rank in two wall processes, S32768's every rank in one (wall, paired 3)
  ring="$py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 --rank 0 1 2 3 4 5 6 7 --wall"
  for i in 1 2; do
    LIMIT=60 TAIL=3 run final8k_wall_$i $ring --seq 8192 --iters 30 --paired 5 --json "$out/final8k_wall_$i.json"
  done
  LIMIT=80 TAIL=3 run final32k_wall $ring --seq 32768 --iters 10 --paired 3 --json "$out/final32k_wall.json"
elif [ "$part" = glue2 ]; then   # FA4 present (31st session): the glue's A/B in a second process, the other order
  # (S32768 every rank, wall, paired), then the defaults' S8192 every rank in two wall processes, host_cost
  LIMIT=100 TAIL=4 run glue32k_wall_b $py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 \
      --seq 32768 --rank 0 1 2 3 4 5 6 7 --iters 10 --paired 3 --wall \
      --variant FA4_RING_GLUE=0 "FA4_RING_GLUE=1;FA4_RING_DKV_FINISH=1" --json "$out/glue32k_wall_b.json"
  for i in 1 2; do
    LIMIT=60 TAIL=3 run defaults8k_wall_$i $py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 \
        --seq 8192 --rank 0 1 2 3 4 5 6 7 --iters 30 --paired 5 --wall --json "$out/defaults8k_wall_$i.json"
  done
  LIMIT=80 TAIL=30 run host_cost $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 5 \
      --calls 100 --json "$out/host_cost.json"
elif [ "$part" = final8k ]; then   # FA4 present (30th session): the defaults once more — the GPU test, S8192's
  # every rank in four wall processes (no variant: the host's stalls fall where they fall), host_cost at its shard
  LIMIT=240 TAIL=3 run final_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -k float32_reference \
      -p no:cacheprovider
  for i in 1 2 3 4; do
    LIMIT=100 TAIL=3 run final8k_wall_$i $py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 \
        --seq 8192 --rank 0 1 2 3 4 5 6 7 --iters 30 --paired 5 --wall --json "$out/final8k_wall_$i.json"
  done
  LIMIT=150 TAIL=30 run host_cost $py -m distlab.kernels.host_cost --seq 1024 --heads 32 --kv-heads 8 --rounds 5 \
      --calls 100 --json "$out/host_cost.json"
elif [ "$part" = fold33 ]; then   # FA4 present (33rd session): every unmasked row set folded (FA4_RING_FOLD=1: the
  # whole-shard ones too, now that a fold is one Triton launch and a folding ring's buffers are kept) against the
  # defaults — every rank at S32768 (wall, paired 3), rank 6's kernels folded (the run of 2026-12-07 had a third
  # variant with two knobs removed since: commit eb682bc)
  ring="$py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 --rank 0 1 2 3 4 5 6 7"
  LIMIT=240 TAIL=5 run fold32k_wall $ring --seq 32768 --iters 10 --paired 3 --wall \
      --variant "FA4_RING_FOLD=1" "" --json "$out/fold32k_wall.json"
  LIMIT=60 TAIL=45 run timeline_s32768_r6_fold1 env DISTLAB_FA4_RING_FOLD=1 $py -m distlab.cp.emulate --world 8 \
      --seq 32768 --backend fa4 --rank 6 --steps-per-launch 1,3,4 --iters 5 --timeline \
      --json "$out/timeline_s32768_r6_fold1.json"
elif [ "$part" = foldgpu33 ]; then   # FA4 present (33rd session): fold33's A/B on the GPU clock (graph replay, paired
  # 2: no host in it), every rank at S32768, both orders — not yet run (the session's device time was spent)
  ring="$py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 --rank 0 1 2 3 4 5 6 7"
  LIMIT=150 TAIL=5 run fold32k_gpu_a $ring --seq 32768 --iters 10 --paired 2 --variant "" FA4_RING_FOLD=1 \
      --json "$out/fold32k_gpu_a.json"
  LIMIT=150 TAIL=5 run fold32k_gpu_b $ring --seq 32768 --iters 10 --paired 2 --variant FA4_RING_FOLD=1 "" \
      --json "$out/fold32k_gpu_b.json"
elif [ "$part" = foldpre34s ]; then   # foldpre34 for a short lease: the kernel's test, then ranks 4-6 (the slowest at
  # S32768 in the 32nd-33rd sessions) with and without, GPU clock
  LIMIT=70 TAIL=5 run foldpre_kernel_test $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py \
      -p no:cacheprovider -k fold_pre_kernel
  LIMIT=60 TAIL=6 run foldpre_bench $py -m distlab.kernels.triton_fold_preprocess --json "$out/foldpre_bench.json"
  LIMIT=120 TAIL=5 run foldpre32k_gpu_r456 $py -m distlab.cp.emulate --world 8 --backend fa4 \
      --steps-per-launch 1,3,4 --rank 4 5 6 --seq 32768 --iters 10 --paired 2 \
      --variant "" FA4_RING_FOLD_PRE=1 --json "$out/foldpre32k_gpu_r456.json"
elif [ "${part#dqearly36}" != "$part" ]; then   # FA4 present (36th session): dQ of the other row sets finished
  # beside the last row set's kernels (FA4_RING_DQ_EARLY=1), the forward's earlier blocks merged beside its last
  # one (RING_MERGE_EARLY=1), the folded sets' dQ accumulators zeroed beside step 0 (FA4_RING_ZERO_BESIDE=1) —
  # dqearly36a: their GPU test, every rank at S32768 wall (paired 3: all three, none, the two early ones);
  # dqearly36b: rank 4's kernels with all three, the GPU clock (paired 2), S16384 wall; dqearly36: both halves;
  # dqearly36c: the GPU test, rank 4's kernels, S32768 wall and GPU clock, all three against none
  ring="$py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 --rank 0 1 2 3 4 5 6 7"
  both="FA4_RING_DQ_EARLY=1;RING_MERGE_EARLY=1"
  all3="$both;FA4_RING_ZERO_BESIDE=1"
  if [ "$part" = dqearly36c ]; then   # after the early merge's launch moved behind the last block: test, rank 4's
    # kernels, every rank S32768 wall (paired 3) and GPU clock (paired 2), all three against none
    LIMIT=${TESTS_LIMIT:-150} TAIL=3 run early_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py \
        -p no:cacheprovider -k "dq_early"
    LIMIT=60 TAIL=24 run timeline_s32768_r4_early env DISTLAB_FA4_RING_DQ_EARLY=1 DISTLAB_RING_MERGE_EARLY=1 \
        DISTLAB_FA4_RING_ZERO_BESIDE=1 $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --rank 4 \
        --steps-per-launch 1,3,4 --iters 5 --timeline --json "$out/timeline_s32768_r4_early.json"
    LIMIT=120 TAIL=3 run early32k_wall $ring --seq 32768 --iters 10 --paired 3 --wall \
        --variant "" "$all3" --json "$out/early32k_wall.json"
    LIMIT=100 TAIL=3 run early32k_gpu $ring --seq 32768 --iters 10 --paired 2 \
        --variant "$all3" "" --json "$out/early32k_gpu.json"
    part=done
  fi
  if [ "$part" != dqearly36b ] && [ "$part" != done ]; then
    LIMIT=${TESTS_LIMIT:-240} TAIL=5 run early_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py \
        -p no:cacheprovider -k "dq_early"
    LIMIT=240 TAIL=5 run early32k_wall $ring --seq 32768 --iters 10 --paired 3 --wall \
        --variant "$all3" "" "$both" --json "$out/early32k_wall.json"
  fi
  if [ "$part" != dqearly36a ] && [ "$part" != done ]; then
    LIMIT=60 TAIL=45 run timeline_s32768_r4_early env DISTLAB_FA4_RING_DQ_EARLY=1 DISTLAB_RING_MERGE_EARLY=1 \
        DISTLAB_FA4_RING_ZERO_BESIDE=1 $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --rank 4 \
        --steps-per-launch 1,3,4 --iters 5 --timeline --json "$out/timeline_s32768_r4_early.json"
    LIMIT=150 TAIL=5 run early32k_gpu $ring --seq 32768 --iters 10 --paired 2 \
        --variant "" "$all3" "$both" --json "$out/early32k_gpu.json"
    LIMIT=120 TAIL=5 run early16k_wall $ring --seq 16384 --iters 10 --paired 3 --wall \
        --variant "$all3" "" --json "$out/early16k_wall.json"
  fi
elif [ "$part" = preonce35s ]; then   # preonce35 for a short lease: the pass's GPU test, every rank at S32768 wall
  # (paired 2) with and without, then the rings' test
  LIMIT=60 TAIL=5 run preonce_kernel_test $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py \
      -p no:cacheprovider -k preprocess_sets
  LIMIT=100 TAIL=5 run preonce32k_wall $py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 \
      --rank 0 1 2 3 4 5 6 7 --seq 32768 --iters 8 --paired 2 --wall --variant FA4_RING_PRE_ONCE=1 "" \
      --json "$out/preonce32k_wall.json"
  LIMIT=100 TAIL=5 run preonce_ring_test $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py \
      -p no:cacheprovider -k "fold_pre and float32_reference"
elif [ "$part" = preonce35 ]; then   # FA4 present (35th session): every row set's preprocess in one Triton pass
  # (FA4_RING_PRE_ONCE=1) — its GPU tests, every rank at S32768 wall (paired 3) and GPU clock (paired 2) against
  # the defaults, rank 4's kernels with it
  ring="$py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 --rank 0 1 2 3 4 5 6 7"
  LIMIT=${TESTS_LIMIT:-150} TAIL=5 run preonce_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py \
      -p no:cacheprovider -k "fold_pre or preprocess_sets"
  LIMIT=150 TAIL=5 run preonce32k_wall $ring --seq 32768 --iters 10 --paired 3 --wall \
      --variant FA4_RING_PRE_ONCE=1 "" --json "$out/preonce32k_wall.json"
  LIMIT=120 TAIL=5 run preonce32k_gpu $ring --seq 32768 --iters 10 --paired 2 \
      --variant "" FA4_RING_PRE_ONCE=1 --json "$out/preonce32k_gpu.json"
  LIMIT=60 TAIL=45 run timeline_s32768_r4_preonce env DISTLAB_FA4_RING_PRE_ONCE=1 $py -m distlab.cp.emulate \
      --world 8 --seq 32768 --backend fa4 --rank 4 --steps-per-launch 1,3,4 --iters 5 --timeline \
      --json "$out/timeline_s32768_r4_preonce.json"
elif [ "$part" = defaults35 ]; then   # FA4 present (35th session): the new defaults (auto folds every unmasked set of
  # a 4096-row shard, the folded sets' fold and preprocess one pass) against the 34th session's (FA4_RING_FOLD=half:
  # auto's old rule at these shards; FA4_RING_FOLD_PRE=0) — their GPU tests, every rank at S32768 and S16384, wall
  ring="$py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 --rank 0 1 2 3 4 5 6 7"
  LIMIT=150 TAIL=4 run gpu_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py tests/test_ring.py \
      tests/test_ring_kept.py tests/test_ring_landing.py -p no:cacheprovider
  for s in 32768 16384; do
    LIMIT=150 TAIL=5 run defaults35_s${s}_wall $ring --seq $s --iters 10 --paired 3 --wall \
        --variant "" "FA4_RING_FOLD=half;FA4_RING_FOLD_PRE=0" --json "$out/defaults35_s${s}_wall.json"
  done
elif [ "$part" = foldpre35w ]; then   # FA4 present (35th session): foldpre34's A/B on the wall clock — every rank at
  # S32768 (paired 3): every unmasked set folded with the one-pass fold, the defaults, the pass alone; S16384 (auto
  # folds its half sets) with and without the pass; rank 4's kernels with both knobs
  ring="$py -m distlab.cp.emulate --world 8 --backend fa4 --steps-per-launch 1,3,4 --rank 0 1 2 3 4 5 6 7"
  LIMIT=300 TAIL=5 run foldpre32k_wall $ring --seq 32768 --iters 10 --paired 3 --wall \
      --variant "FA4_RING_FOLD=1;FA4_RING_FOLD_PRE=1" "" FA4_RING_FOLD_PRE=1 --json "$out/foldpre32k_wall.json"
  LIMIT=150 TAIL=5 run foldpre16k_wall $ring --seq 16384 --iters 10 --paired 3 --wall \
      --variant FA4_RING_FOLD_PRE=1 "" --json "$out/foldpre16k_wall.json"
  LIMIT=60 TAIL=45 run timeline_s32768_r4_foldpre env DISTLAB_FA4_RING_FOLD=1 DISTLAB_FA4_RING_FOLD_PRE=1 \
      $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 --rank 4 --steps-per-launch 1,3,4 --iters 5 \
      --timeline --json "$out/timeline_s32768_r4_foldpre.json"
elif [ "$part" = foldpre34 ]; then   # FA4 present (34th session): a folded row set's fold and FA4's preprocess in one
  # Triton pass (FA4_RING_FOLD_PRE=1) — its GPU tests, then every rank at S32768 on the GPU clock (paired 2): the
  # defaults (half sets folded), with it, and every unmasked set folded with it (fold33's A/B)
  # (the kernel's test first, the timing, then the rings' test: a short lease still gets the first two)
  LIMIT=${TESTS_LIMIT:-90} TAIL=5 run foldpre_kernel_test $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py \
      -p no:cacheprovider -k fold_pre_kernel
  LIMIT=60 TAIL=6 run foldpre_bench $py -m distlab.kernels.triton_fold_preprocess --json "$out/foldpre_bench.json"
  LIMIT=${EMULATE_LIMIT:-240} TAIL=5 run foldpre32k_gpu $py -m distlab.cp.emulate --world 8 --backend fa4 \
      --steps-per-launch 1,3,4 --rank 0 1 2 3 4 5 6 7 --seq 32768 --iters 10 --paired 2 \
      --variant "" FA4_RING_FOLD_PRE=1 "FA4_RING_FOLD=1;FA4_RING_FOLD_PRE=1" --json "$out/foldpre32k_gpu.json"
  LIMIT=${TESTS_LIMIT:-200} TAIL=5 run foldpre_ring_test $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py \
      -p no:cacheprovider -k "fold_pre and float32_reference"
elif [ "$part" = origins ] || [ "$part" = origins33 ]; then   # FA4 present (30th session): rank 1 at S8192 and
  # rank 4 at S32768 kernel by kernel, each kernel with its stream and the op that launched it
  # (kernel_timeline(origins=True)); origins33: the slowest ranks of the 32nd session's defaults, S32768 6 and 4
  shapes=("8192 1" "32768 4")
  [ "$part" = origins33 ] && shapes=("32768 6" "32768 4" "8192 1")
  for r in "${shapes[@]}"; do set -- $r
    LIMIT=120 TAIL=90 run timeline_s$1_r$2 $py -m distlab.cp.emulate --world 8 --seq $1 --backend fa4 --rank $2 \
        --steps-per-launch 1,3,4 --iters 5 --timeline --json "$out/timeline_s$1_r$2.json"
  done
elif [ "$part" = fold8k ] || [ "$part" = half8k ]; then   # FA4 present (28th session): S8192's every rank with
  # its unmasked blocks folded against not, GPU clock and wall, paired — fold8k: every unmasked set
  # (FA4_RING_FOLD=1), then rank 0's and rank 1's kernels (timeline); half8k: the half-shard sets only
  # (FA4_RING_FOLD=half, auto's rule at S8192's shards)
  fold=$([ "$part" = half8k ] && echo half || echo 1)
  for clock in gpu wall; do
    LIMIT=200 TAIL=40 run ${part}_$clock $py -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 \
        --rank 0 1 2 3 4 5 6 7 --steps-per-launch 1,3,4 --iters 20 --paired 3 --variant "" "FA4_RING_FOLD=$fold" \
        $([ $clock = wall ] && echo --wall) --json "$out/${part}_$clock.json"
  done
  [ "$part" = half8k ] || LIMIT=120 TAIL=120 run timeline8k $py -m distlab.cp.emulate --world 8 --seq 8192 \
      --backend fa4 --rank 0 1 --steps-per-launch 1,3,4 --iters 5 --timeline --json "$out/timeline8k.json"
elif [ "$part" = fa4fold ]; then   # FA4 present (2026-12-06, 21st session): the ring backward's unmasked blocks with
  # each kv head's q heads folded into rows (MHA over the kv heads: DISTLAB_FA4_RING_FOLD, on by default) — the
  # FA4 GPU tests, the bf16 error of every rank folded and not, the A/B (wall, paired), every rank, a timeline
  LIMIT=240 TAIL=3 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py tests/test_ring_kept.py \
      -p no:cacheprovider
  LIMIT=120 TAIL=12 run fold_errors $py -c "
import sys; sys.path.insert(0, 'tests')
from distlab import knobs
from test_fa4_ring_backward import _ring_rank_on_fa4
for fold in ('1', '0'):
    with knobs.override(FA4_RING_FOLD=fold):
        errs = _ring_rank_on_fa4(2048, 8, 8, 2, 'zigzag', 1, (1, 3, 4))
    print('fold', fold, 'max rel err over ranks (out, dq, dk, dv):', [f'{max(e[i] for e in errs):.2e}' for i in range(4)])
"
  LIMIT=150 TAIL=10 run emulate_fold_wall $py -m distlab.cp.emulate --world 8 --seq 32768 8192 --backend fa4 \
      --steps-per-launch 1,3,4 --variant '' 'FA4_RING_FOLD=0' '' 'FA4_RING_FOLD=0' --iters 20 --wall --paired 5 \
      --json "$out/emulate_fold_wall.json"
  LIMIT=150 TAIL=10 run emulate_fold_gpu $py -m distlab.cp.emulate --world 8 --seq 32768 8192 --backend fa4 \
      --steps-per-launch 1,3,4 --variant '' 'FA4_RING_FOLD=0' --iters 20 --paired 5 --json "$out/emulate_fold_gpu.json"
  LIMIT=240 TAIL=20 run emulate_fold_ranks $py -m distlab.cp.emulate --world 8 --seq 32768 8192 --backend fa4 \
      --rank all --steps-per-launch 1,3,4 --iters 20 --wall --paired 5 --json "$out/emulate_fold_ranks.json"
  LIMIT=90 TAIL=3 run timeline_s32k_fold $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 \
      --steps-per-launch 1,3,4 --iters 5 --timeline --json "$out/timeline_s32k_fold.json"
elif [ "$part" = fa4fold2 ]; then   # FA4 present: FA4_RING_FOLD=auto (folded where the shard has >= 2048 rows, its row
  # sets of <= 2048 rows): GPU tests, bf16 errors of a ring mixing folded and GQA blocks (limits scaled down to a
  # 4096-token W=8 ring), every rank at S32768 auto against 0 (wall, paired)
  LIMIT=240 TAIL=3 run fa4_ring_tests $py -m pytest -q -m gpu tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=120 TAIL=12 run fold_errors $py -c "
import sys; sys.path.insert(0, 'tests')
from distlab import knobs
from distlab.kernels import fa4_ring_backward as frb
from test_fa4_ring_backward import _ring_rank_on_fa4
frb.FOLD_MIN_SHARD, frb.FOLD_MAX_ROWS = 512, 256   # a 4096-token W=8 zigzag ring: the half-shard sets fold
for fold in ('auto', '1', '0'):
    with knobs.override(FA4_RING_FOLD=fold):
        errs = _ring_rank_on_fa4(4096, 8, 8, 2, 'zigzag', 1, (1, 3, 4))
    print('fold', fold, 'max rel err over ranks (out, dq, dk, dv):', [f'{max(e[i] for e in errs):.2e}' for i in range(4)])
    assert max(max(e) for e in errs) < 2e-2
"
  LIMIT=300 TAIL=24 run emulate_fold2_ranks $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 \
      --rank all --steps-per-launch 1,3,4 --variant '' 'FA4_RING_FOLD=0' --iters 20 --wall --paired 5 \
      --json "$out/emulate_fold2_ranks.json"
elif [ "$part" = fa4adds ]; then   # FA4 present (2026-12-06, 22nd session): what the ring backward's dK/dV adds cost
  # each rank — every rank with them and without (RING_DKV_ADDS=0: a timing bound, dK/dV wrong), S32768 and
  # S8192, wall, paired; the adds and an owner's one sum of 8 bf16 partials alone
  LIMIT=60 TAIL=4 run dkv_add_probe $py launch/dkv_add_probe.py --json "$out/dkv_add.json"
  LIMIT=420 TAIL=36 run emulate_adds_ranks $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 \
      --rank all --steps-per-launch 1,3,4 --variant '' 'RING_DKV_ADDS=0' 'RING_DKV_ROUTE=direct' --iters 20 --wall \
      --paired 3 --json "$out/emulate_adds_ranks.json"
elif [ "$part" = fa4direct ]; then   # FA4 present (22nd session): the direct dK/dV route (ring_dkv_direct) against the
  # ring's — every rank at S32768 (wall, paired) and at S8192 on the GPU clock (a stalling host hides it in wall)
  LIMIT=200 TAIL=8 run emulate_direct_ranks $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 \
      --rank all --steps-per-launch 1,3,4 --variant '' 'RING_DKV_ROUTE=direct' --iters 20 --wall --paired 3 \
      --json "$out/emulate_direct_ranks.json"
  LIMIT=150 TAIL=8 run emulate_direct_ranks_s8k_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 \
      --rank all --steps-per-launch 1,3,4 --variant '' 'RING_DKV_ROUTE=direct' --iters 20 --paired 3 \
      --json "$out/emulate_direct_ranks_s8k_gpu.json"
elif [ "$part" = fa4tail ]; then   # FA4 present (23rd session): the groupings and routes that the planner says
  # shorten a real ring's tail (python -m distlab.plan.ring_tail) — does their compute match the default's on every
  # rank? S32768, launch groups 1|3|4 and 1|5|2, by the ring's and the direct route, wall, paired
  LIMIT=400 TAIL=10 run emulate_tail_ranks $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 \
      --rank all --steps-per-launch 1,3,4 1,5,2 --variant '' 'RING_DKV_ROUTE=direct' --iters 20 --wall --paired 2 \
      --json "$out/emulate_tail_ranks.json"
elif [ "$part" = fa4adds8k ]; then   # the same at S8192 (not folded there: no direct route)
  LIMIT=150 TAIL=24 run emulate_adds_ranks_s8k $py -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 \
      --rank all --steps-per-launch 1,3,4 --variant '' 'RING_DKV_ADDS=0' --iters 20 --wall --paired 3 \
      --json "$out/emulate_adds_ranks_s8k.json"
elif [ "$part" = fa4confirm ]; then   # FA4 present (2026-12-06, 19th session): the kept outputs on another lease —
  # every FA4 GPU test, #24's S8192 wall in four fresh processes (a warm-up row, then the default twice), and the
  # rank against cuDNN's one call at S32768 (#24's >= 100%)
  LIMIT=240 TAIL=3 run fa4_gpu_tests $py -m pytest -q -m gpu tests/test_ring_kept.py tests/test_fa4_ring_backward.py \
      tests/test_fa4_varlen.py tests/test_attention_kernels.py -k "fa4 or kept or varlen" -p no:cacheprovider
  for i in 1 2 3 4; do
    LIMIT=60 TAIL=4 run emulate_s8k_wall_$i $py -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 \
        --steps-per-launch 4 --variant 'RING_KEEP_OUTPUTS=0' '' '' --iters 20 --wall --json "$out/emulate_s8k_wall_$i.json"
  done
  LIMIT=120 TAIL=8 run emulate_fa4_cudnn_wall $py -m distlab.cp.emulate --world 8 --seq 32768 --backend fa4 \
      sdpa-cudnn --steps-per-launch 4 --iters 20 --wall --json "$out/emulate_fa4_cudnn_wall.json"
elif [ "$part" = fa4zero ]; then   # FA4 present: the dK/dV scratch zeroed ahead on the side stream (forked from the
  # compute stream since its first GPU run failed in a graph's capture): GPU tests with it, GPU clock, wall
  LIMIT=60 TAIL=3 run fa4_ring_tests_zero env DISTLAB_RING_ZERO_AHEAD=1 $py -m pytest -q -m gpu \
      tests/test_fa4_ring_backward.py -p no:cacheprovider
  LIMIT=70 TAIL=8 run emulate_zero_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 \
      --steps-per-launch 4 --variant '' 'RING_ZERO_AHEAD=1' --iters 20 --json "$out/emulate_zero_gpu.json"
  LIMIT=70 TAIL=8 run emulate_zero_wall $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 \
      --steps-per-launch 4 --variant '' 'RING_ZERO_AHEAD=1' --iters 20 --wall --json "$out/emulate_zero_wall.json"
elif [ "$part" = fa4wall ]; then   # FA4 present: why the fused rank's S8192 wall reads slower than its host time and GPU
  # clock say: groups of 4 before 1 (order), and with the dK/dV adds on the compute stream (no side stream)
  LIMIT=60 TAIL=6 run emulate_s8k_wall $py -m distlab.cp.emulate --world 8 --seq 8192 --backend fa4 \
      --steps-per-launch 4 1 --variant '' 'RING_DKV_SIDE_STREAM=0' --iters 20 --wall --json "$out/emulate_s8k_wall.json"
elif [ "$part" = ringcheck ] || [ "$part" = triton ]; then   # no FA4 needed: the ring's Triton kernels at real
  # sizes in bf16 against the float64 reference (the emulated ring rank's dQ written final by each row's last
  # block, 2026-12-05), every launch also through Triton's own path with the cached launch's key checked
  # (DISTLAB_TRITON_LAUNCH=check); part triton then times the host cost and the Triton ring rank, wall and GPU
  LIMIT=200 run checks_check env DISTLAB_TRITON_LAUNCH=check $py tests/kernel_checks.py attention emulate \
      --device cuda --dtype bfloat16 --big
  if [ "$part" = triton ]; then
    LIMIT=80 TAIL=20 run host_cost $py -m distlab.kernels.host_cost --rounds 3 --json "$out/host_cost.json"
    LIMIT=90 TAIL=8 run emulate $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton --iters 10 \
        --wall --json "$out/emulate_wall.json"
    LIMIT=90 TAIL=8 run emulate_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton \
        --iters 10 --json "$out/emulate_gpu.json"
    # A/B: the backward's dQ converted after the ring (the path before 2026-12-05) against the final dQ from
    # each row's last block (the default)
    LIMIT=90 TAIL=8 run emulate_dq_final_off env DISTLAB_RING_DQ_FINAL=0 $py -m distlab.cp.emulate --world 8 \
        --seq 8192 32768 --backend triton --iters 10 --wall --json "$out/emulate_wall_dq_final_off.json"
  fi
elif [ "$part" = verify ]; then
  LIMIT=270 run checks_cached $py tests/kernel_checks.py attention accumulate merge emulate --device cuda \
      --dtype bfloat16 --big
  LIMIT=150 run checks_check env DISTLAB_TRITON_LAUNCH=check $py tests/kernel_checks.py attention accumulate \
      masked --device cuda --dtype bfloat16 --big
  LIMIT=80 TAIL=20 run host_cost $py -m distlab.kernels.host_cost --rounds 3 --json "$out/host_cost.json"
  LIMIT=90 TAIL=8 run emulate $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend triton --iters 10 \
      --wall --json "$out/emulate_wall.json"
  # A/B of a later backward step's dK/dV added by the dQ kernel (default) against two add_ after it
  LIMIT=60 TAIL=6 run emulate_sum_kernel env DISTLAB_TRITON_ATTN_SPLIT_SUM=kernel $py -m distlab.cp.emulate --world 8 \
      --seq 32768 --backend triton --iters 10 --wall --json "$out/emulate_wall_sum_kernel.json"
  LIMIT=40 TAIL=4 run infer_bfloat16_eager $py -m distlab.infer --config small --steps 64 --dtype bfloat16 \
      --json "$out/infer_bfloat16_eager.json"
else
  $py -c 'import flash_attn.cute.interface' > "$out/fa4_import.log" 2>&1 || { cat "$out/fa4_import.log"; echo "FA4 is not importable"; }
  LIMIT=200 run fa4_tests $py -m pytest -q -m gpu tests/test_attention_kernels.py -k fa4 -p no:cacheprovider
  LIMIT=120 TAIL=20 run host_cost $py -m distlab.kernels.host_cost --json "$out/host_cost.json"
  LIMIT=120 TAIL=20 run host_cost_8k $py -m distlab.kernels.host_cost --seq 1024 --heads 4 --kv-heads 1 \
      --ring-world 8 --rounds 3 --json "$out/host_cost_ring8k.json"
  LIMIT=150 TAIL=14 run emulate $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 sdpa-cudnn triton \
      --iters 10 --wall --json "$out/emulate_wall.json"
  LIMIT=150 TAIL=14 run emulate_gpu $py -m distlab.cp.emulate --world 8 --seq 8192 32768 --backend fa4 triton \
      --iters 10 --json "$out/emulate_gpu.json"
  # A/B of the grouped merge (four FA4 block results a launch, the default) against one merge a block
  LIMIT=90 TAIL=8 run emulate_merge_each env DISTLAB_RING_MERGE_BLOCKS=0 $py -m distlab.cp.emulate --world 8 \
      --seq 8192 32768 --backend fa4 --iters 10 --wall --json "$out/emulate_wall_merge_each.json"
fi
pack_logs
exit $status
