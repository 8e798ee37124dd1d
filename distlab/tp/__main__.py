"""``python -m distlab.tp`` — see ``distlab/tp/study.py``."""

from distlab.bench import run_study
from distlab.tp.study import main

run_study(main)
