"""The pretend cluster of scripts/cluster/cluster.sh as a session fixture, for the tests marked ``cluster``
(`make test-cluster`): two nodes n1, n2 (network namespaces joined by a bridge, each with its own hostname,
/dev/shm and /etc/hosts, pinned to its own core), mpirun launched across them from a "login" namespace.
Where namespaces cannot be made the tests skip saying why, or fail under TRAINRUN_REQUIRE_CLUSTER=1.
The ``slurm`` fixture adds a real SLURM on those nodes (``cluster.sh slurm-up``); where SLURM is not
installed (`make test-cluster` installs it as root with apt-get) its tests skip or fail the same way.
The ``ft_cluster`` fixture is another cluster of three nodes for elastic runs on Open MPI (``cluster.sh ompi``,
the elastic venv of tests/test_elastic.py: skipped, saying so, without it; failed under
TRAINRUN_REQUIRE_CLUSTER=1).
TRAINRUN_CLUSTER_DIR and TRAINRUN_CLUSTER_PREFIX, where set, name the clusters' state and namespaces (the
elastic one's with "-ft" and "f" added), so that two sessions on one machine do not meet."""

import hashlib
import os
import shutil
import subprocess

import pytest

from conftest import BIN, MPIRUN, ROOT, TRAINRUN, run

CLUSTER_SH = os.path.join(ROOT, "scripts", "cluster", "cluster.sh")
NODES = 2
_KEY = hashlib.sha256(ROOT.encode()).hexdigest()[:6]     # one cluster per checkout: two never meet
ENV = {"TRAINRUN_CLUSTER_DIR": os.environ.get("TRAINRUN_CLUSTER_DIR") or f"/tmp/trainrun-cluster-{_KEY}",
       "TRAINRUN_CLUSTER_PREFIX": os.environ.get("TRAINRUN_CLUSTER_PREFIX") or f"trc{_KEY}", "MPIRUN": MPIRUN}
FT_NODES = 3
FT_VENV = os.environ.get("TRAINRUN_ELASTIC_VENV") or os.path.join(ROOT, ".venv-elastic")
FT_ENV = {**ENV, "TRAINRUN_CLUSTER_DIR": ENV["TRAINRUN_CLUSTER_DIR"] + "-ft",
          "TRAINRUN_CLUSTER_PREFIX": ENV["TRAINRUN_CLUSTER_PREFIX"] + "f",
          "OMPIRUN": os.path.join(FT_VENV, "bin", "mpirun")}


def why_not() -> str | None:
    """Why this machine cannot build the cluster, or None."""
    if os.geteuid() != 0:
        return "the cluster's namespaces need root"
    missing = [t for t in ("unshare", "nsenter", "ip", "tc", "taskset") if not shutil.which(t)]
    if missing:
        return f"the cluster needs {', '.join(missing)}"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "--ipc", "--pid", "--fork", "true"],
                           capture_output=True, text=True)
    if probe.returncode:
        return f"cannot make namespaces here: {probe.stderr.strip()}"
    return None


SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "srun")


def slurm_why_not() -> str | None:
    missing = [t for t in SLURM_TOOLS if not shutil.which(t) and not os.path.exists(f"/usr/sbin/{t}")]
    if missing:
        return (f"SLURM is not installed (no {', '.join(missing)}; `make test-cluster` installs Debian's "
                f"slurm-wlm and munge as root: scripts/cluster/cluster.sh install-slurm)")
    return None


def _skip_or_fail(reason: str):
    if os.environ.get("TRAINRUN_REQUIRE_CLUSTER") == "1":
        pytest.fail(f"TRAINRUN_REQUIRE_CLUSTER=1 but {reason}")
    pytest.skip(reason)


class Cluster:
    nodes = [f"n{i}" for i in range(1, NODES + 1)]
    env = ENV

    def sh(self, *args, check=0, timeout=120):
        return run([CLUSTER_SH, *args], check=check, timeout=timeout, env=self.env)

    def slurm(self, *args, check=0, timeout=60, env=None):
        """A SLURM client command (sbatch, squeue, scontrol...) on login (sbatch: the job gets ``env``)."""
        return run([CLUSTER_SH, "slurm", *args], check=check, timeout=timeout, env={**self.env, **(env or {})})

    def mpirun_cmd(self, ppn: int, *args, nodes=None, genv=()):
        """The command line of ``trainrun ARGS`` on ``ppn`` ranks on each of ``nodes`` (default all)."""
        nodes = nodes or self.nodes
        flags = [x for k, v in genv for x in ("-genv", k, v)]
        return [CLUSTER_SH, "mpirun", "-hosts", ",".join(nodes), "-ppn", str(ppn), "-np", str(ppn * len(nodes)),
                *flags, TRAINRUN, *args]

    def mpirun(self, ppn: int, *args, nodes=None, genv=(), check=0, timeout=300):
        return run(self.mpirun_cmd(ppn, *args, nodes=nodes, genv=genv), check=check, timeout=timeout, env=self.env)

    def popen(self, ppn: int, *args, log, env=None):
        """``mpirun`` in the background (its output to the file ``log``); the process is mpirun itself."""
        env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), **self.env, **(env or {}))
        with open(log, "w") as fh:
            return subprocess.Popen(self.mpirun_cmd(ppn, *args), stdout=fh, stderr=subprocess.STDOUT, env=env)


def _up(c: Cluster):
    """``c``'s nodes made for the session's tests, taken down after them."""
    c.sh("up", str(len(c.nodes)))
    try:
        yield c
    finally:
        c.sh("down")


@pytest.fixture(scope="session")
def cluster():
    reason = why_not()
    if reason:
        _skip_or_fail(reason)
    yield from _up(Cluster())


@pytest.fixture(scope="session")
def slurm(cluster):
    """The cluster with slurmctld on login and slurmd on every node (partition "nodes")."""
    reason = slurm_why_not()
    if reason:
        _skip_or_fail(reason)
    cluster.sh("slurm-up", check=0)
    try:
        yield cluster
    finally:
        cluster.sh("slurm-down")


class FTCluster(Cluster):
    """Three nodes, one rank each, Open MPI's mpirun with its fault tolerance (``cluster.sh ompi --with-ft ulfm``)."""
    nodes = [f"n{i}" for i in range(1, FT_NODES + 1)]
    env = FT_ENV

    def ompi_start(self, *args, log, env=None) -> subprocess.Popen:
        """``mpirun --with-ft ulfm`` of the elastic venv, one rank on each node (``--map-by node``; OVERSUBSCRIBE:
        a slot of a dead rank is not given back, and a rank spawned to rejoin needs one), ``trainrun ARGS`` with
        ``env`` (and PYTHONPATH: this checkout's code) forwarded to the ranks; its output to the file ``log``; a
        session of its own (:func:`stop`)."""
        env = {"PYTHONPATH": ROOT, **(env or {})}
        cmd = [CLUSTER_SH, "ompi", "--with-ft", "ulfm", "--map-by", "node:OVERSUBSCRIBE",
               "--host", ",".join(f"{n}:1" for n in self.nodes), "-np", str(len(self.nodes)),
               *[a for k, v in env.items() for a in ("-x", f"{k}={v}")], os.path.join(FT_VENV, "bin", "trainrun"),
               *args]
        with open(log, "w") as fh:
            return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=dict(os.environ, **self.env))

    @staticmethod
    def stop(proc: subprocess.Popen, timeout: float) -> int:
        """``proc``'s exit status; past ``timeout`` seconds its whole session is killed and the test fails."""
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise AssertionError(f"{proc.args} ran past {timeout} s") from None


def ft_why_not() -> str | None:
    """Why the elastic venv cannot run an elastic job across the nodes here, or None."""
    for tool in ("mpirun", "ompi_info", "trainrun"):
        if not os.access(os.path.join(FT_VENV, "bin", tool), os.X_OK):
            return f"no Open MPI venv with trainrun at {FT_VENV} (its bin/{tool} is missing): make setup-elastic"
    return None


@pytest.fixture(scope="session")
def ft_cluster():
    reason = why_not() or ft_why_not()
    if reason:
        _skip_or_fail(reason)
    yield from _up(FTCluster())
