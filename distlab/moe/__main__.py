"""``python -m distlab.moe`` — see ``distlab/moe/study.py``."""

from distlab.moe.study import main
from distlab.profiling import end_process

main()
end_process()  # after a torch profile: exit without the profiler's teardown (distlab.profiling)
