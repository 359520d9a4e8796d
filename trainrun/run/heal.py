"""``distributed.elastic``'s rejoin, the runner's side (:mod:`trainrun.sync.rejoin` is the protocol): the request
`trainrun rejoin RUN` writes (:func:`request`), the command the survivors spawn the new rank with, and the state
it is healed with, from rank 0's memory over MPI, not from a checkpoint on disk (:class:`Heal`): what a
checkpoint holds of a run (the parameters, every optimizer state, the model state, the counters, the data
position, the sync policy's place and tensors), sent as one JSON part and the flat buffers. And the lowest
survivor taking over rank 0's writing when rank 0 is lost (:meth:`Heal.take_over_writing`)."""

from __future__ import annotations

import json
import os
import sys
import time

import yaml

from .. import errors
from ..errors import TrainrunError, UsageError
from ..observe.timer import process_age
from .lock import RunLock

REQUEST_FILE = "rejoin.json"     # in the run directory: `trainrun rejoin RUN` asks the elastic job for a rank back


def request(run_dir: str, host: str | None = None) -> str:
    """`trainrun rejoin RUN_DIR [--host HOST]`: ask the elastic job training in ``run_dir`` to take a rank back (on
    ``host``; by default the survivors' least loaded host); what to print. UsageError where ``run_dir`` is not an
    elastic run's or no job trains in it."""
    run_dir = os.path.abspath(run_dir)
    try:
        with open(os.path.join(run_dir, "config.yaml")) as fh:
            elastic = ((yaml.safe_load(fh) or {}).get("distributed") or {}).get("elastic")
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"{run_dir} is not a run directory (its config.yaml: {e})") from None
    if not elastic:
        raise UsageError(f"{run_dir}: distributed.elastic is not set in its config.yaml; only an elastic run can "
                         f"take a rank back (otherwise: `trainrun resume {run_dir}` on more ranks)")
    lock = RunLock(run_dir, log=lambda _: None)
    try:
        lock.acquire()
    except UsageError:
        pass          # held: a job trains there
    else:
        lock.release()
        raise UsageError(f"{run_dir}: no job trains there now; continue it with `trainrun resume {run_dir}` "
                         f"(under mpirun --with-ft ulfm)")
    path = os.path.join(run_dir, REQUEST_FILE)
    with open(path + ".tmp", "w") as fh:
        json.dump({"time": time.time(), **({"host": host} if host else {})}, fh)
    os.replace(path + ".tmp", path)
    where = f"on {host}" if host else "on the host of theirs with the fewest ranks"
    return (f"asked the job in {run_dir} for a rank back: after its next step its survivors start it {where} (its "
            f"output in the job's); it joins once it is set up (DiLoCo: at an outer step)")


class Heal:
    """The state of ``runner`` (a :class:`trainrun.run.runner.TrainingRunner`) for a rank that rejoins: sent from
    rank 0 (:meth:`state`), taken by the new rank (:meth:`buffers`, then :meth:`apply`)."""

    def __init__(self, runner):
        self.r = runner

    # ------------------------------------------------------------------ rank 0 and the survivors
    def take_over_writing(self, step: int) -> None:
        """Rank 0 was lost during ``step`` (every survivor calls this: :class:`trainrun.sync.elastic.Elastic`).
        The lowest survivor, rank 0 of the shrunk communicator, writes from now on what rank 0 wrote:
        metrics.jsonl and TensorBoard (:meth:`trainrun.observe.metrics.Metrics.take_over`), the checkpoints'
        shared files (the checkpointer took its new rank), the console lines, collective errors, summary.json
        and the export; and it holds the run directory's lock (the lost writer's went with its process), so
        that `trainrun rejoin` finds the job."""
        r = self.r
        r.is_main = r.comm.rank == 0
        if not r.is_main:
            return
        errors.reporter = True
        if r.lock is not None:
            try:
                r.lock.acquire()
            except UsageError as e:     # still held (a writer cut off, not dead): the run goes on without it
                print(f"warning: {e.message}", flush=True)
        r.metrics.take_over(r.out, step - 1, r.cfg.tensorboard.enabled)
        r.log(f"elastic: rank 0 was lost; this rank (launched as rank {r.rank}) writes the metrics, the "
              f"checkpoints and the run's end from now on")

    def let_go(self) -> None:
        """This rank leaves the job with its replica (:meth:`trainrun.sync.elastic.Elastic.leave`): where it wrote,
        its metrics lines flushed and the run directory's lock released, before the others take them over."""
        r = self.r
        if r.is_main:
            r.metrics.close()
            if r.lock is not None:
                r.lock.release()
        r.is_main = False

    def requested(self) -> bool:
        return os.path.exists(os.path.join(self.r.out, REQUEST_FILE))

    def take_request(self) -> tuple[float | None, str | None]:
        """The request's time and host (None: not said), the file removed (rank 0)."""
        path = os.path.join(self.r.out, REQUEST_FILE)
        asked = host = None
        try:
            with open(path) as fh:
                req = json.load(fh)
            asked, host = float(req["time"]), req.get("host")
            host = str(host) if host else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        try:
            os.remove(path)
        except OSError:
            pass
        return asked, host

    def argv(self) -> list[str]:
        """The command the survivors spawn: this process's program on the run directory's config.yaml."""
        main = sys.argv[0]
        program = [sys.executable, "-m", "trainrun"] if os.path.basename(main) == "__main__.py" \
            else [sys.executable, os.path.abspath(main)]
        return [*program, "train", "--config", os.path.join(os.path.abspath(self.r.out), "config.yaml"),
                "--log-level", self.r.cfg.run.log_level]

    def _named(self) -> dict:
        r = self.r
        named = {"params": r.engine.params, **r.shard.state, **r.sync.state}
        if r.engine.state.size:
            named["model_state"] = r.engine.state
        return named

    def state(self) -> tuple[dict, list]:
        """(the JSON part, the buffers in the order it names them): this rank's (rank 0's are sent)."""
        r = self.r
        named = self._named()
        # what a checkpoint's state.json would hold now (the parts registered with the checkpointer), and what
        # it does not: the counters a resume starts afresh
        meta = {"entries": r.checkpoints.entries(), "step": r.step, "nonfinite_in_a_row": r.nonfinite_in_a_row,
                "total_steps": r.total_steps, "saved_step": r.checkpoints.saved_step,
                "arrays": [[name, int(buf.size)] for name, buf in named.items()]}
        return meta, list(named.values())

    # ------------------------------------------------------------------ the rank that rejoins
    def setup_s(self) -> float:
        return process_age() or 0.0

    def buffers(self, meta: dict) -> list:
        """The buffers the state's ``arrays`` fill, this rank's own (the same model and optimizer)."""
        named = self._named()
        mine = [[name, int(buf.size)] for name, buf in named.items()]
        if mine != meta["arrays"]:
            raise TrainrunError(f"rejoining: the job's rank 0 sends {meta['arrays']}, this rank holds {mine}: not "
                                f"the same model and optimizer (the run directory's config.yaml changed?)")
        return list(named.values())

    def apply(self, meta: dict) -> None:
        """The counters, the data position (first rank ``slot``'s slice of each global batch, as the job started
        on ``first_world`` ranks) and the policy's place; the buffers were filled already."""
        r = self.r
        entries = meta["entries"]
        r.load_state_dict({**entries, "step": meta["step"]}, None)      # the counters
        r.nonfinite_in_a_row, r.total_steps = meta["nonfinite_in_a_row"], meta["total_steps"]
        r.sync.total_steps = meta["total_steps"]
        r.loader = r.loader.as_rank(int(meta["slot"]), int(meta["first_world"]))
        r.checkpoints.register("loader", r.loader)       # the rebuilt loader in the old one's place
        r.checkpoints.load_keyed(entries)                # the data position, early stopping, the loss scaler, ...
        r.checkpoints.saved_step = meta["saved_step"]
        r.sync.rejoined(entries)
