"""``python -m distlab.moe`` — see ``distlab/moe/study.py``."""

from distlab.moe.study import main

main()
