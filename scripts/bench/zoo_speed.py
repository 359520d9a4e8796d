"""The model zoo's train steps against PyTorch eager: one model per family, 1 x 1 and 2 x 1.

    .venv/bin/python scripts/bench/zoo_speed.py [--models gpt2,qwen2,...] [--exporter dynamo|legacy]
        [--batch 4] [--seq 8] [--rounds 10] [--steps 5] [--warmup 3] [--work runs/zoo-speed] [--no-build]
        [--profile] [--markdown] [--render]

For each zoo model named (scripts/zoo.py: transformers tiny configs and plain torch modules, random weights,
every dropout 0; its micro-batch of 4 and sequences of 8, or ``--batch`` and ``--seq``, the zoo's ``N`` and
``SEQ`` set before each model is made; images and Whisper's features keep their sizes), the export
(``--exporter``, torch's default dynamo one unless said; a model that exporter cannot export, T5, by the
legacy one) is prepared by trainrun's own ``prepare`` (``trainrun.graphs.manifest.prepare``: trainrun's
builder, ``graphs.fuse`` and every other default, the batch fixed, 1 thread), and its ``train.onnx``
(forward + backward, gradients as outputs) is timed in a session as the engine opens it (``builders.Loop``:
batch, weights and gradient buffers bound once) against the same module in PyTorch eager (train mode, the
same inputs and labels, the zoo's loss: zero the gradients, forward, loss, backward; 1 thread), the two
alternating in one process (``cnn_builders.alternate``): ``--rounds`` rounds of ``--steps`` steps each after
``--warmup``. "1 x 1": one such process; "2 x 1": two at once, each 1 thread, each timing its own steps as
the two ranks of a 2-rank step compute them (the gradients' reduction is not in it: the Allreduce section of
BENCHMARKS.md measures that), started together per model (a barrier after the warm-up); a cell is the least
min and the slower rank's median. The losses of the two sides are printed beside each other (the same model,
inputs and weights: equal to float32's noise). ``--profile`` runs each train graph under onnxruntime's
profiler instead (``cnn_builders.profile``). Results: WORK/<runtime>/b<batch>-s<seq>/results.json (a run of
some models replaces theirs). A stock onnxruntime venv builds and times its own graphs (its own onnx): run
the script with each venv's python.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))

# one zoo model per family (the CNNs of torchvision's size: BENCHMARKS.md's CNN section, cnn_builders.py)
FAMILIES = {
    "gpt2": "decoder: GPT-2", "qwen2": "decoder: Qwen2 (Llama-like, GQA, RMSNorm, rotary)",
    "gpt_neox": "decoder: GPT-NeoX (partial rotary)", "distilbert_cls": "encoder classifier: DistilBERT",
    "roberta_cls": "encoder classifier: RoBERTa", "t5": "seq2seq: T5", "bart": "seq2seq: BART",
    "vit": "ViT", "whisper_encoder": "Conv1d: Whisper encoder classifier", "conv1d_text": "Conv1d: text CNN",
    "lstm": "LSTM", "gru_bi": "GRU, bidirectional", "mobilenetv3_block": "MobileNetV3 block",
    "efficientnet_block": "EfficientNet block", "resnet_bn": "ResNet-like, BatchNorm",
    "multihead_attention": "nn.MultiheadAttention", "transformer_encoder_layer": "nn.TransformerEncoderLayer",
    "mlp_activations": "MLP: ELU, SELU, Softplus, Mish", "cumsum_einsum_tile": "CumSum, Einsum, Tile (mse)",
}
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def runtime() -> str:
    """The onnxruntime timed: its version, "-training" for the training build."""
    import onnxruntime as ort
    try:
        from onnxruntime.capi._pybind_state import GradientGraphBuilder  # noqa: F401
        return ort.__version__ + "-training"
    except ImportError:
        return ort.__version__


def sizes(batch: int, seq: int) -> None:
    """The zoo's micro-batch and sequence length, read when a model is made (GPT-2's positions: 32 at most)."""
    import zoo
    zoo.N, zoo.SEQ = batch, seq


def build(name: str, work: Path, exporter: str) -> dict:
    """WORK/<name>/: the export, ``prepare``'s graphs (graphs/), trainrun.onnx (its train graph) and
    inputs.npz (the batch, labels, weights and frozen tensors). Returns what was built and how long it took."""
    import zoo
    from safetensors.numpy import load_file
    import torch
    from trainrun import config as C
    from trainrun.graphs.manifest import FROZEN_FILE, prepare
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model = zoo.ZOO[name]()
    used = exporter
    t = time.perf_counter()
    try:
        zoo.export(model, out / "model.onnx", exporter)
    except Exception:  # noqa: BLE001 - torch's own failure (T5 by the dynamo exporter): the other exporter
        used = "legacy" if exporter == "dynamo" else "dynamo"
        zoo.export(model, out / "model.onnx", used)
    export_s = time.perf_counter() - t
    with torch.no_grad():
        shape = model.module(*[torch.from_numpy(v) for v in model.inputs.values()]).shape
    labels = zoo.labels_of(model, shape)
    frozen = [k for k, p in model.module.named_parameters() if not p.requires_grad]
    cfg = C.from_dict({"model": {"builtin": None, "onnx": str(out / "model.onnx"), "frozen": frozen,
                                 "loss": {"type": model.loss, "logits": "logits", "labels": "labels"}},
                       "train": {"micro_batch_size": zoo.N}, "engine": {"threads": 1},
                       "graphs": {"builder": "trainrun"},
                       "run": {"output_dir": str(out / "run")}})
    t = time.perf_counter()
    graphs = Path(prepare(cfg, str(out / "graphs")))
    prepare_s = time.perf_counter() - t
    shutil.copyfile(graphs / "train.onnx", out / "trainrun.onnx")
    feeds = {**model.inputs, "labels": labels, **load_file(str(graphs / "weights.safetensors"))}
    if (graphs / FROZEN_FILE).exists():
        feeds.update(load_file(str(graphs / FROZEN_FILE)))
    np.savez(out / "inputs.npz", **feeds)
    import onnx
    nodes = len(onnx.load(str(out / "trainrun.onnx"), load_external_data=False).graph.node)
    info = {"exporter": used, "export_s": export_s, "prepare_s": prepare_s, "nodes": nodes, "batch": zoo.N,
            "seq": zoo.SEQ}
    (out / "built.json").write_text(json.dumps(info))
    print(f"{name}: {json.dumps(info)}", flush=True)
    return info


class TorchStep:
    """The zoo module in PyTorch eager, train mode, on the same inputs and labels: zero the gradients,
    forward, the zoo's loss, backward (the step's optimizer update is not timed on either side)."""

    def __init__(self, name: str, feeds: dict):
        import torch
        import zoo
        self.torch, self.zoo = torch, zoo
        self.model = zoo.ZOO[name]()
        self.module = self.model.module.train()
        self.labels = feeds["labels"]

    def step(self) -> float:
        t = time.perf_counter()
        self.module.zero_grad(set_to_none=True)
        loss = self.zoo.torch_loss(self.model, self.module, self.torch.float32, self.labels)
        loss.backward()
        took = time.perf_counter() - t
        self.last = float(loss.detach())
        return took


def worker(rank: int, names: list[str], work: Path, rounds: int, steps: int, warmup: int, size, barrier,
           out) -> None:
    """One process (one rank) timing every model's two setups; ``size``: (batch, seq) as built; ``barrier``:
    the other ranks' (None alone)."""
    import torch
    torch.set_num_threads(1)
    sizes(*size)
    from builders import Loop
    from cnn_builders import alternate
    results = {}
    for name in names:
        feeds = dict(np.load(work / name / "inputs.npz"))
        setups = {"trainrun": Loop(work / name / "trainrun.onnx", feeds, 1), "torch": TorchStep(name, feeds)}
        results[name] = alternate(setups, rounds, steps, warmup, None if barrier is None else barrier.wait)
    out.put((rank, results))


def time_all(names: list[str], work: Path, ranks: int, rounds: int, steps: int, warmup: int, size) -> list[dict]:
    """``ranks`` processes at once (spawned: fresh, 1 thread each), every model in each; their results."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(ranks) if ranks > 1 else None
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, names, work, rounds, steps, warmup, size, barrier, out))
             for r in range(ranks)]
    for p in procs:
        p.start()
    got = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a timing process exited {p.exitcode}")
    return [got[r] for r in range(ranks)]


def summary(per_rank: list[dict], name: str) -> dict:
    """One model's figures over the ranks: per setup the least min and the largest median (the slower
    rank's: a 2-rank step waits for it), torch / trainrun of those medians, the losses, the load."""
    ms = {k: {"min": min(r[name]["ms"][k]["min"] for r in per_rank),
              "median": max(r[name]["ms"][k]["median"] for r in per_rank)} for k in ("trainrun", "torch")}
    return {"ms": ms, "ratio": ms["torch"]["median"] / ms["trainrun"]["median"],
            "ratio_per_rank": [r[name]["ms"]["torch"]["median"] / r[name]["ms"]["trainrun"]["median"]
                               for r in per_rank],
            "loss": per_rank[0][name]["loss"],
            "load_1min": [min(r[name]["load_1min"][0] for r in per_rank),
                          max(r[name]["load_1min"][1] for r in per_rank)]}


def render(work: Path) -> str:
    """The tables of WORK's results (a table per batch and sequence, both runtimes side by side)."""
    import json
    from pathlib import Path
    runs = {}
    for path in sorted(Path(work).glob("*/b*-s*/results.json"),
                       key=lambda p: [int(v) for v in p.parent.name[1:].split("-s")]):
        runs.setdefault(path.parent.name, {})[path.parent.parent.name] = json.loads(path.read_text())
    out = []
    for size, by_rt in runs.items():
        rts = sorted(by_rt, key=lambda r: not r.endswith("-training"))
        metas = [m for r in rts for m in by_rt[r]["runs"]]
        loads = [x for m in metas for x in (m["load_before"][0], m["load_after"][0])]
        m0 = metas[0]
        out.append(f"batch {m0['batch']}, seq {m0['seq']}: {m0['rounds']} rounds x {m0['steps']} steps after "
                   f"{m0['warmup']}; runs started " + ", ".join(f"{m['started']} ({m['onnxruntime']}, {m['took_s']:.0f} s)"
                                                       for m in metas)
                   + f"; 1-minute load {min(loads):.1f}-{max(loads):.1f} before and after\n")
        head = ["family", "zoo model (exporter), nodes"]
        for rt in rts:
            for mode in ("1 x 1", "2 x 1"):
                head += [f"{rt} {mode}: trainrun ms", "PyTorch ms", "torch / trainrun: medians (mins)"]
        rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        names = list(by_rt[rts[0]]["models"])
        for n in names:
            first = by_rt[rts[0]]["models"][n]
            cells = [FAMILIES.get(n, n), f"{n} ({first['built']['exporter']}), {first['built']['nodes']}"]
            for rt in rts:
                r = by_rt[rt]["models"].get(n, {})
                for mode in ("1x1", "2x1"):
                    m = r.get(mode)
                    if m is None:
                        cells += ["-"] * 3
                        continue
                    cells += [f"{m['ms'][k]['min']:.2f} / {m['ms'][k]['median']:.2f}" for k in ("trainrun", "torch")]
                    by_min = m["ms"]["torch"]["min"] / m["ms"]["trainrun"]["min"]
                    ratio = f"{m['ratio']:.2f} ({by_min:.2f})"
                    cells.append(f"**{ratio}**" if min(m["ratio"], by_min) < 1 else ratio)
            rows.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(rows) + "\n")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(FAMILIES))
    ap.add_argument("--exporter", choices=["dynamo", "legacy"], default="dynamo")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "zoo-speed")
    ap.add_argument("--batch", type=int, default=4, help="the micro-batch (the zoo's: 4)")
    ap.add_argument("--seq", type=int, default=8, help="token sequences' length (the zoo's: 8; 32 at most)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=5, help="steps of one setup before the other's, per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ranks", default="1,2", help="the process counts timed: 1 (1 x 1), 2 (2 x 1)")
    ap.add_argument("--no-build", action="store_true", help="time the graphs WORK already holds")
    ap.add_argument("--profile", action="store_true", help="profile the train graphs instead of timing them")
    ap.add_argument("--markdown", action="store_true", help="print the tables of WORK's results as markdown")
    ap.add_argument("--render", action="store_true", help="only print the tables of WORK's results")
    args = ap.parse_args()
    for var in THREAD_VARS:         # the spawned processes inherit it
        os.environ[var] = "1"
    if args.render:
        print(render(args.work))
        return
    names = [m for m in args.models.split(",") if m]
    rt = runtime()
    work = args.work / rt / f"b{args.batch}-s{args.seq}"
    sizes(args.batch, args.seq)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    built = {n: (json.loads((work / n / "built.json").read_text()) if args.no_build else
                 build(n, work, args.exporter)) for n in names}
    if args.profile:
        from cnn_builders import profile
        for n in names:
            profile(n, work, args.steps, top=15, graphs=("trainrun",))
        return
    import common
    import torch
    load_before = os.getloadavg()
    models = {n: {"built": built[n]} for n in names}
    for ranks in (int(r) for r in args.ranks.split(",")):
        per_rank = time_all(names, work, ranks, args.rounds, args.steps, args.warmup, (args.batch, args.seq))
        for n in names:
            models[n][f"{ranks}x1"] = summary(per_rank, n)
    meta = {"cpu": common.cpu_name(), "onnxruntime": rt, "torch": torch.__version__, "threads": 1,
            "exporter": args.exporter, "batch": args.batch, "seq": args.seq, "rounds": args.rounds,
            "steps": args.steps, "warmup": args.warmup, "models": names,
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)), "took_s": time.time() - t0,
            "load_before": load_before, "load_after": os.getloadavg()}
    for n in names:
        models[n]["started"] = meta["started"]
    path = work / "results.json"        # a run of some models replaces theirs only; each run's meta kept
    old = json.loads(path.read_text()) if path.exists() else {"runs": [], "models": {}}
    path.write_text(json.dumps({"runs": old.get("runs", []) + [meta], "models": {**old["models"], **models}},
                               indent=1))
    print(f"\n{meta['cpu']}, onnxruntime {rt}, torch {meta['torch']}, 1 thread per process, batch {args.batch}, "
          f"seq {args.seq}; ms per "
          f"forward+backward, min / median of {args.rounds} x {args.steps} (2 x 1: the slower rank's median); "
          f"load {load_before[0]:.1f} before, {meta['load_after'][0]:.1f} after; {meta['took_s']:.0f} s")
    for n, r in models.items():
        line = f"{n:26s}"
        for mode in ("1x1", "2x1"):
            if mode in r:
                m = r[mode]["ms"]
                line += (f"  {mode}: {m['trainrun']['min']:6.2f}/{m['trainrun']['median']:6.2f} vs "
                         f"{m['torch']['min']:6.2f}/{m['torch']['median']:6.2f} = {r[mode]['ratio']:.2f}")
        print(line, flush=True)
    if args.markdown:
        print("\n" + render(args.work))


if __name__ == "__main__":
    main()
