"""``python -m launch.submit [options] -m MODULE [study flags]`` — see ``distlab/submit.py``."""

from distlab.bench import run_study
from distlab.submit import main

if __name__ == "__main__":
    run_study(main)
