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
"""

from __future__ import annotations

import os
import sys

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
                raise SystemExit(f"distlab run: {name} needs a value\n{USAGE}")
            value = argv[i + 1]
            i += 1
        if name in ("--nproc", "--nproc-per-node", "--nproc_per_node"):
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
        raise SystemExit(f"distlab run: no module or script to run\n{USAGE}")
    if not has_nodes:
        out.insert(0, "--standalone")
    return out + rest[:1], rest[1:]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if argv[0] == "submit":
        from distlab.submit import main as submit_main

        submit_main(argv[1:])
        return
    if argv[0] != "run":
        raise SystemExit(f"distlab: unknown command {argv[0]!r}\n{USAGE}")
    for key, value in GPU_SAFE_ENV.items():
        os.environ.setdefault(key, value)
    from torch.distributed.run import parse_args, run

    launcher, program_args = split_program(argv[1:])
    args = parse_args(launcher)
    args.training_script_args = program_args  # not parsed by torchrun's argparse (see module doc)
    run(args)


if __name__ == "__main__":
    main()
