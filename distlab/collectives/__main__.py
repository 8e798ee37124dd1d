"""``python -m distlab.collectives`` — see ``distlab/collectives/playground.py``."""

from distlab.collectives.playground import main
from distlab.profiling import end_process

main()
end_process()  # after a torch profile: exit without the profiler's teardown (distlab.profiling)
