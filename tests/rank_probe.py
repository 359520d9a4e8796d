"""The trainrun command line in this process, for tests that look inside a rank (``mpirun -np N python
tests/rank_probe.py ARGS``): at exit it prints ``PEAK_RSS_KB <rank> <KiB>``, the process's peak resident set
(getrusage: the whole run, set-up to export). ``TRAINRUN_PROBE_GATHER_PIECE=N``: ZeRO-1's checkpoint gathers
the optimizer state in pieces of N elements (``trainrun.sync.update.PIECE``), so a tiny model takes
many. ``TRAINRUN_PROBE_OUTER_DIR=D``: at each DiLoCo outer step each rank saves its replica's weights before it
and the new weights after it (``D/rank<r>_step<s>_{before,after}.npy``, r the launcher's rank, MPICH's or Open
MPI's, or ``joined`` for a rank an elastic job spawned; with ``TRAINRUN_PROBE_OUTER_ALL=1`` at every step).
``TRAINRUN_PROBE_FIRST_DIR=D``: each rank saves its parameters as its first step starts
(``D/rank<r>_first.npy``)."""

import atexit
import os
import resource

RANK = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK", "0")


def _rank() -> str:
    """The launcher's rank, or "joined": a rank an elastic job's survivors spawned (its own world's rank 0;
    Open MPI names its parent's port)."""
    return "joined" if "OMPI_PARENT_PORT" in os.environ else RANK


def _peak() -> None:
    print(f"PEAK_RSS_KB {RANK} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", flush=True)


def _record_outer_steps(out: str) -> None:
    import numpy as np
    from trainrun.sync import diloco
    step_of = diloco.DiLoCo.maybe_outer_step

    def recorded(self, step):
        before = np.array(self.engine.params)
        result = step_of(self, step)
        if result is not None or os.environ.get("TRAINRUN_PROBE_OUTER_ALL"):
            np.save(os.path.join(out, f"rank{_rank()}_step{step}_before.npy"), before)
            np.save(os.path.join(out, f"rank{_rank()}_step{step}_after.npy"), np.array(self.engine.params))
        return result

    diloco.DiLoCo.maybe_outer_step = recorded


def _record_first_step(out: str) -> None:
    import numpy as np
    from trainrun.run import runner
    step_of = runner.TrainingRunner.train_step

    def recorded(self):
        path = os.path.join(out, f"rank{_rank()}_first.npy")
        if not os.path.exists(path):
            np.save(path, np.array(self.engine.params))
        return step_of(self)

    runner.TrainingRunner.train_step = recorded


if __name__ == "__main__":
    atexit.register(_peak)
    from trainrun.cli import main
    if os.environ.get("TRAINRUN_PROBE_GATHER_PIECE"):
        from trainrun.sync import update
        update.PIECE = int(os.environ["TRAINRUN_PROBE_GATHER_PIECE"])
    if os.environ.get("TRAINRUN_PROBE_OUTER_DIR"):
        _record_outer_steps(os.environ["TRAINRUN_PROBE_OUTER_DIR"])
    if os.environ.get("TRAINRUN_PROBE_FIRST_DIR"):
        _record_first_step(os.environ["TRAINRUN_PROBE_FIRST_DIR"])
    main()
