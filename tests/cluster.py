"""The pretend cluster of scripts/cluster/cluster.sh as a session fixture, for the tests marked ``cluster``
(`make test-cluster`): two nodes n1, n2 (network namespaces joined by a bridge, each with its own hostname,
/dev/shm and /etc/hosts, pinned to its own core), mpirun launched across them from a "login" namespace.
Where namespaces cannot be made the tests skip saying why, or fail under TRAINRUN_REQUIRE_CLUSTER=1.
The ``slurm`` fixture adds a real SLURM on those nodes (``cluster.sh slurm-up``); where SLURM is not
installed (`make test-cluster` installs it as root with apt-get) its tests skip or fail the same way."""

import hashlib
import os
import shutil
import subprocess

import pytest

from conftest import BIN, MPIRUN, ROOT, TRAINRUN, run

CLUSTER_SH = os.path.join(ROOT, "scripts", "cluster", "cluster.sh")
NODES = 2
_KEY = hashlib.sha256(ROOT.encode()).hexdigest()[:6]     # one cluster per checkout: two never meet
ENV = {"TRAINRUN_CLUSTER_DIR": f"/tmp/trainrun-cluster-{_KEY}", "TRAINRUN_CLUSTER_PREFIX": f"trc{_KEY}",
       "MPIRUN": MPIRUN}


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

    def sh(self, *args, check=0, timeout=120):
        return run([CLUSTER_SH, *args], check=check, timeout=timeout, env=ENV)

    def slurm(self, *args, check=0, timeout=60, env=None):
        """A SLURM client command (sbatch, squeue, scontrol...) on login (sbatch: the job gets ``env``)."""
        return run([CLUSTER_SH, "slurm", *args], check=check, timeout=timeout, env={**ENV, **(env or {})})

    def mpirun_cmd(self, ppn: int, *args, nodes=None, genv=()):
        """The command line of ``trainrun ARGS`` on ``ppn`` ranks on each of ``nodes`` (default all)."""
        nodes = nodes or self.nodes
        flags = [x for k, v in genv for x in ("-genv", k, v)]
        return [CLUSTER_SH, "mpirun", "-hosts", ",".join(nodes), "-ppn", str(ppn), "-np", str(ppn * len(nodes)),
                *flags, TRAINRUN, *args]

    def mpirun(self, ppn: int, *args, nodes=None, genv=(), check=0, timeout=300):
        return run(self.mpirun_cmd(ppn, *args, nodes=nodes, genv=genv), check=check, timeout=timeout, env=ENV)

    def popen(self, ppn: int, *args, log, env=None):
        """``mpirun`` in the background (its output to the file ``log``); the process is mpirun itself."""
        env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), **ENV, **(env or {}))
        with open(log, "w") as fh:
            return subprocess.Popen(self.mpirun_cmd(ppn, *args), stdout=fh, stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="session")
def cluster():
    reason = why_not()
    if reason:
        _skip_or_fail(reason)
    c = Cluster()
    c.sh("up", str(NODES))
    try:
        yield c
    finally:
        c.sh("down")


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
