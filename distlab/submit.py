"""Submit any distlab study with submitit: SLURM when present, local processes otherwise.

    python -m launch.submit --nodes 2 --tasks-per-node 8 --gpus-per-node 8 -p gpu -m distlab.cp.usp --ulysses 8 --ring 2
    distlab submit --tasks-per-node 4 --cluster local -m distlab.cp.ring --seq 4096 --check --device cpu

One task per GPU (``tasks_per_node`` = GPUs per node). Inside each task
``submitit.helpers.TorchDistributedEnvironment`` exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT, so the study's ``init_runtime()`` sees a torchrun-like environment; the study runs in the
task's process (``runpy``) with ``--json`` pointed into the job folder, and rank 0's JSON comes back to
the caller as a dict. ``cluster="auto"`` uses SLURM when ``sbatch`` is on the PATH, else the local
executor. Every wait is bounded (``timeout_s``): a job that does not finish is cancelled and reported.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from distlab.bench import StudyParser, nonnegative_int, positive_int


class StudyTask:
    """The callable submitit pickles: run ``module`` with ``args`` as ``python -m module args``."""

    def __init__(self, module: str, args: list[str], result_path: str):
        self.module, self.args, self.result_path = module, list(args), result_path

    def __call__(self):
        import submitit

        # overwrite: sbatch and the local executor pass the submitter's environment on, MASTER_* included
        env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        argv = [self.module, *self.args, "--json", self.result_path]
        old_argv, sys.argv = sys.argv, argv
        try:
            runpy.run_module(self.module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if e.code not in (0, None):
                raise RuntimeError(f"{self.module} exited with status {e.code} on rank {env.rank}") from None
        finally:
            sys.argv = old_argv
        if env.rank != 0:
            return None
        with open(self.result_path) as f:
            return json.load(f)


DEFAULT_FOLDER = os.path.join("logs", "submitit")


def submit(module: str, study_args: list[str], nodes: int = 1, tasks_per_node: int = 1, gpus_per_node: int = 0,
           cluster: str = "auto", folder: str = DEFAULT_FOLDER, partition: str | None = None, time_min: int = 30,
           timeout_s: float = 1800.0, slurm_extra: dict | None = None, with_job: bool = False):
    """Run the study as a submitit job and return rank 0's JSON result (and the job, ``with_job``)."""
    import importlib.util

    try:
        import submitit
    except ImportError:
        raise ValueError("distlab submit needs submitit: pip install 'distlab[slurm]'") from None

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ValueError(f"no module named {module!r}")
    if cluster == "auto":
        cluster = "slurm" if any(os.access(os.path.join(p, "sbatch"), os.X_OK)
                                 for p in os.environ.get("PATH", "").split(os.pathsep)) else "local"
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    params = {"nodes": nodes, "tasks_per_node": tasks_per_node, "timeout_min": time_min, "name": module}
    if cluster == "slurm":
        if gpus_per_node:
            params["gpus_per_node"] = gpus_per_node
        if partition:
            params["slurm_partition"] = partition
        params.update({f"slurm_{k}": v for k, v in (slurm_extra or {}).items()})
    elif nodes != 1:
        raise ValueError("the local executor runs on one node: use nodes=1 (or a SLURM cluster)")
    executor.update_parameters(**params)
    os.makedirs(folder, exist_ok=True)
    result_path = os.path.abspath(os.path.join(folder, f"result-{time.time_ns()}.json"))
    job = executor.submit(StudyTask(module, study_args, result_path))
    deadline = time.monotonic() + timeout_s
    while not job.done():
        if time.monotonic() > deadline:
            job.cancel()
            raise TimeoutError(f"job {job.job_id} did not finish within {timeout_s:.0f} s and was cancelled")
        time.sleep(0.5)
    try:
        results = job.results()
    except Exception as e:   # submitit's FailedJobError: the task's traceback; keep the study's own error line
        lines = (job.stderr() or "").strip().splitlines() + str(e).strip().splitlines()
        why = next((line for line in lines if line.startswith("error")), lines[-1] if lines else "unknown")
        raise ValueError(f"job {job.job_id} failed: {why} (its logs: {folder}/)") from None
    return (results[0], job) if with_job else results[0]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("-m") if "-m" in argv else len(argv)
    p = StudyParser(prog="python -m launch.submit", description=__doc__.split("\n\n")[0],
                    usage="python -m launch.submit [options] -m MODULE [study flags ...]",
                    epilog="Example: distlab submit --cluster local --tasks-per-node 4 -m distlab.cp.ring --seq 4096 "
                           "--device cpu")
    p.add_argument("--cluster", choices=("auto", "slurm", "local"), default="auto")
    p.add_argument("--nodes", type=positive_int, default=1)
    p.add_argument("--tasks-per-node", type=positive_int, default=1, help="one task per GPU")
    p.add_argument("--gpus-per-node", type=nonnegative_int, default=0)
    p.add_argument("-p", "--partition", default=None)
    p.add_argument("--time", type=positive_int, default=30, help="minutes")
    p.add_argument("--folder", default=DEFAULT_FOLDER, help=f"submitit's job folder (default {DEFAULT_FOLDER})")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait before cancelling")
    a = p.parse_args(argv[:cut])
    if cut + 1 >= len(argv):
        p.error("-m MODULE is missing: the study to run, e.g. -m distlab.cp.ring")
    module, study_args = argv[cut + 1], argv[cut + 2:]
    try:
        result, job = submit(module, study_args, a.nodes, a.tasks_per_node, a.gpus_per_node, a.cluster, a.folder,
                             a.partition, a.time, a.timeout, with_job=True)
    except TimeoutError as e:
        raise ValueError(str(e)) from None
    table = job_output(job)
    if table:
        print(table)
    print(f"job {job.job_id}: rank 0's JSON and the per-task logs are in {a.folder}/")
    return result


def job_output(job) -> str:
    """What rank 0's study printed (the table), without submitit's own log lines."""
    text = job.stdout() or ""   # the first task's log: rank 0 prints the table
    return "\n".join(line for line in text.splitlines() if not line.startswith("submitit ")).strip()
