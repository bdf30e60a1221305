import os

# Every test process (and the ranks it spawns) uses one thread: the machine has 2 cores
# and multi-process tests oversubscribe it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
