"""A real one-node SLURM cluster on this machine, for tests and for trying the launch scripts.

    python -m distlab.slurm_local          # start it, print the SLURM_CONF to export, stop on Ctrl-C or SIGTERM

Debian's ``slurmctld`` and ``slurmd`` (package slurm-wlm / slurmctld + slurmd + slurm-client) started by
hand with a configuration written to a temp dir: state, spool, logs and pid files live there, the ports
are free ones, ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` need no cgroups,
``AuthType=auth/none`` needs no munge key, the node declares 16 CPUs so small jobs never wait for cores,
``EnforcePartLimits=ALL`` rejects impossible jobs instead of leaving them pending, and ``MinJobAge=4``
makes ``sbatch --wait`` return within seconds. ``stop()`` ends exactly the two daemons it started.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from distlab.ports import free_port

DAEMONS = ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")


def missing_binaries() -> list[str]:
    return [b for b in DAEMONS if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LocalSlurm:
    def __init__(self, cpus: int = 16):
        self.dir = tempfile.mkdtemp(prefix="distlab-slurm-")
        self.host = socket.gethostname().split(".")[0]
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.cpus = cpus
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": self.conf}

    def write_conf(self) -> None:
        d = self.dir
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        lines = [
            "ClusterName=distlab", f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}", "SlurmUser=root",
            "AuthType=auth/none", "CredType=cred/none",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides", "EnforcePartLimits=ALL", "MinJobAge=4", "ReturnToService=2",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool",
            f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.pid",
            f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd.log",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def start(self, timeout_s: float = 30.0) -> "LocalSlurm":
        self.write_conf()
        for cmd in ([_binary("slurmctld"), "-D", "-i", "-f", self.conf], [_binary("slurmd"), "-D", "-f", self.conf]):
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                               start_new_session=True))
            time.sleep(0.5)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if out.stdout.strip() in ("idle", "idle*") and "idle*" not in out.stdout:
                return self
            time.sleep(0.5)
        log = self.logs()
        self.stop()
        raise RuntimeError(f"the local SLURM did not reach an idle node in {timeout_s:.0f} s:\n{log}")

    def logs(self) -> str:
        text = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = os.path.join(self.dir, name)
            if os.path.exists(path):
                with open(path) as f:
                    text.append(f"--- {name}\n" + "".join(f.readlines()[-20:]))
        return "\n".join(text)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv=None):
    from distlab.bench import StudyParser, positive_int

    p = StudyParser(prog="python -m distlab.slurm_local", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpus", type=positive_int, default=16, help="CPUs the node declares (default 16)")
    a = p.parse_args(argv)
    if missing_binaries():
        raise ValueError(f"missing {', '.join(missing_binaries())}: apt-get install slurmctld slurmd slurm-client")

    def stop_on(signum, frame):   # SIGTERM/SIGHUP stop the daemons as Ctrl-C does (they run in their own session)
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop_on)
    with LocalSlurm(cpus=a.cpus) as cluster:
        print(f"one-node SLURM up; in another shell: export SLURM_CONF={cluster.conf}   (Ctrl-C stops it)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("stopping slurmctld and slurmd", flush=True)


if __name__ == "__main__":
    from distlab.bench import run_study

    run_study(main)
