"""``python -m distlab.collectives`` — see ``distlab/collectives/playground.py``."""

from distlab.bench import run_study
from distlab.collectives.playground import main

run_study(main)
