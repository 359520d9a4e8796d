"""Under a real SLURM (Debian's slurm-wlm) on the pretend cluster of tests/cluster.py: slurmctld on login,
slurmd on n1 and n2, task/affinity binding each task to its cores. `make test-cluster` runs these.

The batch script tested is docs/distributed.md's, as written: sbatch's command line sets the size (2 ranks),
a 1- or 2-minute time limit (SLURM's least is 1) and a short warning; the run directory and
the config are the test's. The first job waits at step 4 until the signal (TRAINRUN_FAULT_WAIT_SIGNAL), so
that it is still running at its time limit however fast the steps are; the requeued job resumes from step 4.
"""

import os
import re
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from cluster import cluster, slurm  # noqa: F401  (the fixtures)
from conftest import MPIRUN, ROOT, TRAINRUN, read_metrics, run, write_config

pytestmark = pytest.mark.cluster

STEPS, STOP = 8, 4
SETS = {"train.max_steps": STEPS, "run.deterministic": True}


def readme_script() -> str:
    text = open(os.path.join(ROOT, "docs", "distributed.md")).read()
    return text.split("\n## SLURM\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]


def _batch_script(tmp_path, cfg: str, *, warning: bool, launcher: str | None = None) -> str:
    script = readme_script()
    subs = [("RUN=runs/gpt2", f"RUN={tmp_path / 'run'}"), ("--config gpt2.yaml", f"--config {cfg}"),
            (".venv/bin/trainrun", TRAINRUN)]
    if not warning:
        subs.append(("#SBATCH --signal=B:USR1@120", "#"))
    if launcher:
        subs.append(("srun --mpi=pmi2 ", launcher + " "))
    for old, new in subs:
        assert script.count(old) == 1, (old, script)
        script = script.replace(old, new)
    path = tmp_path / "job.sh"
    path.write_text(script)
    return str(path)


def _wait_jobs(slurm, jobs: list[str], timeout: float) -> dict:
    """Until the jobs have left the queue (ended for good, not requeued): job -> its scontrol record."""
    end = time.monotonic() + timeout
    while slurm.slurm("squeue", "-h", "-j", ",".join(jobs), "-o", "%T").stdout.strip():
        if time.monotonic() > end:
            slurm.slurm("scancel", *jobs, check=None)
            pytest.fail(f"jobs {jobs} still queued after {timeout} s")
        time.sleep(2)
    return {job: dict(re.findall(r"(\w+)=(\S+)", slurm.slurm("scontrol", "show", "job", job).stdout))
            for job in jobs}


def _reference(cluster, tmp_path, byte_dataset, nodes: int) -> str:
    """The run uninterrupted on the same layout (2 ranks on 1 node take the shared-memory path, whose
    gradient norm differs from the plain path's in the last bits: docs/distributed.md)."""
    out = tmp_path / f"ref-{nodes}-nodes"
    ref = write_config(tmp_path / f"ref-{nodes}.yaml", byte_dataset, **SETS, **{"run.output_dir": str(out)})
    if nodes == 1:
        run([MPIRUN, "-np", "2", TRAINRUN, "--config", ref], check=0)
    else:
        cluster.mpirun(1, "--config", ref, check=0)
    return str(out)


CASES = {   # name: (nodes, ranks per node, launcher in place of `srun --mpi=pmi2`, the --signal warning)
    "warning": (1, 2, None, True),
    "sigterm": (1, 2, None, False),
    "mpirun": (2, 1, f"{MPIRUN} -np $SLURM_NTASKS", True),
}


def test_the_documented_batch_script_requeues_and_resumes_to_the_uninterrupted_weights(slurm, tmp_path, byte_dataset):
    """Three jobs at once (the partition shares cores between jobs): warning: `srun --mpi=pmi2`,
    --signal=B:USR1@30 on a 2-minute limit (USR1 to the batch shell, forwarded by its trap); sigterm: the
    script without --signal, only SLURM's SIGTERM at a 1-minute limit; mpirun: MPICH's
    `mpirun -np $SLURM_NTASKS` for `srun --mpi=pmi2` (hydra starts its proxies with srun) on 2 nodes x 1 rank.
    Each: checkpoint at step 4 -> exit 75 -> scontrol requeue -> the job starts again -> resume -> step 8
    done, the losses and final weights bit for bit those of 8 steps uninterrupted (deterministic mode).
    srun --mpi=pmi2 runs on one node: across nodes the pip MPICH's PMI messages break SLURM 22.05's pmi2
    plugin (docs/distributed.md#slurm). The warning's limit is 2 minutes because SLURM may send it up to
    60 s early: on a 1-minute limit it can come before trainrun has started."""
    jobs = {}
    for case, (nodes, ppn, launcher, warning) in CASES.items():
        d = tmp_path / case
        d.mkdir()
        cfg = write_config(d / "c.yaml", byte_dataset, **SETS)
        script = _batch_script(d, cfg, warning=warning, launcher=launcher)
        options = [f"--nodes={nodes}", f"--ntasks-per-node={ppn}", f"--time={2 if warning else 1}",
                   f"--output={d / 'job.out'}", f"--chdir={d}"] + (["--signal=B:USR1@30"] if warning else [])
        jobs[case] = slurm.slurm("sbatch", "--parsable", *options, script,
                                 env={"TRAINRUN_FAULT_WAIT_SIGNAL": str(STOP)}).stdout.strip().split(";")[0]
    refs = {nodes: _reference(slurm, tmp_path, byte_dataset, nodes) for nodes in (1, 2)}
    records = _wait_jobs(slurm, list(jobs.values()), timeout=300)
    for case, (nodes, _, _, warning) in CASES.items():
        d, record = tmp_path / case, records[jobs[case]]
        text = (d / "job.out").read_text()
        assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (case, record, text)
        # the warning reaches trainrun as USR1 (the trap's); SLURM's SIGTERM at the limit goes to the step's
        # tasks and to the batch shell, whose trap forwards it as USR1: whichever arrives first stops the run
        signals = ("SIGUSR1",) if warning else ("SIGTERM", "SIGUSR1")
        assert any(f"stopped by {sig} after step {STOP}" in text for sig in signals), (case, text)
        assert f"resumed from {d / 'run' / 'checkpoints' / str(STOP)} at step {STOP}" in text, (case, text)
        want, got = read_metrics(refs[nodes])[0], read_metrics(str(d / "run"))[0]
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), case
        assert [got[s]["loss"] for s in got] == [want[s]["loss"] for s in want], case
        a = load_file(os.path.join(refs[nodes], "checkpoints", str(STEPS), "model.safetensors"))
        b = load_file(str(d / "run" / "checkpoints" / str(STEPS) / "model.safetensors"))
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), case


@pytest.mark.parametrize("tasks,cpus", [(2, 1), (1, 2)])
def test_threads_per_rank_are_the_cores_slurm_bound_to_it(slurm, tmp_path, byte_dataset, tasks, cpus):
    """engine.threads 0 under SLURM's task/affinity: each task's mask is already its own (-c cores,
    disjoint), so a rank's threads are its mask's cores, not those divided again by the ranks on the node."""
    shape = ["--mpi=pmi2", "--nodes=1", f"--ntasks={tasks}", f"--cpus-per-task={cpus}", "--time=1"]
    masks = slurm.slurm("srun", *shape, "grep", "Cpus_allowed_list", "/proc/self/status").stdout.split()
    masks = [m for m in masks if m[0].isdigit()]
    cores = [len(os.sched_getaffinity(0) & set(range(int(m.split("-")[0]), int(m.split("-")[-1]) + 1)))
             for m in [x for m in masks for x in m.split(",")]]
    assert len(masks) == tasks and all(c == cpus for c in cores), masks
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 1, "engine.threads": 0})
    out = slurm.slurm("srun", *shape, TRAINRUN, "--config", cfg, "--log-level", "devinfo", timeout=120).stdout
    threads = re.findall(r"local rank \d of (\d+) \| device cpu \| (\d+) thread\(s\)", out)
    assert threads == [(str(tasks), str(cpus))] * tasks, out
