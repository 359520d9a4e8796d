"""Across nodes for real: trainrun on the pretend cluster of tests/cluster.py (2 nodes, each its own
hostname, /dev/shm, network and core; /tmp the shared filesystem). `make test-cluster` runs these; they
are not in `make test`. 2 nodes x 1 rank where a run trains many steps (2 cores in all), 2 x 2 where the
ranks of one node matter (doctor, shared memory). distributed.elastic on 3 nodes x 1 rank (Open MPI's
ULFM, the elastic venv): a node's ranks killed, the node taken back with `trainrun rejoin`."""

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from cluster import cluster, ft_cluster  # noqa: F401  (the fixtures)
from conftest import MPIRUN, TRAINRUN, rank_pids, read_metrics, run, write_config

pytestmark = pytest.mark.cluster


def _lines(out: str, first: str) -> list[str]:
    return [line for line in out.splitlines() if line.split()[:2] == ["PASS", first]]


def test_doctor_groups_ranks_by_node_and_measures_the_link_apart(cluster, tmp_path, byte_dataset):
    """2 x 2 ranks: nodes are training's (MPI's shared-memory nodes), also when both nodes carry one
    hostname; the inter-node busbw (one rank per node) is reported apart from the intra-node one."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset)
    out = cluster.mpirun(2, "doctor", "--config", cfg, "--size-mb", "1", "--iters", "2").stdout
    assert out.splitlines()[0] == "trainrun doctor: 4 rank(s) on 2 node(s) (n1: rank(s) 0, 1; n2: rank(s) 2, 3)"
    assert "over 2 rank(s)" in _lines(out, "intra-node")[0] and "on each node" in _lines(out, "intra-node")[0]
    assert "busbw" in _lines(out, "inter-node")[0] and "one rank per node" in _lines(out, "inter-node")[0]
    assert _lines(out, "run_dir") and _lines(out, "data.train"), out
    try:
        for node in cluster.nodes:
            cluster.sh("exec", node, "hostname", "node")
        out = cluster.mpirun(1, "doctor", "--size-mb", "1", "--iters", "1").stdout
    finally:
        for node in cluster.nodes:
            cluster.sh("exec", node, "hostname", node)
    assert out.splitlines()[0] == "trainrun doctor: 2 rank(s) on 2 node(s) (node: rank(s) 0; node: rank(s) 1)"
    assert _lines(out, "inter-node"), out


def test_two_nodes_train_as_one_node_and_resume_across_node_counts(cluster, tmp_path, byte_dataset):
    """ZeRO-1, deterministic mode: 2 nodes x 1 rank for steps 1-4, 1 node x 2 ranks for 5-8, 2 nodes again
    for 9-12, each resuming the last one's checkpoint, give bit for bit the losses and final weights of
    12 steps on 1 node x 2 ranks."""
    sets = {"train.max_steps": 12, "checkpoint.every": 4, "distributed.zero_stage": 1, "run.deterministic": True}
    ref = write_config(tmp_path / "ref.yaml", byte_dataset, **sets, **{"run.output_dir": str(tmp_path / "ref")})
    run([MPIRUN, "-np", "2", TRAINRUN, "--config", ref], check=0)
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **sets)
    out = str(tmp_path / "run")
    cluster.mpirun(1, "--config", cfg, "--set", "train.stop_at=4")
    run([MPIRUN, "-np", "2", TRAINRUN, "resume", out, "--set", "train.stop_at=8"], check=0)
    cluster.mpirun(1, "resume", out)
    want, got = read_metrics(str(tmp_path / "ref"))[0], read_metrics(out)[0]
    assert sorted(got) == sorted(want) == list(range(1, 13))
    assert [got[s]["loss"] for s in got] == [want[s]["loss"] for s in want]
    a = load_file(str(tmp_path / "ref" / "checkpoints" / "12" / "model.safetensors"))
    b = load_file(os.path.join(out, "checkpoints", "12", "model.safetensors"))
    assert all(np.array_equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


def _shared_maps(pid: int) -> dict:
    maps = {}
    for line in open(f"/proc/{pid}/maps"):
        f = line.split()
        if len(f) >= 6 and f[1][3] == "s" and f[5].startswith("/dev/shm/mpich_shm"):     # MPICH's shared windows
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            maps[(f[3], f[4], " ".join(f[5:]))] = hi - lo
    return maps


def test_parameters_once_per_node_and_a_rank_killed_on_the_other_node(cluster, tmp_path, byte_dataset):
    """2 x 2 ranks, intra_node shared: each node's two ranks map the same shared pages (>= 3 x 4 bytes a
    parameter: parameters once, two gradient buffers) of MPICH's windows in its /dev/shm, the nodes none in
    common. Rank 3 (on n2, not mpirun's node), hung at step 4, is SIGKILLed: the job ends well within
    distributed.timeout_s and the committed checkpoints 1 and 2 are complete."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 6, "checkpoint.every": 1, "distributed.timeout_s": 120})
    run([TRAINRUN, "prepare", "--config", cfg], check=0)
    log = tmp_path / "log"
    proc = cluster.popen(2, "--config", cfg, "--log-level", "devinfo", log=log,
                         env={"TRAINRUN_FAULT_STALL_STEP": "3:4"})
    try:
        ckpts, pids = tmp_path / "run" / "checkpoints", {}
        for _ in range(300):
            pids = rank_pids(str(tmp_path))
            if len(pids) == 4 and (ckpts / "2" / "COMMITTED").exists():
                break
            time.sleep(0.5)
        assert len(pids) == 4 and (ckpts / "2" / "COMMITTED").exists(), log.read_text()
        n = json.load(open(tmp_path / "run" / "graphs" / "manifest.json"))["num_params"]
        maps = {r: _shared_maps(pid) for r, pid in pids.items()}
        for a, b in ((0, 1), (2, 3)):
            assert sum(maps[a][k] for k in set(maps[a]) & set(maps[b])) >= 3 * 4 * n, (a, b)
        assert maps[0] and maps[2] and not set(maps[0]) & set(maps[2])      # two /dev/shm: two copies
        text = log.read_text()
        assert "[rank 0] intra-node: shared (node rank 0 of 2, node 0 of 2;" in text
        assert "[rank 3] intra-node: shared (node rank 1 of 2, node 1 of 2;" in text
        t0 = time.monotonic()
        os.kill(pids[3], signal.SIGKILL)
        proc.wait(timeout=120)
        assert proc.returncode != 0 and time.monotonic() - t0 < 60, log.read_text()
    finally:
        for pid in rank_pids(str(tmp_path)).values():
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for step in ("1", "2"):
        assert (ckpts / step / "COMMITTED").exists()
        assert load_file(str(ckpts / step / "model.safetensors")).keys()
        assert load_file(str(ckpts / step / "optimizer.safetensors")).keys()
    # nothing half-written counts: the newest committed checkpoint resumes (on one rank, the same global batch)
    proc = run([TRAINRUN, "resume", str(tmp_path / "run"), "--set", "train.max_steps=3",
                "--set", "train.gradient_accumulation_steps=4"], check=0)
    assert "resumed" in proc.stdout


def test_sigterm_to_mpirun_stops_with_75_and_resumes_across_the_nodes(cluster, tmp_path, byte_dataset):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 100000})
    run([TRAINRUN, "prepare", "--config", cfg], check=0)
    log = tmp_path / "log"
    proc = cluster.popen(1, "--config", cfg, log=log)
    metrics = tmp_path / "run" / "metrics.jsonl"
    for _ in range(240):
        if metrics.exists() and metrics.read_text().count("\n") >= 3:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 75, log.read_text()
    step = max(read_metrics(str(tmp_path / "run"))[0])
    assert (tmp_path / "run" / "checkpoints" / str(step) / "COMMITTED").exists()
    out = cluster.mpirun(1, "resume", str(tmp_path / "run"), "--set", f"train.max_steps={step + 2}").stdout
    assert f"checkpoints/{step} at step {step} (saved by 2 rank(s)" in out, out
    assert max(read_metrics(str(tmp_path / "run"))[0]) == step + 2


def test_a_run_directory_not_shared_names_the_hosts_that_cannot_see_it(cluster, tmp_path, byte_dataset):
    """A tmpfs over the run directory's parent on n2 only: rank 1's host sees another directory."""
    private = tmp_path / "private"
    private.mkdir()
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"run.output_dir": str(private / "run")})
    cluster.sh("exec", "n2", "mount", "-t", "tmpfs", "tmpfs", str(private))
    try:
        proc = cluster.mpirun(1, "--config", cfg, check=2)
    finally:
        cluster.sh("exec", "n2", "umount", str(private))
    assert (f"run.output_dir {private / 'run'} is not shared: host(s) n2 (rank(s) 1) cannot see the graphs "
            f"rank 0 prepared there") in proc.stderr, proc.stderr


def test_a_small_dev_shm_on_one_node_falls_back_instead_of_crashing(cluster, tmp_path, byte_dataset):
    """n2's /dev/shm at 16 MB (where UCX's posix transport made MPI_Init segfault): trainrun leaves that
    transport out there, and intra_node: shared falls back to mpi with its warning."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 2})
    cluster.sh("shm", "n2", "16m")
    try:
        proc = cluster.mpirun(2, "--config", cfg, check=0)
    finally:
        cluster.sh("shm", "n2", os.environ.get("SHM_SIZE", "256m"))
    assert "falling back to intra_node: mpi" in proc.stderr and "/dev/shm has" in proc.stderr, proc.stderr
    assert max(read_metrics(str(tmp_path / "run"))[0]) == 2


def _tx_bytes(cluster, node: str) -> int:
    return int(cluster.sh("exec", node, "cat", "/sys/class/net/eth0/statistics/tx_bytes", check=0).stdout)


def test_bf16_on_the_wire_halves_the_bytes_the_link_carries(cluster, tmp_path, byte_dataset):
    """2 nodes x 1 rank: the bytes n1's network interface sent per step (counted by the kernel: the difference
    between runs of 10 and 30 steps, so start-up's traffic cancels) are fp32's `wire_bytes_per_step` give or
    take the TCP/IP headers, and half of them with distributed.reduce_dtype: bf16 (measured: 172,364 and 86,345
    bytes a step for the tiny GPT-2's 171,520 and 85,760 counted)."""
    per_step = {}
    for dtype in ("fp32", "bf16"):
        sent = {}
        for steps in (10, 30):
            out = tmp_path / f"{dtype}-{steps}"
            cfg = write_config(tmp_path / f"{dtype}-{steps}.yaml", byte_dataset, **{
                "run.output_dir": str(out), "train.max_steps": steps, "distributed.reduce_dtype": dtype,
                "train.log_every": 10})
            before = _tx_bytes(cluster, "n1")
            cluster.mpirun(1, "--config", cfg)
            sent[steps] = _tx_bytes(cluster, "n1") - before
        per_step[dtype] = (sent[30] - sent[10]) / 20
        counted = json.load(open(out / "summary.json"))["wire_bytes_per_step"]
        # a little below `counted` too: start-up's traffic moves by ~10 KB from run to run (500 bytes a step
        # over these 20; one CI run measured 85,725 for bf16's 85,760)
        assert 0.97 * counted <= per_step[dtype] <= 1.25 * counted + 2000, (dtype, per_step[dtype], counted)
    assert 0.45 <= per_step["bf16"] / per_step["fp32"] <= 0.55, per_step


def test_overlapped_buckets_across_nodes_give_one_allreduces_bits(cluster, tmp_path, byte_dataset):
    """2 nodes x 1 rank over a link shaped to 100 Mbit/s (the buckets' allreduces still in flight while the
    next segments compute): distributed.overlap_grad_reduce with buckets of ~8 KB trains bit for bit as one
    allreduce after the backward pass, fp32 and bf16; the run says it used its buckets."""
    cluster.sh("rate", "100mbit", check=0)
    try:
        got = {}
        for dtype in ("fp32", "bf16"):
            for overlap in (False, True):
                out = tmp_path / f"{dtype}-{overlap}"
                cfg = write_config(tmp_path / f"{dtype}-{overlap}.yaml", byte_dataset, **{
                    "run.output_dir": str(out), "train.max_steps": 8, "distributed.reduce_dtype": dtype,
                    "distributed.overlap_grad_reduce": overlap, "distributed.bucket_mb": 0.008})
                cluster.mpirun(1, "--config", cfg)
                summary = json.load(open(out / "summary.json"))
                assert (summary["grad_buckets"] > 4) == overlap, summary
                got[dtype, overlap] = [(r["loss"], r["grad_norm"]) for _, r in sorted(read_metrics(str(out))[0].items())]
            assert len(got[dtype, True]) == 8 and got[dtype, True] == got[dtype, False], dtype
    finally:
        cluster.sh("rate", "off", check=0)


def test_diloco_across_nodes_matches_two_replicas_on_one_machine(cluster, tmp_path, byte_dataset):
    """distributed.sync: diloco on 2 nodes x 2 ranks, group 0: each node a replica whose ranks share its
    parameters and reduce every step in shared memory; only the outer steps (3, 6, the last: 8) cross the
    link. Losses, evaluations on the global weights and final weights bit for bit those of 4 ranks on one
    machine as 2 pretend nodes (TRAINRUN_RANKS_PER_NODE=2); n1's interface carries less than half of what
    every-step training of the same 8 steps sends (3 outer steps against 8 gradient reductions, the same
    start-up; measured: 575,255 and 1,437,599 bytes)."""
    sets = {"train.max_steps": 8, "train.micro_batch_size": 2, "train.eval_every": 4, "distributed.sync": "diloco",
            "distributed.diloco.inner_steps": 3}
    ref = write_config(tmp_path / "ref.yaml", byte_dataset, **sets, **{"run.output_dir": str(tmp_path / "ref")})
    run([MPIRUN, "-np", "4", TRAINRUN, "--config", ref], check=0, env={"TRAINRUN_RANKS_PER_NODE": "2"})
    sent, out = {}, {}
    for sync in ("diloco", "every_step"):
        cfg = write_config(tmp_path / f"{sync}.yaml", byte_dataset, **{**sets, "distributed.sync": sync,
                                                                       "run.output_dir": str(tmp_path / sync)})
        before = _tx_bytes(cluster, "n1")
        out[sync] = cluster.mpirun(2, "--config", cfg).stdout
        sent[sync] = _tx_bytes(cluster, "n1") - before
    assert "diloco: 2 replicas of 2 rank(s)" in out["diloco"]
    rows = {}
    for d in ("ref", "diloco"):
        lines = [json.loads(line) for line in open(tmp_path / d / "metrics.jsonl")]
        rows[d] = [{k: v for k, v in r.items() if k in ("step", "loss", "grad_norm", "eval_loss", "outer_drift",
                                                        "outer_bytes")} for r in lines]
    assert rows["diloco"] == rows["ref"]
    assert [r["step"] for r in rows["ref"] if "outer_bytes" in r] == [3, 6, 8]
    final = [open(tmp_path / d / "checkpoints" / "8" / "model.safetensors", "rb").read() for d in ("ref", "diloco")]
    assert final[0] == final[1]
    assert sent["diloco"] < 0.5 * sent["every_step"], sent


# ----------------------------------------------------------------------------- elastic: a node lost and taken back

def _rows(run_dir) -> list[dict]:
    """metrics.jsonl's whole lines (the last one may be half-written while the job runs)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    text = open(path).read()
    return [json.loads(line) for line in text.splitlines()[:None if text.endswith("\n") else -1]]


def _until(what, proc, log, timeout=180):
    deadline = time.monotonic() + timeout
    while not what():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def _lose_and_rejoin_n3(ft_cluster, tmp_path, cfg, kill_step: int, join_by: int,
                        host: str | None = None) -> tuple[str, list[dict]]:
    """The elastic job on n1, n2, n3 (rank 2 on n3, hung at the start of ``kill_step`` so that its death falls in
    a known step); once rank 0 logged the step before, every trainrun process on n3 is SIGKILLed (`cluster.sh
    kill n3 /bin/trainrun`: the node's ranks; mpirun's daemon there lives, see docs/distributed.md); once a step line
    says 2 replicas, the node is back (its namespaces and address stayed) and `trainrun rejoin RUN` asks for the
    rank (``host``: `--host HOST`, on that host); the survivors wait after step ``join_by`` until it joined
    (TRAINRUN_FAULT_WAIT_JOIN). The job's output and its step lines."""
    out, log = str(tmp_path / "run"), tmp_path / "log"
    proc = ft_cluster.ompi_start("--config", cfg, log=log, env={"TRAINRUN_FAULT_STALL_STEP": f"2:{kill_step}",
                                                               "TRAINRUN_FAULT_WAIT_JOIN": str(join_by)})
    try:
        _until(lambda: any(r.get("step") == kill_step - 1 for r in _rows(out)), proc, log)
        killed = ft_cluster.sh("kill", "n3", "/bin/trainrun").stdout.split()
        assert killed, log.read_text()
        _until(lambda: any(r.get("replicas") == 2 for r in _rows(out)), proc, log)
        asked = run([TRAINRUN, "rejoin", out, *(["--host", host] if host else [])], check=0).stdout
        assert asked.startswith(f"asked the job in {out} for a rank back"), asked
        assert f"start it on {host} " in asked if host else "with the fewest ranks" in asked, asked
        assert ft_cluster.stop(proc, 240) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return log.read_text(), [r for r in _rows(out) if "loss" in r]


def _fault_free(tmp_path, byte_dataset, sets: dict, steps: int, seed: int) -> float:
    """The same run without a fault, on 3 ranks of this machine (MPICH), ``steps`` steps; its final evaluation
    loss."""
    out = tmp_path / f"ref-{seed}-{steps}"
    cfg = write_config(tmp_path / f"ref-{seed}-{steps}.yaml", byte_dataset, **{
        **sets, "distributed.elastic": False, "train.max_steps": steps, "run.seed": seed, "run.output_dir": str(out)})
    run([MPIRUN, "-np", "3", TRAINRUN, "--config", cfg], check=0)
    return [r for r in _rows(str(out)) if "eval_loss" in r][-1]["eval_loss"]


def _as_good_as_fault_free(tmp_path, byte_dataset, sets: dict, steps: list[dict]) -> dict:
    """The faulted run's final evaluation loss against fault-free runs (seed 5, its own): no worse than one at its
    tokens (fewer steps: its steps on 2 replicas trained 2/3 of the tokens), no better than one at its steps (more
    tokens), each give or take the spread of two seeds at its tokens (seeds 5 and 6, at least 0.05: their distance
    is itself a draw). A rank healed with stale or foreign state, or a reduce that summed over a dead rank, would
    fall outside (losses of 3.3-3.5 here, the seeds 0.01-0.02 apart). The numbers, for the log."""
    tokens = sum(r["replicas"] for r in steps) * sets["train.micro_batch_size"] * 32
    at_tokens = round(tokens / (3 * sets["train.micro_batch_size"] * 32))
    got = [r for r in _rows(str(tmp_path / "run")) if "eval_loss" in r][-1]["eval_loss"]
    ref = {seed: _fault_free(tmp_path, byte_dataset, sets, at_tokens, seed) for seed in (5, 6)}
    more = _fault_free(tmp_path, byte_dataset, sets, len(steps), 5)
    tol = max(abs(ref[5] - ref[6]), 0.05)
    assert more - tol <= got <= ref[5] + tol, (got, ref, more)
    return {"faulted": round(got, 4), f"fault-free at its tokens ({at_tokens} steps), seeds 5, 6":
            (round(ref[5], 4), round(ref[6], 4)), f"at its steps ({len(steps)})": round(more, 4)}


_SETS = {"train.micro_batch_size": 4, "train.log_every": 1, "train.eval_steps": 4, "checkpoint.every": 0,
         "lr_schedule.name": "constant", "distributed.elastic": True}


def test_every_step_a_node_lost_and_taken_back(ft_cluster, tmp_path, byte_dataset):
    """3 nodes x 1 rank, every-step: n3's rank killed in step 8 (SIGKILL to every trainrun process there): n1 and
    n2 train on (step lines: 3 replicas, then 2); `trainrun rejoin` once the node is back: a rank is spawned,
    healed from rank 0 over MPI and taken in by step 20; the run ends on 3 replicas (step lines 3 again), every
    rank with the same bits, its final evaluation loss as good as a fault-free run's at the same tokens."""
    sets = {**_SETS, "train.max_steps": 30}
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **sets)
    t0 = time.monotonic()
    out, steps = _lose_and_rejoin_n3(ft_cluster, tmp_path, cfg, kill_step=8, join_by=20, host="n2")
    assert "elastic: rank(s) 2 lost during step 8; 2 replica(s) go on" in out, out
    # spawned onto the host `trainrun rejoin --host` named, a survivor's node, not onto n3 (docs/distributed.md)
    spawned = next(ln for ln in out.splitlines() if ln.startswith("elastic: a rank spawned after step"))
    assert "to take rank 2's place" in spawned and ", on n2)" in spawned, spawned
    joined = next(ln for ln in out.splitlines() if ln.startswith("elastic: rank 2 joined after step"))
    after = int(joined.split()[6])
    assert 8 <= after <= 20, joined
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert [r["replicas"] for r in steps] == [3] * 7 + [2] * (after - 7) + [3] * (30 - after)
    final = tmp_path / "run" / "checkpoints" / "30"
    assert len({json.loads((final / f"rank-{r}.json").read_text())["params_sha256"] for r in range(3)}) == 1
    print(f"every-step: faulted {time.monotonic() - t0:.1f} s; eval loss (faulted, fault-free seeds 5 and 6): "
          f"{_as_good_as_fault_free(tmp_path, byte_dataset, sets, steps)}")


def test_diloco_a_node_lost_and_taken_back_at_an_outer_step(ft_cluster, tmp_path, byte_dataset):
    """3 nodes x 1 rank, DiLoCo (a replica a node, an outer step every 4 steps): n3's rank killed in step 6 (a world
    step: log_every 1 reduces every step's scalars); the outer steps of steps 8-16 average over the 2 alive;
    `trainrun rejoin` once the node is back: taken in right after the outer step of step 16, the outer steps
    average over 3 again; the final evaluation loss as good as a fault-free DiLoCo run's (as every-step's)."""
    sets = {**_SETS, "train.max_steps": 32, "distributed.sync": "diloco",
            "distributed.diloco": {"inner_steps": 4, "group": 1,
                                   "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}}
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **sets)
    t0 = time.monotonic()
    out, steps = _lose_and_rejoin_n3(ft_cluster, tmp_path, cfg, kill_step=6, join_by=16)
    assert "elastic: rank(s) 2 lost during step 6; 2 replica(s) go on" in out, out
    joined = next(ln for ln in out.splitlines() if ln.startswith("elastic: rank 2 joined after step"))
    assert int(joined.split()[6]) == 16, joined
    with open(tmp_path / "run" / "metrics.jsonl") as fh:
        outer = {r["step"]: r["outer_replicas"] for r in map(json.loads, fh) if "outer_bytes" in r}
    assert outer == {4: 3, 8: 2, 12: 2, 16: 2, 20: 3, 24: 3, 28: 3, 32: 3}, outer
    assert [r["replicas"] for r in steps][-1] == 3
    print(f"diloco: faulted {time.monotonic() - t0:.1f} s; eval loss (faulted, fault-free seeds 5 and 6): "
          f"{_as_good_as_fault_free(tmp_path, byte_dataset, sets, steps)}")
