"""The trainrun command line in this process, for tests that look inside a rank (``mpirun -np N python
tests/rank_probe.py ARGS``): at exit it prints ``PEAK_RSS_KB <rank> <KiB>``, the process's peak resident set
(getrusage: the whole run, set-up to export). ``TRAINRUN_PROBE_GATHER_PIECE=N``: ZeRO-1's checkpoint gathers
the optimizer state in pieces of N elements (``trainrun.update._GATHER_CHUNK``), so a tiny model takes
many."""

import atexit
import os
import resource


def _peak() -> None:
    print(f"PEAK_RSS_KB {os.environ.get('PMI_RANK', '0')} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}",
          flush=True)


if __name__ == "__main__":
    atexit.register(_peak)
    from trainrun.cli import main
    if os.environ.get("TRAINRUN_PROBE_GATHER_PIECE"):
        from trainrun import update
        update._GATHER_CHUNK = int(os.environ["TRAINRUN_PROBE_GATHER_PIECE"])
    main()
