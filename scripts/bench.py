"""`make bench`: trainrun's benchmark suite (scripts/bench/run.py), which regenerates BENCHMARKS.md.

    .venv/bin/python scripts/bench.py [--quick] [any option of scripts/bench/run.py]
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, os.path.join(HERE, "bench", "run.py"), *sys.argv[1:]])
