#!/usr/bin/env bash
#SBATCH --job-name=distlab
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
##SBATCH --gpus-per-node=8        # on a GPU cluster: uncomment, or pass --gpus-per-node on the command line
##SBATCH --partition=gpu          # or: sbatch -p PARTITION ...
#
# Any distlab study on a SLURM allocation: one task per node, each running the distlab launcher (torchrun)
# with one process per GPU and c10d rendezvous on the job's first node.
#
#   sbatch launch/run.sh distlab.cp.ring --seq 65536 --check
#   sbatch --nodes 2 --gpus-per-node 8 launch/run.sh distlab.cp.usp --ulysses 8 --ring 2 --seq 131072
#   DISTLAB_NPROC_PER_NODE=4 sbatch launch/run.sh distlab.cp.usp --ulysses 2 --ring 2 --device cpu   # CPU node: gloo
#
# Processes per node: $DISTLAB_NPROC_PER_NODE, else the GPUs SLURM gave the node, else the GPUs nvidia-smi
# sees, else 4 (gloo on CPU). Per-rank logs go to $DISTLAB_LOG_DIR (default logs/JOBID/). The NVLink-multicast
# variables stay off (NCCL_NVLS_ENABLE=0 ...), NCCL_DEBUG=WARN unless set, and the rendezvous gives up after
# $DISTLAB_RDZV_TIMEOUT seconds (default 120) instead of waiting for a node that never comes.
set -euo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "error: launch/$(basename "$0") is a SLURM batch script: submit it with sbatch (SLURM_JOB_ID is not set)" >&2
  exit 2
fi
module="${DISTLAB_MODULE:-${1:-}}"
[ -n "${DISTLAB_MODULE:-}" ] || shift || true
if [ -z "$module" ]; then
  echo "error: no study module given (e.g. sbatch launch/run.sh distlab.cp.ring --seq 8192)" >&2
  exit 2
fi
cd "${SLURM_SUBMIT_DIR:-.}"
py="${DISTLAB_PYTHON:-python3}"
if ! "$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)' "$module" 2>/dev/null; then
  echo "error: no module named $module for $py (is distlab installed here? pip install -e .)" >&2
  exit 2
fi

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
gpus="${SLURM_GPUS_ON_NODE:-}"
if [ -z "$gpus" ] && command -v nvidia-smi >/dev/null 2>&1; then gpus=$(nvidia-smi -L 2>/dev/null | wc -l); fi
nproc="${DISTLAB_NPROC_PER_NODE:-${gpus:-4}}"
[ "$nproc" -gt 0 ] 2>/dev/null || nproc=4
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n 1)
head="${head:-$(hostname)}"
port="${DISTLAB_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
logs="${DISTLAB_LOG_DIR:-logs/$SLURM_JOB_ID}"
mkdir -p "$logs"
echo "distlab: job $SLURM_JOB_ID, $SLURM_NNODES node(s) x $nproc process(es), rendezvous $head:$port, module $module"

# `python -m distlab run` is torchrun (it keeps the study's own flags away from torchrun's parser)
srun --ntasks-per-node=1 --kill-on-bad-exit=1 "$py" -m distlab run \
  --nnodes "$SLURM_NNODES" --nproc-per-node "$nproc" \
  --rdzv-backend c10d --rdzv-endpoint "$head:$port" --rdzv-id "$SLURM_JOB_ID" \
  --rdzv-conf "join_timeout=${DISTLAB_RDZV_TIMEOUT:-120}" \
  --log-dir "$logs" --tee 3 \
  -m "$module" "$@"
