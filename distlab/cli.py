"""The ``distlab`` command.

    distlab run --nproc 4 -m distlab.cp.ring --seq 8192
    distlab run --nproc-per-node 8 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 -m distlab.cp.ring

``run`` forwards to ``torch.distributed.run`` (torchrun). It exists because stock ``torchrun --nproc 8``
fails with "ambiguous option" on Python <= 3.13.0: here ``--nproc N`` (or ``--nproc=N``) is rewritten to
``--nproc-per-node N``. Without ``--nnodes`` or a rendezvous endpoint it adds ``--standalone`` (one node, a
free port). The program's own arguments are handed to it untouched: stock torchrun lets argparse read
them too, so a study flag that is a prefix of a torchrun flag (``--max`` of ``--max-restarts``) fails there
with "ambiguous option"; here it does not. It also sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1
unless they are already set. Everything after the module or script is passed to it untouched.

Failures: the module (or script) and ``--nproc`` are checked before any rank starts; when ranks fail, each
distinct error (filed by ``distlab.bench.run_study`` in ``DISTLAB_ERROR_DIR``, or a signal) is printed once
with the ranks that raised it, instead of torchrun's per-rank tracebacks, and the exit status is the study's.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import tempfile

from distlab.runtime import GPU_SAFE_ENV

USAGE = """usage: distlab run [--nproc N | --nproc-per-node N] [torchrun options] (-m MODULE | SCRIPT) [args ...]
       distlab submit [--cluster auto|slurm|local] [--nodes N] [--tasks-per-node N] ... -m MODULE [args ...]

Launch N processes per node with torchrun. Example:
    distlab run --nproc 4 -m distlab.cp.ring --seq 8192 --check
"""


def torchrun_args(argv: list[str]) -> list[str]:
    """Rewrite the launcher's own options (before the module/script) into torchrun's; the full command."""
    launcher, program_args = split_program(argv)
    return launcher + program_args


def _torchrun_flags() -> set[str]:
    """torchrun's options that take no value (everything else takes one)."""
    from torch.distributed.run import get_args_parser

    return {opt for action in get_args_parser()._actions if action.nargs == 0 for opt in action.option_strings}


def split_program(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options with the module/script, the program's own arguments)."""
    flags = _torchrun_flags()
    out, i, has_nodes = [], 0, False
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "--module", "--no-python") or not arg.startswith("-"):
            break                                      # the program and its arguments follow, untouched
        name, eq, value = arg.partition("=")
        if not eq and name not in flags:             # an option with its value in the next word
            if i + 1 >= len(argv):
                _die(f"{name} needs a value (see distlab --help)")
            value = argv[i + 1]
            i += 1
        if name in ("--nproc", "--nproc-per-node", "--nproc_per_node"):
            check_nproc(value)
            out += ["--nproc-per-node", value]
        else:
            has_nodes |= name in ("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr",
                                  "--master_addr", "--standalone")
            out += [arg] if (eq or name in flags) else [name, value]
        i += 1
    rest = argv[i:]
    if rest and rest[0] in ("-m", "--module", "--no-python"):
        out.append(rest.pop(0))
    if not rest:
        _die("no module or script to run (e.g. distlab run --nproc 4 -m distlab.cp.ring)")
    if not has_nodes:
        out.insert(0, "--standalone")
    return out + rest[:1], rest[1:]


def _die(message: str) -> None:
    print(f"distlab run: {message}", file=sys.stderr)
    sys.exit(2)


def check_nproc(value: str) -> None:
    if value in ("auto", "cpu", "gpu", "xpu"):
        return
    if not value.isdigit() or int(value) < 1:
        _die(f"--nproc {value!r}: give a positive number of processes per node (or auto, cpu, gpu)")


def check_program(launcher: list[str]) -> None:
    """The module or script exists here, before any rank starts (status 2 otherwise)."""
    target, is_module = launcher[-1], len(launcher) > 1 and launcher[-2] in ("-m", "--module")
    if is_module:
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            _die(f"no module named {target!r} (is distlab installed here? pip install -e .)")
    elif "--no-python" not in launcher and not os.path.isfile(target):
        _die(f"no script {target!r}")


def summarize_failures(failures: dict, error_dir: str) -> int:
    """Print each distinct error once with the ranks that raised it; return the exit status to use.

    A rank that failed through ``distlab.bench.run_study`` left its message in ``error_dir``; a rank killed
    by a signal left nothing, and is named with the signal (SIGKILL is usually the kernel's OOM killer)."""
    errors: dict[str, list[int]] = {}
    codes: dict[int, int] = {}
    for name in sorted(n for n in os.listdir(error_dir) if n.startswith("rank") and n.endswith(".json")):
        with open(os.path.join(error_dir, name)) as f:
            e = json.load(f)
        errors.setdefault(e["message"], []).append(e["rank"])
        codes[e["rank"]] = e["code"]
    for rank, failure in sorted(failures.items()):
        if rank in codes:
            continue
        if failure.exitcode < 0:
            sig = failure.signal_name()
            if sig == "SIGTERM":
                continue   # stopped by the launcher once another rank failed: not a cause
            hint = ""
            if sig == "SIGKILL":
                hint = (" (the launcher's last resort for a rank that did not stop on SIGTERM, i.e. frozen, or "
                        "the kernel's OOM killer)" if codes else " (out of memory? the kernel's OOM killer sends SIGKILL)")
            errors.setdefault(f"killed by {sig}{hint}", []).append(rank)
            codes[rank] = 128 - failure.exitcode
        else:
            errors.setdefault(f"exited with status {failure.exitcode} (see its output above)", []).append(rank)
            codes[rank] = failure.exitcode
    if not errors and failures:
        errors["stopped by SIGTERM (from outside: the launcher itself was asked to stop)"] = sorted(failures)
        codes = {rank: 143 for rank in failures}
    for message, ranks in errors.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_span(ranks)}"
        sep = "\n" if "\n" in message else " "
        print(f"error ({who}):{sep}{message}", file=sys.stderr)
    return codes[min(codes)] if codes else 1


def _span(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def launch(argv: list[str]) -> int:
    """``distlab run``: torchrun with the program's arguments kept away from its parser, errors summarised."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    launcher, program_args = split_program(argv)
    check_program(launcher)
    args = parse_args(launcher)
    args.training_script_args = program_args  # not parsed by torchrun's argparse (see module doc)
    for key, value in GPU_SAFE_ENV.items():
        os.environ.setdefault(key, value)
    nproc = args.nproc_per_node
    if nproc.isdigit() and int(nproc) > 1:   # what torchrun would set, without its four-line warning
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(nproc))))
    # torchrun's own failure report is a traceback of the launcher plus one per rank: replaced by ours
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="distlab-errors-") as error_dir:
        os.environ["DISTLAB_ERROR_DIR"] = error_dir
        os.environ["DISTLAB_LAUNCHER_PID"] = str(os.getpid())   # workers die with us (runtime.die_with_parent)
        try:
            run(args)
        except ChildFailedError as e:
            return summarize_failures(e.failures, error_dir)
        except KeyboardInterrupt:
            return 130
        finally:
            os.environ.pop("DISTLAB_ERROR_DIR", None)
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if argv[0] == "submit":
        from distlab.bench import run_study
        from distlab.submit import main as submit_main

        run_study(submit_main, argv[1:])
        return
    if argv[0] != "run":
        print(f"distlab: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch(argv[1:]))


if __name__ == "__main__":
    main()
