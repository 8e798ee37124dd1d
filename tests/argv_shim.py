"""A stand-in for ``python3`` in dry runs of the device scripts (``tests/test_launch_scripts.py``).

    PYTHON="python tests/argv_shim.py" SHIM_LOG=calls.jsonl bash launch/multigpu_check.sh OUT 8 all

Run as a script it only appends its argv to $SHIM_LOG (one JSON list per line) and exits 0, without importing
torch. ``check(path)`` then takes every recorded ``-m MODULE args`` — or ``-m distlab run [torchrun options]
-m MODULE args`` — for modules of distlab and kernels, lets the module's ``main`` build its parser and parse
``args`` (so an unknown flag or a bad value fails exactly as it would on the GPU machine) and stops there,
before any work. Other calls (pytest, a script) are returned as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import sys
import warnings


class _Parsed(BaseException):   # not an Exception: run_study must not catch it
    pass


def target(argv):
    """(module, its args) of one recorded call, or None."""
    if len(argv) < 2 or argv[0] != "-m":
        return None
    module, rest = argv[1], argv[2:]
    if module == "distlab" and rest[:1] == ["run"]:
        if "-m" not in rest:
            return None
        i = rest.index("-m")
        module, rest = rest[i + 1], rest[i + 2:]
    return (module, rest) if module.startswith("distlab") else None


def check(path):
    """(parsed, skipped, errors): modules whose arguments parsed, calls not checked, and 'module args: why'."""
    parsed, skipped, errors = [], [], []
    original, saved_argv = argparse.ArgumentParser.parse_args, sys.argv

    def parse_and_stop(self, a=None, namespace=None):
        original(self, a, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_and_stop
    try:
        for line in open(path):
            argv = json.loads(line)
            t = target(argv)
            if t is None:
                skipped.append(" ".join(argv[:3]))
                continue
            module, args = t
            sys.argv = [module] + args
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)   # runpy: module already imported
                    runpy.run_module(module, run_name="__main__")
                errors.append(f"{module} {' '.join(args)}: returned without parsing its arguments")
            except _Parsed:
                parsed.append(module)
            except SystemExit as e:               # argparse's own error
                errors.append(f"{module} {' '.join(args)}: exit {e.code}: {err.getvalue().strip()[-300:]}")
    finally:
        argparse.ArgumentParser.parse_args, sys.argv = original, saved_argv
    return parsed, skipped, errors


if __name__ == "__main__":
    with open(os.environ.get("SHIM_LOG", os.devnull), "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\n")
