#!/usr/bin/env bash
# Where a launch's host time goes, on one H200 (#24): PyTorch's own per-op host cost as the yardstick, and
# cProfile of the Triton attention launch and of the LSE merge (the functions the host time is spent in).
#   bash launch/gpu_host_debug.sh OUTDIR
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"   # $out, $py, $status, the multicast variables, pack_logs
run() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS
        timeout -s ABRT "${LIMIT:-200}" "$@" > "$out/$name.log" 2>&1 || { echo "   FAILED or timed out ($name)"; status=1; }
        tail -n ${TAIL:-6} "$out/$name.log"; echo "   ($((SECONDS - t0)) s)"; }
TAIL=4 run torch_ops $py -c '
import time, torch
x = torch.zeros(1024, device="cuda"); torch.cuda.synchronize()
for name, fn in (("add_", lambda: x.add_(1)), ("empty", lambda: torch.empty(1024, device="cuda")),
                 ("current_stream", lambda: torch.cuda.current_stream())):
    fn(); t = time.perf_counter()
    for _ in range(2000): fn()
    print(f"{name}: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us host per call")'
LIMIT=120 TAIL=40 run profile_launch $py -m distlab.kernels.host_cost --rounds 1 --ring-world 1 --calls 300 \
    --profile "triton launch"
LIMIT=60 TAIL=34 run profile_merge $py -m distlab.kernels.host_cost --rounds 1 --ring-world 1 --calls 300 \
    --profile "lse merge"
pack_logs
exit $status
