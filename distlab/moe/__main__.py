"""``python -m distlab.moe`` — see ``distlab/moe/study.py``."""

from distlab.bench import run_study
from distlab.moe.study import main

run_study(main)
