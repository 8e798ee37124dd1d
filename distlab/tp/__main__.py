"""``python -m distlab.tp`` — see ``distlab/tp/study.py``."""

from distlab.tp.study import main

main()
