#!/bin/bash
# The planner's one-GPU part (distlab.plan, issue #30): calibrate this GPU, then time one ring rank's real
# schedule (distlab.cp.emulate) at the shapes the planner's validation predicts.
#   bash launch/gpu_plan_check.sh OUT        # ~4 min on an H200
source "$(dirname "$0")/gpu_env.sh" "$1"
$py -m distlab.plan.calibration --out "$out/calibration.json" 2>&1 | tee "$out/calibration.log" || status=1
for w in 4 8; do
  $py -m distlab.cp.emulate --world $w --seq 65536 --backend sdpa-cudnn --no-graphs --wall \
      --json "$out/emulate_w${w}_wall.json" 2>&1 | tail -20 | tee "$out/emulate_w${w}.log" || status=1
done
exit $status
