"""The two kinds of failure users see, with the exit codes of the contract.

* ``UsageError`` (exit 2): the user asked for something wrong (bad config, bad
  file, bad flag). Every problem is listed; no traceback.
* ``TrainrunError`` (exit 1): anything else that stops a run, with a one-line
  cause; the traceback only at ``--log-level verbose``.

An error every rank raises from the same agreed value is *collective*
(:func:`collective`): the job then ends normally with its exit code, with no MPI
abort, and rank 0 alone reports it (the launcher's, or the survivor that took over
an elastic run's writing: :data:`reporter`).
"""

from __future__ import annotations


class TrainrunError(Exception):
    exit_code = 1

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.message = message
        self.problems = list(problems or [])

    def render(self) -> str:
        lines = [f"trainrun: error: {self.message}"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


class UsageError(TrainrunError):
    exit_code = 2


class PeerLost(TrainrunError):
    """A collective failed because a peer rank died (MPI's fault tolerance, ULFM: ``MPI_ERR_PROC_FAILED``) or
    because a peer revoked the communicator after seeing a death (``MPI_ERR_REVOKED``). Raised only by an
    elastic communicator (``distributed.elastic``); :mod:`trainrun.sync.elastic` drops the dead and goes on."""


# True where this process reports collective errors although the launcher did not make it rank 0 (an elastic run
# whose rank 0 was lost: trainrun.run.runner.TrainingRunner.take_over_writing); None: the launcher's rank 0 does
reporter: bool | None = None


def collective(exc: TrainrunError) -> TrainrunError:
    """Mark ``exc`` as raised by every rank from the same agreed value; returns it."""
    exc.collective = True
    return exc
