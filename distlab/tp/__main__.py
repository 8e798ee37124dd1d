"""``python -m distlab.tp`` — see ``distlab/tp/study.py``."""

from distlab.tp.study import main
from distlab.profiling import end_process

main()
end_process()  # after a torch profile: exit without the profiler's teardown (distlab.profiling)
