"""distributed.reduce_dtype (trainrun.sync.wire): bf16 on the wire with fp32 sums, against PyTorch's bfloat16
rounding and float64 sums; real mpirun ranks; a tiny GPT-2 trained both ways."""

import json

import numpy as np
import pytest

from conftest import TRAINRUN, mpirun, read_metrics, run, write_config, optional
from test_comm import results, run_ranks
from trainrun.sync.wire import from_bf16, to_bf16

torch = optional("torch")


def torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def torch_bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()


@pytest.mark.torch
def test_rounding_is_torchs_round_to_nearest_even():
    """Every rounding case (ties both ways, carries into the exponent, the largest finite values, subnormals,
    infinities, NaNs whose bits would wrap a naive rounding to zero or flip the sign) and random values."""
    rng = np.random.default_rng(0)
    special = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3FFFFFFF, 0x7F7FFFFF, 0x7F7F7FFF, 0x00000001,
                        0x00008000, 0x00018000, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                        0x7FFF8001, 0xFFFFFFFF, 0xFFFF8000, 0x80000000, 0], np.uint32).view(np.float32)
    x = np.concatenate([special, rng.standard_normal(300_000).astype(np.float32)
                        * np.exp2(rng.integers(-40, 40, 300_000)).astype(np.float32)])
    got = np.empty(x.size, np.uint16)
    to_bf16(x, got)
    want = torch_bf16_bits(x)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    back = np.empty(x.size, np.float32)
    from_bf16(got, back)
    assert np.isnan(back[nan]).all() and nan.sum() == 5
    assert np.array_equal(back[~nan], torch_bf16(x)[~nan])
    from_bf16(got, back, add=True)
    with np.errstate(over="ignore"):
        assert np.array_equal(back[~nan], 2 * torch_bf16(x)[~nan])


REDUCE = '''
from trainrun.sync import wire

def main(comm):
    r, p = comm.rank, comm.world_size
    n = 10_001      # not a multiple of the world size: parts of unequal size
    rng = np.random.default_rng(100 + r)
    g = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32)
    np.save(f"g.{r}.npy", g)
    bf, fp = wire.make(comm, "bf16"), wire.make(comm, "fp32")
    buf = g.copy()
    bf.allreduce_(buf)
    np.save(f"allreduce.{r}.npy", buf)
    counts = [n // p + (q < n % p) for q in range(p)]
    inplace = g.copy()
    bf.reduce_scatter(inplace, inplace[:counts[r]], counts)      # ZeRO-1's way: the part at the start
    np.save(f"scatter.{r}.npy", inplace[:counts[r]])
    sent = bf.sent_bytes
    # the same buffers through the fp32 path; a buffer size dividing into equal parts for the byte count
    m = 12 * 1000
    bf.sent_bytes = 0
    bf.allreduce_(np.ones(m, np.float32))
    fp.allreduce_(np.ones(m, np.float32))
    report(r, {"sent": sent, "bf16": bf.sent_bytes, "fp32": fp.sent_bytes, "counts": counts})

comm = make_communicator(timeout_s=30)
run(main, comm)
comm.close()
'''


@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.torch
def test_bf16_reduction_is_fp32_sums_of_bf16_rounded_values(tmp_path, nprocs):
    """Every rank ends with the same bits: bf16(fp32 sum in rank order of bf16(g_r)) (PyTorch's roundings), so
    within (2^-7 + P 2^-23) sum_r |g_r| of the exact (float64) sum, for each element; reduce_scatter leaves
    the fp32 sum (one rounding fewer); half the bytes of fp32 on the wire."""
    rc, out, _ = run_ranks(tmp_path, nprocs, REDUCE, timeout=60)
    assert rc == 0, out
    g = [np.load(tmp_path / f"g.{r}.npy") for r in range(nprocs)]
    acc = torch_bf16(g[0])
    for r in range(1, nprocs):
        acc = acc + torch_bf16(g[r])         # float32 additions, rank order
    want = torch_bf16(acc)
    exact = np.sum([x.astype(np.float64) for x in g], axis=0)
    mag = np.sum([np.abs(x.astype(np.float64)) for x in g], axis=0)
    for r in range(nprocs):
        got = np.load(tmp_path / f"allreduce.{r}.npy")
        assert np.array_equal(got, want), r
        assert np.all(np.abs(got - exact) <= (2.0 ** -7 + nprocs * 2.0 ** -23) * mag)
    # not a no-op: the rounding is seen (fp32 sums of these values differ from the bf16 result)
    assert np.count_nonzero(want != sum(g[1:], g[0])) > len(want) // 2
    rep = results(tmp_path)
    counts = rep[0]["counts"]
    offs = np.concatenate(([0], np.cumsum(counts)))
    for r in range(nprocs):
        part = np.load(tmp_path / f"scatter.{r}.npy")
        assert np.array_equal(part, acc[offs[r]:offs[r + 1]]), r
        assert np.all(np.abs(part - exact[offs[r]:offs[r + 1]])
                      <= (2.0 ** -8 + nprocs * 2.0 ** -23) * mag[offs[r]:offs[r + 1]])
        n = len(g[0])
        # what each rank handed MPI: its parts for the others (alltoallv, both calls), its part to every other
        # rank (allgatherv, allreduce_ only); bf16 = 2 bytes an element
        assert rep[r]["sent"] == 2 * (2 * (n - counts[r]) + (nprocs - 1) * counts[r])
        assert rep[r]["bf16"] * 2 == rep[r]["fp32"] == 2 * (nprocs - 1) * 4 * 12_000 // nprocs


def _train(tmp_path, data, name, dtype, ranks, per_node, **extra):
    cfg = write_config(tmp_path / f"{name}.yaml", data, **{
        "run.output_dir": str(tmp_path / name), "train.max_steps": 60, "distributed.reduce_dtype": dtype,
        **extra})
    mpirun(ranks, "--config", cfg, env={"TRAINRUN_RANKS_PER_NODE": str(per_node)})
    with open(tmp_path / name / "summary.json") as fh:
        return read_metrics(str(tmp_path / name))[0], json.load(fh)


@pytest.mark.parametrize("ranks,per_node,stage", [(2, 1, 0), (2, 1, 1), (4, 2, 0)],
                         ids=["2x1-allreduce", "2x1-zero1", "2x2-shared"])
def test_tiny_gpt2_trains_with_bf16_on_the_wire_as_with_fp32(tmp_path, byte_dataset, ranks, per_node, stage):
    """60 steps on pretend nodes (TRAINRUN_RANKS_PER_NODE), so that the gradients cross the wire: 2 nodes of one
    rank (stage 0: the whole buffer's allreduce; stage 1: ZeRO-1's reduce-scatter) and 2 nodes of 2 ranks
    sharing memory (each node's sum in fp32 over shared memory, the slices' allreduce across nodes in bf16).
    bf16's losses follow fp32's (a relative gradient error of 2^-8 to 2^-7 moves AdamW's steps by about that
    much, far below the loss's fall), the bytes per step are half."""
    extra = {"distributed.zero_stage": stage}
    ref, ref_sum = _train(tmp_path, byte_dataset, "fp32", "fp32", ranks, per_node, **extra)
    got, got_sum = _train(tmp_path, byte_dataset, "bf16", "bf16", ranks, per_node, **extra)
    assert sorted(got) == sorted(ref) == list(range(1, 61))
    assert got[1]["loss"] == ref[1]["loss"]         # the same start: only the reduction differs
    assert any(got[s]["grad_norm"] != ref[s]["grad_norm"] for s in ref)     # and it did differ
    for s in ref:
        # measured here: 1.3e-4 to 1.7e-4 at most; the loss falls by 44% meanwhile
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= 2e-3 * ref[s]["loss"], (s, got[s], ref[s])
    assert ref[60]["loss"] < 0.8 * ref[1]["loss"]        # it trained
    assert ref_sum["wire_bytes_per_step"] > 0
    assert got_sum["wire_bytes_per_step"] * 2 == ref_sum["wire_bytes_per_step"]


def test_a_bad_reduce_dtype_exits_2_naming_the_key(tmp_path, byte_dataset):
    cfg = write_config(tmp_path / "bad.yaml", byte_dataset, **{"distributed.reduce_dtype": "fp16"})
    proc = run([TRAINRUN, "--config", cfg])
    assert proc.returncode == 2 and "distributed.reduce_dtype" in proc.stderr + proc.stdout
