#!/usr/bin/env bash
# One-GPU check of the collectives playground, the overlap study and the trace analyser: a one-rank NCCL
# group still launches NCCL kernels, so an all-reduce on a side stream can overlap GEMMs on the default one.
#
#   bash launch/gpu_overlap_check.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"

echo "== playground, 1 rank NCCL (correctness of the GPU path; busbw needs >1 rank) =="
$py -m distlab.collectives --op all -b 1K -e 64M -f 64 --json "$out/playground_w1.json" || status=1
echo "== overlap study, 1 rank NCCL (send/recv to itself runs a real NCCL kernel), torch profiler =="
$py -m distlab.collectives.overlap --op sendrecv --size 1G --gemm 8192 --gemms 4 --profile torch \
    --profile-dir "$out/overlap" --json "$out/overlap.json" || status=1
$py -m distlab.profiling.overlap "$out/overlap/trace_rank0.json" --json "$out/overlap_analysis.json" || status=1
echo "== ring study W=1 on GPU with a torch trace =="
$py -m distlab.cp.ring --seq 32768 --profile torch --profile-dir "$out/ring" --no-baseline || status=1
$py -m distlab.profiling.overlap "$out"/ring/*/trace_rank0.json || status=1
exit $status
