#!/usr/bin/env bash
#SBATCH --job-name=distlab-train
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
##SBATCH --gpus-per-node=8        # on a GPU cluster: uncomment, or pass --gpus-per-node on the command line
#
# distlab.train on SLURM (see launch/run.sh for the variables):
#   sbatch launch/train.sh [study flags ...]
#   sbatch --nodes 2 --gpus-per-node 8 -p PARTITION -t 01:00:00 launch/train.sh [study flags ...]
export DISTLAB_MODULE=distlab.train
exec bash "${SLURM_SUBMIT_DIR:-.}/launch/run.sh" "$@"
