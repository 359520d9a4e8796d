"""distributed.intra_node: shared: one copy of the parameters per node (MPI-3 shared memory), gradients
reduced by reading the local peers' buffers, the update split over the node's ranks; the same training as
the plain MPI path, checkpoints that resume across paths and rank counts, no hang when a rank dies.

Tolerances: the shared path adds the ranks' gradients in another order than MPI's allreduce (own slice
first, then the peers in node order; across nodes, MPI's own order over the nodes), and takes the squared
gradient norm per slice (float64 sums of float32 chunk dots split elsewhere): float32 rounding of the
gradients (about 1e-7 relative), carried on through the clip factor and AdamW's m / sqrt(v). On the tiny
GPT-2 over 20 steps this keeps the losses within 1e-6 absolute of the plain path (as tests/test_zero.py's
stage 0 vs 1 over 50 steps); a lost or doubled slice of the gradients or of the parameters moves the loss
by more than 1e-3 within a step or two.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
from safetensors.numpy import load_file

from conftest import MPIRUN, TRAINRUN, mpirun, mpirun_probe, rank_pids, read_metrics, run, write_config

STEPS = 20
ADAMW = {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1, "max_grad_norm": 1.0}
LAMB = {"name": "lamb", "lr": 1e-2, "weight_decay": 0.01, "max_grad_norm": 0.5}
HELD = re.compile(r"\[rank (\d)\] zero stage \d: this rank updates parameters (\d+):(\d+) of (\d+) and holds "
                  r"([\d,]+) bytes")


def _train(tmp_path, data, name, ranks, intra, env=None, optimizer=ADAMW, gather_piece=None, **extra):
    cfg = write_config(tmp_path / f"{name}.yaml", data, **{
        "run.output_dir": str(tmp_path / name), "train.max_steps": STEPS, "train.micro_batch_size": 2,
        "distributed.intra_node": intra, "optimizer": optimizer, "run.log_level": "devinfo",
        "checkpoint": {"every": 10, "keep_last": 3}, **extra})
    proc = mpirun_probe(ranks, "--config", cfg, env=dict(os.environ, **(env or {})), gather_piece=gather_piece)
    return read_metrics(str(tmp_path / name))[0], str(tmp_path / name), proc.stdout + proc.stderr


def _same_losses(got, ref, rel_norm=1e-3):
    assert sorted(got) == sorted(ref) == list(range(1, len(ref) + 1))
    for s in ref:
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= 1e-6, (s, got[s]["loss"], ref[s]["loss"])
        assert abs(got[s]["grad_norm"] - ref[s]["grad_norm"]) <= rel_norm * ref[s]["grad_norm"], s


def _held(out):
    return sorted((int(r), int(lo), int(hi), int(n), int(b.replace(",", ""))) for r, lo, hi, n, b in HELD.findall(out))


def test_four_ranks_as_two_nodes_stage1_equals_mpi_and_resumes_on_two(tmp_path, byte_dataset):
    """4 ranks as 2 pretend nodes of 2 (TRAINRUN_RANKS_PER_NODE=2), ZeRO-1 across the nodes, LAMB (its
    per-tensor sums added over the four parts): the losses of the plain MPI path at stage 0; the four parts
    tile the parameters in (node slice, node) order. Its step-10 checkpoint (the moments gathered over the
    nodes, then over the first node, in pieces of 1000 elements) continues on 2 ranks with the mpi path as
    the uninterrupted plain run does."""
    ref, _, _ = _train(tmp_path, byte_dataset, "mpi", 4, "mpi", optimizer=LAMB)
    got, got_dir, out = _train(tmp_path, byte_dataset, "shared", 4, "shared", env={"TRAINRUN_RANKS_PER_NODE": "2"},
                               optimizer=LAMB, gather_piece=1000, **{"distributed.zero_stage": 1})
    _same_losses(got, ref)
    held = _held(out)
    n = held[0][3]
    bounds = sorted((lo, hi) for _, lo, hi, _, _ in held)
    assert bounds[0][0] == 0 and bounds[-1][1] == n and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    # node slices 0:n/2 (node rank 0) and n/2:n (node rank 1), each cut over the 2 nodes: rank 0 (node 0,
    # node rank 0) holds the first quarter, rank 2 (node 1, node rank 0) the second
    assert [h[1] for h in held] == [bounds[0][0], bounds[2][0], bounds[1][0], bounds[3][0]]
    assert all(b == 8 * (hi - lo) for _, lo, hi, _, b in held)
    assert re.search(r"\[rank 3\] intra-node: shared \(node rank 1 of 2, node 1 of 2;", out)

    dst = tmp_path / "resumed"
    shutil.copytree(got_dir, dst)
    shutil.rmtree(dst / "checkpoints" / str(STEPS))
    (dst / "metrics.jsonl").write_text("")
    mpirun(2, "resume", str(dst / "checkpoints" / "10"), "--set", "distributed.intra_node=mpi",
           "--set", "distributed.zero_stage=0", "--set", "train.micro_batch_size=4")     # global batch kept: 8
    resumed = read_metrics(str(dst))[0]
    assert sorted(resumed) == list(range(11, STEPS + 1))
    # 2 ranks sum the gradients in another order than 4: rounding, amplified step by step by LAMB (see
    # test_zero.py); a lost or misplaced slice of the moments moves the losses by > 1e-2
    np.testing.assert_allclose([resumed[s]["loss"] for s in resumed], [ref[s]["loss"] for s in resumed], rtol=1e-3)


def test_parameters_once_per_node_and_a_killed_rank_ends_the_job(tmp_path, byte_dataset):
    """With 2 ranks on a node the parameters and both gradient buffers live in shared memory: the two rank
    processes map the same shared-memory pages, at least 3 x 4 bytes per parameter of them. Then rank 1,
    hung at the start of step 3 while rank 0 waits in the node barrier of the shared reduce, is SIGKILLed:
    the job ends (the launcher tears the others down) instead of hanging; a rank that merely hangs is
    given up on after distributed.timeout_s (tests/test_operations.py, which runs this path by default)."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 6, "distributed.intra_node": "shared", "distributed.timeout_s": 600})
    run([TRAINRUN, "prepare", "--config", cfg], check=0)      # set-up is short: the ranks meet in the step
    marker = str(tmp_path)
    proc = subprocess.Popen([MPIRUN, "-np", "2", TRAINRUN, "--config", cfg], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TRAINRUN_FAULT_STALL_STEP="1:3"))
    try:
        metrics, pids = tmp_path / "run" / "metrics.jsonl", {}
        for _ in range(240):
            pids = rank_pids(marker)
            if len(pids) == 2 and metrics.exists() and metrics.read_text().count("\n") >= 2:
                break
            time.sleep(0.5)
        assert len(pids) == 2 and max(read_metrics(str(tmp_path / "run"))[0]) == 2, pids
        n = json.load(open(tmp_path / "run" / "graphs" / "manifest.json"))["num_params"]
        maps = {}
        for r, pid in pids.items():
            maps[r] = {}
            for line in open(f"/proc/{pid}/maps"):
                f = line.split()
                if len(f) >= 6 and f[1][3] == "s":      # a shared mapping of a file (MPI's shared memory)
                    lo, hi = (int(x, 16) for x in f[0].split("-"))
                    maps[r][(f[3], f[4], " ".join(f[5:]))] = hi - lo
        common = set(maps[0]) & set(maps[1])
        assert sum(maps[0][k] for k in common) >= 3 * 4 * n, (maps, n)
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)      # well before distributed.timeout_s
        assert proc.returncode != 0, err
    finally:
        for pid in rank_pids(marker).values():
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_two_ranks_shared_equals_mpi_and_falls_back_without_windows(tmp_path, byte_dataset):
    """2 ranks on one node, AdamW, clipping active: shared = mpi (losses 1e-6, final weights and moments);
    each rank holds and updates half of the optimizer state; the header names one shared parameter buffer.
    The mpi run is the fallback where MPI cannot allocate shared windows (injected on rank 1 only): every
    rank takes the mpi path, with a warning naming the fallback."""
    ref, ref_dir, out = _train(tmp_path, byte_dataset, "mpi", 2, "shared", env={"TRAINRUN_FAULT_SHARED_WINDOWS": "1:0"})
    assert "warning: distributed.intra_node: shared is not available here" in out
    assert "(TRAINRUN_FAULT_SHARED_WINDOWS)); falling back to intra_node: mpi" in out
    assert out.count("intra-node: mpi") == 2 and [h[1:3] for h in _held(out)] == [(0, _held(out)[0][3])] * 2
    got, got_dir, out = _train(tmp_path, byte_dataset, "shared", 2, "shared")
    _same_losses(got, ref)
    assert any(ref[s]["grad_norm"] > ADAMW["max_grad_norm"] for s in ref)    # clipping took part
    held = _held(out)
    n = held[0][3]
    assert [h[1:3] for h in held] == [(0, held[0][2]), (held[0][2], n)] and abs(held[0][2] - n / 2) <= 1
    assert all(b == 8 * (hi - lo) for _, lo, hi, _, b in held)      # AdamW: 2 x 4 bytes of its part only
    assert len(re.findall(rf"intra-node: shared \(node rank \d of 2, node 0 of 1; one {4 * n:,}-byte", out)) == 2
    for f in ("model.safetensors", "optimizer.safetensors"):
        a = load_file(os.path.join(ref_dir, "checkpoints", str(STEPS), f))
        b = load_file(os.path.join(got_dir, "checkpoints", str(STEPS), f))
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-3, atol=1e-5, err_msg=k)


def test_a_small_dev_shm_falls_back_instead_of_a_bus_error(tmp_path, byte_dataset):
    """MPICH maps shared windows from files in /dev/shm and hands out a window larger than that tmpfs; the
    first touch past its size kills the rank with SIGBUS (Docker's default /dev/shm is 64 MB). Under an 8 MB
    /dev/shm (a mount namespace of this test's own) a model whose windows need ~20 MB takes the mpi path
    with a warning naming /dev/shm and --shm-size, and trains. Skipped where mount namespaces are not
    allowed (no CAP_SYS_ADMIN)."""
    import pytest
    small = "mount -t tmpfs -o size=8m tmpfs /dev/shm"
    if subprocess.run(["unshare", "-m", "sh", "-c", small], capture_output=True).returncode:
        pytest.skip("unshare -m / mount -t tmpfs not permitted here")
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "run.output_dir": str(tmp_path / "run"), "train.max_steps": 3, "train.micro_batch_size": 2,
        "distributed.intra_node": "shared", "checkpoint.every": 0,
        "model.gpt2": {"n_layer": 2, "n_head": 4, "n_embd": 256, "n_positions": 32, "vocab_size": 512}})
    proc = run(["unshare", "-m", "sh", "-c", f"{small} && exec {MPIRUN} -np 2 {TRAINRUN} --config {cfg}"],
               check=0)
    out = proc.stdout + proc.stderr
    assert re.search(r"/dev/shm has [\d,]+ MB free on rank \d .*the shared windows need [\d,]+ MB there "
                     r"\(in a container: a larger --shm-size\)\); falling back to intra_node: mpi", out), out
    assert sorted(read_metrics(str(tmp_path / "run"))[0]) == [1, 2, 3]
