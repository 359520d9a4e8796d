"""Shared pieces of the benchmark suite: model shapes, FLOP counts, statistics,
machine description, peak-RSS and JSON helpers.

Every script of the suite imports this module from its own directory, so the
scripts run as plain files: ``.venv/bin/python scripts/bench/<script>.py``.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BIN = Path(sys.executable).parent
if str(ROOT) not in sys.path:          # trainrun importable without an install too: last, after site-packages,
    sys.path.append(str(ROOT))         # where the checkout's kernels/ cannot shadow the `kernels` transformers imports


@dataclass
class BenchModel:
    """One benchmarked GPT-2 shape and its batch (global batch = ``global_batch`` sequences)."""
    name: str
    n_layer: int
    n_head: int
    n_embd: int
    seq_len: int
    vocab_size: int
    global_batch: int
    warmup: int          # untimed steps at the start of every run
    steps: int           # timed steps of every run (full mode)
    quick_steps: int     # timed steps in --quick mode

    @property
    def n_positions(self) -> int:
        return self.seq_len

    def gpt2(self) -> dict:
        return dict(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                    n_positions=self.n_positions, vocab_size=self.vocab_size)

    def params(self) -> int:
        E, L = self.n_embd, self.n_layer
        return (self.vocab_size + self.n_positions) * E + L * (12 * E * E + 13 * E) + 2 * E

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), the nanoGPT/PaLM count:
        6 x (matmul weights: blocks + tied LM head) + 12 x layers x seq x d (attention)."""
        E, L = self.n_embd, self.n_layer
        matmul_params = L * 12 * E * E + self.vocab_size * E
        return 6.0 * matmul_params + 12.0 * L * self.seq_len * E

    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


MODELS = {
    # configs/gpt2-tiny.yaml as it is (0.55M parameters, 8 x 128 tokens per rank at 2 ranks)
    "tiny": BenchModel("tiny", n_layer=2, n_head=4, n_embd=128, seq_len=128, vocab_size=1024,
                       global_batch=16, warmup=8, steps=48, quick_steps=24),
    # issue 55's 3M GPT-2: 4 layers, d 256, seq 128 (3.4M parameters), 8 x 128 per rank at 2 ranks (make bench
    # leaves it out: scripts/bench/run.py --only matrix --models small)
    "small": BenchModel("small", n_layer=4, n_head=4, n_embd=256, seq_len=128, vocab_size=1024,
                        global_batch=16, warmup=4, steps=24, quick_steps=12),
    # the mid size: 6 layers, d 384, seq 256 (11.2M parameters), 4 x 256 per rank at 2 ranks
    "mid": BenchModel("mid", n_layer=6, n_head=6, n_embd=384, seq_len=256, vocab_size=1024,
                      global_batch=8, warmup=2, steps=5, quick_steps=3),
    # the 124M targets (scripts/bench/gpt2_124m.py): GPT-2 124M, seq 256, micro-batch 2 per rank at 2 ranks
    "gpt2-124m": BenchModel("gpt2-124m", n_layer=12, n_head=12, n_embd=768, seq_len=256, vocab_size=50257,
                            global_batch=4, warmup=3, steps=5, quick_steps=5),
}


CONFIG = ROOT / "configs" / "gpt2-tiny.yaml"     # every run: this config + run_sets()


def run_sets(m: BenchModel, out_dir, data: str, micro_batch: int, threads: int = 1, warmup: int = 1,
             steps: int = 1) -> list[str]:
    """The ``--set`` overrides of configs/gpt2-tiny.yaml for one trainrun run (or prepare) of ``m``."""
    s = [f"run.output_dir={out_dir}", f"run.name=bench-{m.name}", f"data.train={data}", "data.eval=null",
         f"data.seq_len={m.seq_len}", f"train.micro_batch_size={micro_batch}", "train.gradient_accumulation_steps=1",
         f"train.max_steps={warmup + steps}", f"train.log_every={max(1, warmup)}", "train.eval_every=0",
         "checkpoint.every=0", "tensorboard.enabled=false", f"engine.threads={threads}",
         "lr_schedule.warmup_steps=4"]
    return s + [f"model.gpt2.{k}={v}" for k, v in m.gpt2().items()]


def summarize(values: list[float]) -> dict:
    """median / min / max / n of a list of numbers (empty -> None values)."""
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def vm_peak_mb() -> float | None:
    """Peak virtual address space (VmPeak) of this process in MB: what ``ulimit -v`` caps."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmPeak:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return None


def launcher_rank() -> tuple[int, int]:
    """(rank, world size) from mpirun (PMI_*) or torchrun (RANK/WORLD_SIZE); (0, 1) otherwise."""
    for r, s in (("PMI_RANK", "PMI_SIZE"), ("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if r in os.environ and s in os.environ:
            return int(os.environ[r]), int(os.environ[s])
    return 0, 1


def write_json(path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def write_section(path, text: str, begin: str, end: str, heading: str) -> None:
    """``text`` (``begin`` ... ``end`` included) in place of the file's section between those markers, or appended
    under ``heading`` (itself added only where the file lacks it)."""
    path = Path(path)
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        new = old[:old.index(begin)] + text + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + "\n\n" + ("" if heading in old else heading + "\n\n") + text + "\n"
    path.write_text(new)


def read_json(path):
    return json.loads(Path(path).read_text())


def loadavg() -> tuple[float, float, float]:
    return os.getloadavg()


def _zen(family: int, model: int) -> str | None:
    """AMD's core generation from cpuid's family and model (AMD's published family/model tables): a
    hypervisor's guest often names only "AMD EPYC", and Zen 4 and Zen 5 differ in what speed-ups hold."""
    if family == 23:
        return "Zen 2" if model >= 0x30 else "Zen/Zen+"
    if family == 25:
        return "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF else "Zen 3"
    if family == 26:
        return "Zen 5"
    return None


def cpuinfo() -> dict:
    """The first processor's fields of /proc/cpuinfo ({} where it cannot be read)."""
    fields = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:
                break                   # the first processor's block is enough
            continue
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_name(fields: dict | None = None) -> str:
    """/proc/cpuinfo's model name with the family/model/stepping (and AMD's core generation) it hides;
    ``fields``: :func:`cpuinfo`'s, read here when not given."""
    fields = cpuinfo() if fields is None else fields
    name = fields.get("model name") or platform.processor() or "?"
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return name
    zen = _zen(family, model) if fields.get("vendor_id") == "AuthenticAMD" else None
    return f"{name} ({zen + ', ' if zen else ''}family {family} model {model} stepping {fields.get('stepping', '?')})"


def machine() -> dict:
    """A short description of the machine and the software versions."""
    fields = cpuinfo()
    info = {"python": platform.python_version(), "platform": platform.platform(),
            "cores": len(os.sched_getaffinity(0)), "cpu": cpu_name(fields)}
    if "flags" in fields:
        flags = set(fields["flags"].split())
        info["simd"] = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni") if f in flags)
    try:
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
        info["memory_gb"] = round(int(mem) / 1024 / 1024, 1)
    except (OSError, IndexError, ValueError):
        pass
    try:
        info["hypervisor"] = subprocess.run(["lscpu"], capture_output=True, text=True).stdout \
            .split("Hypervisor vendor:")[1].splitlines()[0].strip()
    except (OSError, IndexError):
        pass
    versions = {}
    for mod in ("onnxruntime", "onnx", "numpy", "torch", "transformers", "mpi4py"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing optional module
            versions[mod] = None
    try:
        versions["mpich"] = subprocess.run([str(BIN / "mpichversion")], capture_output=True, text=True) \
            .stdout.split("\n")[0].split(":")[-1].strip()
    except OSError:
        versions["mpich"] = None
    if versions.get("onnxruntime"):     # which build: the training one (its gradient builder) or stock
        from trainrun.graphs.gradients import ort_builder_missing
        versions["onnxruntime_build"] = "stock onnxruntime" if ort_builder_missing() else "onnxruntime-training"
    info["versions"] = versions
    return info


def asdict_model(m: BenchModel) -> dict:
    d = asdict(m)
    d.update(params=m.params(), flops_per_token=m.flops_per_token(), tokens_per_step=m.tokens_per_step())
    return d


def best_window(step_seconds: list[float], window: int, tokens_per_step: float) -> float | None:
    """Highest tokens/s over ``window`` consecutive steps (a load-robust figure on a shared machine)."""
    if not step_seconds:
        return None
    w = max(1, min(window, len(step_seconds)))
    best = min(sum(step_seconds[i:i + w]) for i in range(len(step_seconds) - w + 1))
    return w * tokens_per_step / best


def ddp_timed_steps(model, opt, steps: int, warm: int, loss_at) -> tuple[float, float]:
    """Steps 1..``steps`` of a DDP rank: ``loss_at(t)`` (the forward), backward, clipping at 1.0, the optimizer
    step. Returns the seconds of steps ``warm``+1..``steps`` (barriers around them) and the last loss."""
    import time

    import torch
    import torch.distributed as dist
    t0 = None
    for t in range(1, steps + 1):
        if t == warm + 1:
            dist.barrier()
            t0 = time.perf_counter()
        loss = loss_at(t)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = float(loss.detach())
    dist.barrier()
    return time.perf_counter() - t0, last
