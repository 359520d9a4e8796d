"""Fault injection for the tests of what survives what: off unless an environment variable names a
step (``STEP``, every rank) or a rank and a step (``RANK:STEP``), or several of those, comma-separated
(``1:4,2:6``: rank 1 at step 4 and rank 2 at step 6). Read once at import.

* ``TRAINRUN_FAULT_STALL_CHECKPOINT``  the background write of that step's checkpoint hangs (after rank 0
                                       wrote its tensors), so a test can kill or time out a write;
* ``TRAINRUN_FAULT_STALL_TENSORS``     rank 0's write of that step's tensors hangs in the training thread (after
                                       model.safetensors), so a test can signal it mid-save;
* ``TRAINRUN_FAULT_STALL_STEP``        the rank hangs at the start of that step (a stuck data read);
* ``TRAINRUN_FAULT_WAIT_SIGNAL``       the rank waits at the start of that step until a stop signal arrives
                                       or train.max_time passes (a job still running at its time limit,
                                       however fast the steps); ``commit``: after the last step, with its
                                       checkpoint written but not committed; ``export``: rank 0 with
                                       model.onnx written under its temporary name (the signal abandons it);
* ``TRAINRUN_FAULT_KILL_STEP``         the rank kills itself (SIGKILL: no MPI_Finalize, no cleanup) at the start of
                                       that step (a node lost mid-run, distributed.elastic);
* ``TRAINRUN_FAULT_NAN_GRAD``          the rank's gradient holds a NaN after that step's backward;
* ``TRAINRUN_FAULT_SHARED_WINDOWS``    (step 0: set-up) the rank cannot allocate MPI shared-memory windows
                                       (``distributed.intra_node: shared`` falls back to mpi).
"""

from __future__ import annotations

import os
import signal
import time

_SPECS = {k: v for k, v in os.environ.items() if k.startswith("TRAINRUN_FAULT_")}


def hit(name: str, rank: int, step: int | str) -> bool:
    spec = _SPECS.get(f"TRAINRUN_FAULT_{name}")
    if not spec:
        return False
    for one in spec.split(","):
        who, _, when = one.strip().rpartition(":")
        if when == str(step) and who in ("", str(rank)):
            return True
    return False


def kill(name: str, rank: int, step: int) -> None:
    if hit(name, rank, step):
        os.kill(os.getpid(), signal.SIGKILL)


def stall(name: str, rank: int, step: int) -> None:
    if hit(name, rank, step):
        time.sleep(3600)


def wait_until(name: str, rank: int, step: int | str, done) -> None:
    """At the fault's step: wait until ``done()`` (at most an hour)."""
    if hit(name, rank, step):
        end = time.monotonic() + 3600
        while not done() and time.monotonic() < end:
            time.sleep(0.05)
