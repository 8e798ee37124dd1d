"""First contact: the README's commands as it writes them, and every class of mistake a newcomer makes.

A mistake must end in one line that says what is wrong (``error: ...`` or ``distlab run: ...``), the
documented exit status (2 for invalid input, the study's own status otherwise), and no traceback — under
``distlab run`` one line for all ranks, not one per rank. These tests run the real commands in
subprocesses, as a person would type them; the README's test command itself is checked in a fresh clone.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shlex
import subprocess
import sys
import time

import pytest
import torch

from tests.argv_shim import check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
ENV.pop("TRITON_INTERPRET", None)


def run(cmd: str, cwd=None, timeout=240) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "distlab":
        argv = [sys.executable, "-m", "distlab", *argv[1:]]
    return subprocess.run(argv, cwd=cwd or ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def one_clear_line(proc, code: int, *words: str) -> str:
    """The run failed with ``code``, said so in exactly one line without a traceback; return that line."""
    text = proc.stdout + proc.stderr
    assert proc.returncode == code, (proc.returncode, text[-3000:])
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(("error", "distlab run:")), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------------------------- the README

def readme_blocks() -> list[list[str]]:
    text = open(os.path.join(ROOT, "README.md")).read()
    return [block.strip().splitlines() for block in re.findall(r"^```(?:bash)?\n(.*?)^```", text, re.S | re.M)]


def test_readme_top_has_exactly_the_two_commands_and_ci_runs_the_second():
    first = readme_blocks()[0]
    assert len(first) == 2, first
    assert "distlab run" in first[0] and "distlab.cp.ring" in first[0]
    assert first[1].endswith("&& pytest"), first[1]          # plain pytest, as a newcomer types it
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "README.md" in ci and "python3 -m pytest" not in ci   # .ci/run takes the command from the README


def test_every_path_the_readme_names_exists():
    """A file moved or removed but still listed in the README's map fails here (``distlab/cp/merge.py``
    stood in its table long after the merge had moved to ``distlab/kernels/lse_merge.py``)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    paths = set(re.findall(r"`((?:distlab|launch|tests|docs|examples)/[^`\s*]+)`", text))
    assert len(paths) > 20, sorted(paths)
    missing = sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, missing


def readme_commands() -> list[list[str]]:
    """Every ``python -m``, ``distlab run``, ``torchrun`` and ``sbatch launch/*.sh`` line of the README, as
    the argv a python3 would get (``-m MODULE args``)."""
    scripts = {"usp.sh": "distlab.cp.usp", "ring.sh": "distlab.cp.ring", "tp.sh": "distlab.tp",
               "compare.sh": "distlab.cp.compare", "train.sh": "distlab.train"}
    calls = []
    for block in readme_blocks():
        for line in block:
            line = line.split("  #")[0].split(" # ")[0].strip()
            if "&&" in line:
                line = line.split("&&")[-1].strip()
            line = re.sub(r"\[[^\]]*\]", "", line)     # optional parts written [--flag]
            words = shlex.split(line) if line else []
            while words and "=" in words[0] and not words[0].startswith("-"):
                words.pop(0)                           # VAR=value prefixes
            if not words:
                continue
            if words[:2] in (["python", "-m"], ["python3", "-m"]):
                calls.append(words[1:])
            elif words[:2] == ["distlab", "run"] or words[0] == "torchrun":
                calls.append(["-m", "distlab", "run", *words[1 + (words[0] == "distlab"):]])
            elif words[0] == "sbatch":
                script = next((w for w in words if w.startswith("launch/")), "")
                name = os.path.basename(script)
                rest = words[words.index(script) + 1:]
                if name in scripts:
                    calls.append(["-m", scripts[name], *rest])
                elif name == "run.sh" and rest:
                    calls.append(["-m", rest[0], *rest[1:]])
    return calls


def test_every_readme_command_names_a_module_that_parses_its_flags(tmp_path):
    """A flag renamed in a study but not in the README fails here, not in a newcomer's terminal."""
    calls = readme_commands()
    assert len(calls) > 30, calls
    log = tmp_path / "calls.jsonl"
    import json

    with open(log, "w") as f:
        for argv in calls:
            f.write(json.dumps(argv) + "\n")
    parsed, skipped, errors = check(str(log))
    assert not errors, errors
    assert {"distlab.cp.ring", "distlab.train", "distlab.infer", "distlab.collectives", "distlab.moe",
            "distlab.tp"} <= set(parsed), parsed


def test_readme_first_command_as_written():
    """The README's main job, exactly as its first line writes it (after the install): PASS, status 0."""
    line = readme_blocks()[0][0].split("&&")[-1].strip()
    proc = run(line, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout and "Traceback" not in proc.stderr, proc.stdout[-2000:]


def test_readme_test_command_collects_in_a_fresh_clone(tmp_path):
    """Plain ``pytest`` (not ``python -m pytest``) collects every test module in a fresh clone."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", ROOT, str(clone)], check=True, timeout=120)
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    pytest_bin = os.path.join(os.path.dirname(sys.executable), "pytest")
    cmd = [pytest_bin] if os.path.exists(pytest_bin) else [sys.executable, "-c", "import pytest, sys; sys.exit(pytest.main())"]
    proc = subprocess.run([*cmd, "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "error" not in proc.stdout.lower().split("collected")[-1], proc.stdout[-2000:]


# ------------------------------------------------------------------------------------- mistakes, one line

MISTAKES = [
    ("distlab run --nproc 2 -m distlab.cp.ring --seq -8", 2, ["ranks 0, 1", "--seq"]),
    ("python -m distlab.cp.ring --seq 0", 2, ["--seq"]),
    ("distlab run --nproc 4 -m distlab.cp.ring --seq 8 --bogus-flag", 2, ["ranks 0-3", "--bogus-flag"]),
    ("distlab run --nproc 3 -m distlab.cp.ring --seq 100", 2, ["not divisible"]),
    ("distlab run --nproc 0 -m distlab.cp.ring", 2, ["--nproc"]),
    ("distlab run --nproc 2 -m distlab.cp.nonexistent", 2, ["no module named"]),
    ("python -m distlab.moe --backend bogus", 2, ["--backend"]),
    ("distlab run --nproc 2 -m distlab.collectives --op all_gather -e 1X", 2, ["'1X'"]),
    ("python -m distlab.collectives -b 1M -e 8", 2, ["nothing to sweep"]),
    ("python -m distlab.collectives --algo Ring", 2, ["gloo"]),
    ("python -m distlab.collectives -e 1024G", 2, ["needs about", "free"]),
    ("python -m distlab.cp.cost --world 0", 2, ["--world"]),
    ("distlab run --nproc 2 -m distlab.cp.decode --cache 63 --steps 1", 2, ["--cache 63"]),
    ("python -m distlab.cp.ring --dtype bogus", 2, ["dtype"]),
    ("python -m distlab.collectives.overlap --size 256M --gemm 8192", 2, ["GPU-sized"]),
    ("python -m distlab.train --config nonexistent", 2, ["no config"]),
    ("python -m distlab.train --config tiny --resume does/not/exist", 2, ["no checkpoint"]),
    ("python -m distlab.infer --checkpoint does/not/exist", 2, ["no checkpoint"]),
]
GPU_WORK = ["python -m distlab.cp.ring --device cuda", "python -m distlab.cp.local_kernels",
            "python -m distlab.tp.shard_gemms"]


@pytest.fixture(scope="module")
def mistakes_run():
    """Every command of the two tests below, started together on first use, three at a time; each case waits for
    its own. Each is a fresh interpreter spending most of its ~2 s importing torch on one core: one after another
    they cost the suite ~60 s on two cores."""
    cmds = [cmd for cmd, *_ in MISTAKES] + ([] if torch.cuda.is_available() else GPU_WORK)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        yield {cmd: pool.submit(run, cmd) for cmd in cmds}


@pytest.mark.parametrize("cmd, code, words", MISTAKES)
def test_a_mistake_is_one_clear_line(mistakes_run, cmd, code, words):
    one_clear_line(mistakes_run[cmd].result(), code, *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("cmd", GPU_WORK)
def test_gpu_work_without_a_gpu_is_refused(mistakes_run, cmd):
    one_clear_line(mistakes_run[cmd].result(), 2, "CUDA")


def test_checkpoint_mistakes(tmp_path):
    """A checkpoint directory instead of a step folder, a folder that is no checkpoint, another model."""
    ckpt = tmp_path / "ckpt"
    proc = run(f"python -m distlab.train --config tiny --steps 2 --checkpoint-dir {ckpt}")
    assert proc.returncode == 0 and f"saved checkpoint {ckpt}/step_2" in proc.stdout, proc.stdout + proc.stderr
    one_clear_line(run(f"python -m distlab.train --config tiny --resume {ckpt}"), 2, "step_2")
    one_clear_line(run(f"python -m distlab.infer --checkpoint {tmp_path}"), 2, "not a checkpoint")
    other = tmp_path / "other.json"
    other.write_text('{"model": {"layers": 1}}')
    one_clear_line(run(f"python -m distlab.train --config {other} --resume {ckpt}/step_2"), 2,
                   "layers: saved 2, now 1")
    proc = run(f"python -m distlab.train --config tiny --steps 3 --resume {ckpt}/step_2")
    assert proc.returncode == 0 and f"resumed from {ckpt}/step_2 at step 2" in proc.stdout, proc.stdout + proc.stderr


def test_help_prints_once_and_starts_nothing():
    t0 = time.monotonic()
    proc = run("python -m distlab.slurm_local --help", timeout=30)
    assert proc.returncode == 0 and "usage:" in proc.stdout and time.monotonic() - t0 < 20, proc.stderr
    for cmd in ("distlab submit --help", "python -m launch.submit --help", "distlab --help"):
        proc = run(cmd, timeout=60)
        assert proc.returncode == 0 and "usage" in proc.stdout, (cmd, proc.stdout, proc.stderr)
    proc = run("distlab run --nproc 2 -m distlab.cp.cost --help")
    assert proc.returncode == 0 and proc.stdout.count("usage:") == 1, proc.stdout   # rank 0 only


SCRIPT = """
import os, signal, time
from distlab.bench import run_study

def main():
    rank = int(os.environ["RANK"])
    if {what!r} == "kill" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if {what!r} == "bug":
        raise RuntimeError("an internal bug, not a mistake")
    time.sleep(30)

run_study(main)
"""


def test_a_killed_rank_is_named_with_its_signal(tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(SCRIPT.format(what="kill"))
    proc = run(f"distlab run --nproc 2 {script}", timeout=120)
    line = one_clear_line(proc, 137, "rank 1", "SIGKILL")
    assert "out of memory" in line


def test_a_bug_keeps_its_traceback_printed_once(tmp_path):
    script = tmp_path / "bug.py"
    script.write_text(SCRIPT.format(what="bug"))
    proc = run(f"distlab run --nproc 3 {script}", timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("Traceback") == 1 and "error (ranks 0-2):" in proc.stderr, proc.stderr
    assert "RuntimeError: an internal bug" in proc.stderr


# ------------------------------------------------------------------------------------------ right verdicts

def test_moe_check_with_capacity_compares_the_same_drops():
    proc = run("distlab run --nproc 2 -m distlab.moe --check --capacity-factor 1.0 --tokens 256 --iters 1")
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    dropped = int(re.search(r"dropped assignments: (\d+)", proc.stdout).group(1))
    assert dropped > 0, proc.stdout           # the check ran with real drops


def test_all_gather_sizes_below_one_element_per_rank_make_one_row():
    proc = run("distlab run --nproc 4 -m distlab.collectives --op all_gather -b 4 -e 64 -n 1 -w 0")
    assert proc.returncode == 0, proc.stderr
    sizes = [int(line.split()[0]) for line in proc.stdout.splitlines() if line[:1] == " " and line.split()[0].isdigit()]
    assert sizes == sorted(set(sizes)) and sizes[0] == 16, proc.stdout
    assert proc.stdout.count("correctness check") == 1, proc.stdout   # said once, not under every table


def test_ring_study_at_one_rank_reports_overhead_not_efficiency():
    proc = run("python -m distlab.cp.ring --seq 256 --iters 1 --warmup 0")
    assert proc.returncode == 0, proc.stderr
    assert "efficiency" not in proc.stdout and "1 processes" not in proc.stdout, proc.stdout
    assert "W=1, no scaling to measure" in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------------- torchrun-safe flags

STUDIES = ["distlab.cp.ring", "distlab.cp.ulysses", "distlab.cp.usp", "distlab.cp.compare", "distlab.cp.cost",
           "distlab.cp.decode", "distlab.cp.emulate", "distlab.cp.local_kernels", "distlab.tp",
           "distlab.tp.shard_gemms", "distlab.moe", "distlab.collectives", "distlab.collectives.overlap",
           "distlab.train", "distlab.infer", "distlab.profiling.overlap", "distlab.kernels.bench", "distlab.kernels.grouped_gemm",
           "distlab.kernels.tune_attention"]


class _Got(BaseException):
    pass


def study_options(module: str) -> list[str]:
    """Every option string of the module's parser (built by running the module up to its parse)."""
    import argparse
    import runpy
    import warnings

    original, saved = argparse.ArgumentParser.parse_args, sys.argv

    def grab(self, *a, **k):
        raise _Got([o for action in self._actions for o in action.option_strings])

    argparse.ArgumentParser.parse_args, sys.argv = grab, [module]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            runpy.run_module(module, run_name="__main__")
    except _Got as got:
        return got.args[0]
    finally:
        argparse.ArgumentParser.parse_args, sys.argv = original, saved
    raise AssertionError(f"{module} did not build a parser")


def test_no_study_flag_is_a_prefix_of_a_torchrun_option():
    """Plain ``torchrun --nproc-per-node N -m STUDY --flag`` lets torchrun's argparse see ``--flag``: a prefix
    of one of its options (``--max`` of ``--max-restarts``, ``--n`` of ``--nnodes``) fails as ambiguous."""
    from torch.distributed.run import get_args_parser

    theirs = {o for action in get_args_parser()._actions for o in action.option_strings}
    clashes = {}
    for module in STUDIES:
        for opt in study_options(module):
            hit = [t for t in theirs if t != opt and t.startswith(opt) and opt.startswith("--")]
            if hit and opt not in ("-h", "--help"):
                clashes[f"{module} {opt}"] = sorted(hit)
    assert not clashes, clashes


def test_plain_torchrun_takes_a_study_flag_that_distlab_run_takes():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "distlab.collectives", "--op", "all_reduce", "-e", "64", "-n", "1", "-w", "0"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Out of bounds values : 0 OK" in proc.stdout, proc.stderr[-2000:]
