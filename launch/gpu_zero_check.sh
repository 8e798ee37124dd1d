#!/usr/bin/env bash
# Sharded data parallelism and activation checkpointing on one GPU (issue: ZeRO / FSDP + AC):
#
#   bash launch/gpu_zero_check.sh OUTDIR
#
# 1. the small preset (8 layers, hidden 1024, seq 2048, batch 16, bf16 autocast) with --ac none / full /
#    selective: tokens/s, MFU and --memory (counted bytes, the model's prediction, the CUDA peak);
# 2. the hand-written ZeRO-3 on one rank (--dp-shard 1: every gather is a copy, so what it costs over
#    plain training is its host work — hooks, flattening, the pieces' AdamW — plus the copies), with its
#    collectives and hook calls per step counted; ZeRO-2 beside it.
# Multi-GPU figures (overlap, MFU at dp-shard 8) are part "zero" of launch/multigpu_check.sh.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
steps=${STEPS:-30}
config=${CONFIG:-small}
for ac in none full selective; do
  echo "== small, --ac $ac =="
  timeout 240 $py -m distlab.train --config "$config" --steps "$steps" --ac $ac --memory --json "$out/small_ac_$ac.json" \
    | grep -E "activations|parameters|throughput|per step|error" || status=1
done
for z in 3 2; do
  echo "== small, hand-written ZeRO-$z on one rank (--dp-shard 1) =="
  timeout 240 $py -m distlab.train --config "$config" --steps "$steps" --dp-shard 1 --zero $z --memory \
    --json "$out/small_zero$z.json" | grep -E "activations|parameters|throughput|per step|error" || status=1
done
exit $status
