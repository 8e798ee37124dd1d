#!/usr/bin/env bash
# Everything the multi-GPU issue asks for, on one host with N GPUs (run it as soon as a nvidia-h200-x2/x4/x8
# machine is lent; writes logs, JSON, plots and traces into OUTDIR, packed into OUTDIR/logs.tar.gz at the
# end because the device tool returns at most 8 files). A device call lasts at most 10 minutes, so the work
# is split into parts, one call each, every command under its own time limit:
#
#   bash launch/multigpu_check.sh OUTDIR [N] [PART]   # N: the GPUs nvidia-smi sees; PART: all (default),
#                                                     # parity, collectives, cp, tp, moe, model, zero
#
# parity: every CP method, TP/SP/async TP and EP with --check (each study exits 1 above its tolerance),
#    fp32 and bf16; the bf16 error at W=N is printed next to W=1's for the same problem;
# collectives: the playground, every op, 8 B to 4 GiB (busbw table + plot);
# cp: CP scaling at 8k tokens per GPU, Llama-3-8B attention (32/8 heads, d 128, bf16, causal): every
#    method vs one GPU, with a torch trace per rank and the overlap analyser's exposed communication;
# tp: the TP/SP block at TP 2/4/8 (where N allows), with and without async TP;
# moe: the MoE layer at EP N on the Mixtral proxy;
# model: llama-block-8gpu (tp 2 · SP · ulysses 2 · ring 2) training with MFU on 8, MoE under TP × CP on
#    4, and CP prefill + decode against the one-device greedy tokens;
# zero: the small preset at --dp-shard N, ZeRO 1/2/3 (hand) and FSDP2 (the anchor), HSDP, --ac full:
#    tokens/s and MFU against replicated DP (what the prefetched all-gathers and async reduce-scatters
#    failed to hide), --memory per rank (held vs predicted, CUDA peak), ZeRO's collectives per step.
# parity, tp and moe also print the planner's prediction (distlab.plan, H200 calibration) next to each run.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"   # $out, $py, $status, the multicast variables, pack_logs
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
n=${2:-$(nvidia-smi -L | wc -l)}
part=${3:-all}
# one torchrun job, at most $LIMIT s (default 240), skipped once the call has used $BUDGET s (default 540)
run() { if [ $SECONDS -gt "${BUDGET:-540}" ]; then echo "skipped (past ${BUDGET:-540} s): $*"; return 1; fi
        timeout "${LIMIT:-240}" $py -m distlab run --nproc-per-node "$1" -m "${@:2}"; }
want() { [ "$part" = all ] || [ "$part" = "$1" ]; }
seq=$((8192 * n))

if want parity; then
echo "== 1. parity under NCCL on $n GPUs =="
for dtype in fp32 bf16; do
  for m in "distlab.cp.ring --layout contiguous" "distlab.cp.ring --layout zigzag" "distlab.cp.ulysses" \
           "distlab.cp.usp --ulysses 2"; do
    run "$n" $m --seq 16384 --dtype $dtype --check --iters 2 --json "$out/parity_$(echo $m | tr ' .' '__')_$dtype.json" \
      | grep -E "attention$|check vs" || status=1
  done
  run "$n" distlab.tp --sp --check --seq 4096 --dtype $dtype --iters 2 | grep -E "check vs" || status=1
  run "$n" distlab.tp --sp --async-tp --check --seq 4096 --dtype $dtype --iters 2 | grep -E "check vs" || status=1
  run "$n" distlab.moe --check --tokens 2048 --dtype $dtype --iters 1 | grep -E "check vs" || status=1
done
run 1 distlab.cp.ring --seq 16384 --dtype bf16 --check --iters 1 --json "$out/parity_w1_bf16.json" | grep "check vs"
echo "-- the planner's prediction (H200 calibration, NVLink 4) next to each bf16 study --"
$py -m distlab.plan.validate --measured "$out"/parity_distlab_cp_*_bf16.json --link nvlink4 \
  --json "$out/plan_vs_parity.json" || status=1
# the Triton ring (in-kernel accumulation), its forwards also as programmatic dependents (PDL) behind NCCL receives
for pdl in 0 1; do
  DISTLAB_TRITON_ATTN_PDL=$pdl run "$n" distlab.cp.ring --seq 16384 --dtype bf16 --backend triton --check --iters 2 \
    --json "$out/parity_ring_triton_pdl$pdl.json" | grep -E "attention$|check vs" || status=1
done

fi
if want collectives; then
echo "== 2. collectives playground =="
LIMIT=500 run "$n" distlab.collectives --op all -b 8 -e 4G -f 2 --json "$out/collectives.json" \
  --plot "$out/collectives.png" > "$out/collectives.txt" || status=1
grep -E "^# [a-z_]+,|Avg bus" "$out/collectives.txt"

fi
if want cp; then
echo "== 3. CP scaling, 8k tokens per GPU =="
run "$n" distlab.cp.compare --seq "$seq" --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --iters 5 \
  --json "$out/cp_compare.json" --plot "$out/cp_compare.png" --profile torch --profile-dir "$out/cp_traces" || status=1
for d in "$out"/cp_traces/*/; do $py -m distlab.profiling.overlap "$d"trace_rank*.json | head -$((n + 1)); done

fi
if want tp; then
echo "== 4. TP/SP block =="
for tp in 2 4 8; do
  [ "$tp" -le "$n" ] || continue
  for flags in "" "--sp" "--sp --async-tp"; do
    run "$tp" distlab.tp $flags --json "$out/tp${tp}_$(echo $flags | tr -d ' -').json" | grep -E "Llama block|slowest|collectives" || status=1
  done
done
$py -m distlab.tp.shard_gemms --tp 1 2 4 8 --json "$out/shard_gemms.json" | tail -5
$py -m distlab.plan.validate --measured "$out"/tp*.json --link nvlink4 --json "$out/plan_vs_tp.json" || status=1

fi
if want moe; then
echo "== 5. MoE at EP $n, Mixtral proxy =="
run "$n" distlab.moe --experts 8 --topk 2 --hidden 4096 --ffn 14336 --tokens 4096 --json "$out/moe_ep$n.json" || status=1
$py -m distlab.plan.validate --measured "$out/moe_ep$n.json" --link nvlink4 --json "$out/plan_vs_moe.json" || status=1

fi
if want model; then
echo "== 6. the whole model under NCCL: training layouts (MFU), CP prefill + decode parity =="
if [ "$n" -ge 8 ]; then
  run 8 distlab.train --config llama-block-8gpu --steps 6 --json "$out/train_llama_block_8gpu.json" | tail -3 || status=1
fi
if [ "$n" -ge 4 ]; then
  run 4 distlab.train --config moe-tp2-cp2 --steps 30 --json "$out/train_moe_tp2_cp2.json" | tail -2 || status=1
  run 4 distlab.infer --config small --ring 2 --tp 2 --steps 32 --check --json "$out/infer_tp2_ring2.json" | tail -1 || status=1
fi
run "$n" distlab.infer --config small --ring "$n" --steps 32 --check --json "$out/infer_ring$n.json" | tail -1 || status=1
fi
if want zero; then
echo "== 7. sharded data parallelism at dp-shard $n (small preset) =="
run "$n" distlab.train --config small --steps 20 --json "$out/zero_replicated.json" | tail -1 || status=1
for z in 1 2 3; do
  run "$n" distlab.train --config small --steps 20 --dp-shard "$n" --zero $z --memory --json "$out/zero$z.json" \
    | grep -vE "^\[" || status=1
done
run "$n" distlab.train --config small --steps 20 --dp-shard "$n" --fsdp-impl torch --json "$out/zero3_fsdp2.json" | tail -1 || status=1
run "$n" distlab.train --config small --steps 20 --dp-shard "$n" --ac full --memory --json "$out/zero3_ac.json" | tail -2 || status=1
[ "$n" -ge 4 ] && { run "$n" distlab.train --config small --steps 20 --dp-shard 2 --dp-replicate $((n / 2)) \
  --json "$out/hsdp.json" | tail -1 || status=1; }
fi
pack_logs
exit $status
