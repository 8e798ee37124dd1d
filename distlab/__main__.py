"""``python -m distlab run --nproc 4 -m distlab.cp.ring --seq 8192`` (same as the ``distlab`` command)."""

from distlab.cli import main

main()
