"""``python -m distlab.collectives`` — see ``distlab/collectives/playground.py``."""

from distlab.collectives.playground import main

main()
