"""Train graphs of the two gradient builders side by side: onnxruntime-training's and trainrun's own.

    .venv-training/bin/python scripts/bench/builders.py build --model mid --work WORK
    .venv-training/bin/python scripts/bench/builders.py time --model mid --work WORK --steps 20
    .venv-training/bin/python scripts/bench/builders.py peak --model mid --work WORK
    .venv/bin/python scripts/bench/builders.py time --model mid --work WORK --only trainrun

``build`` makes the loss graph of a model as ``prepare`` does (``graphs.manifest.loss_graph``) and from it
both train graphs in their direct form (gradients as outputs): onnxruntime-training's builder's
and trainrun's (``build_train_graph`` with ``builder`` onnxruntime, then ``direct_gradients``, and with
``builder`` trainrun, fused under ``graphs.fuse``), each followed by the cross-entropy split and padded products, as ``prepare`` does; it writes them, a random batch (inputs.npz) and their node counts by op type. ``time``
opens each graph in a session made as the engine makes it (``trainrun.step.sessions.session_options``, the
same threads), binds the batch and preallocated gradient buffers once, and runs forward + backward in
alternating blocks of steps in one process; tokens/s = tokens of a micro-batch / median step time
(after warm-up). ``peak`` runs each graph in a process of its own (onnxruntime and numpy only) and
records its peak resident set. Results go to WORK/<model>/results.json, a list of rounds per runtime (run
``time`` under both runtimes in turn, a few rounds, so that a shared machine's load hits them alike);
``report`` writes BENCHMARKS.md's section from them (medians over the rounds), keeping the others.

Models: ``mid`` and ``gpt2-124m`` (scripts/bench/common.py's shapes, one rank's micro-batch), ``bert``
(configs/bert-tiny.yaml: micro-batch 16, seq 128, 20 predictions).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

GRAPHS = ("onnxruntime", "trainrun")
BERT_SEQ, BERT_PREDICTIONS = 128, 20


def config(model: str):
    from trainrun.config.load import load_config
    if model == "bert":
        return load_config(str(common.ROOT / "configs" / "bert-tiny.yaml"), ["data.train=null", "data.eval=null"])
    m = common.MODELS[model]
    return load_config(str(common.CONFIG), common.run_sets(m, "/tmp/builders", "/tmp/none",
                                                           max(1, m.global_batch // 2)))


def build(model: str, work: Path) -> None:
    from trainrun.graphs.casts import restore_fp32
    from trainrun.graphs.forward import forward_from_config
    from trainrun.graphs.fusion import fuse
    from trainrun.graphs.gradients import build_train_graph, direct_gradients
    from trainrun.graphs.losses import split_cross_entropy
    from trainrun.graphs.manifest import build_options, loss_graph
    from trainrun.graphs.strides import pad_contractions
    import onnx
    cfg = config(model)
    fwd = forward_from_config(cfg)
    opts = build_options(cfg)
    loss_model, _ = loss_graph(cfg, fwd, opts)
    states = list((fwd.states or {}).values())
    out = work / model
    out.mkdir(parents=True, exist_ok=True)

    def finish(train, fused=False):
        train = split_cross_entropy(restore_fp32(train, opts["precision"]))
        train = fuse(train) if fused else train          # graphs.fuse, on trainrun's builder's graph only
        return pad_contractions(train) if opts["pad_products"] else train
    timing = {}
    t = time.perf_counter()
    ort_graph, _ = direct_gradients(finish(build_train_graph(loss_model, fwd.params, model, keep=states)))
    timing["onnxruntime"] = time.perf_counter() - t
    t = time.perf_counter()
    ours = finish(build_train_graph(loss_model, fwd.params, model, keep=states, builder="trainrun"), cfg.graphs.fuse)
    timing["trainrun"] = time.perf_counter() - t
    onnx.save(ort_graph, out / "onnxruntime.onnx")
    onnx.save(ours, out / "trainrun.onnx")
    np.savez(out / "inputs.npz", **batch(loss_model, fwd.params + list(fwd.states or {}), model))
    counts = {k: dict(collections.Counter(n.op_type for n in g.graph.node).most_common())
              for k, g in (("onnxruntime", ort_graph), ("trainrun", ours))}
    merge(out / "results.json", {"build_s": timing, "nodes": {k: sum(v.values()) for k, v in counts.items()},
                                 "op_types": counts})
    print(json.dumps({"build_s": timing, "nodes": {k: sum(v.values()) for k, v in counts.items()}}))


def batch(loss_model, weights: list[str], model: str) -> dict:
    """Weights (the initializers' values are not kept: random, N(0, 0.02)) and one random batch."""
    from onnx import helper
    rng = np.random.default_rng(0)
    out = {}
    for vi in loss_model.graph.input:
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else
                {"seq": BERT_SEQ, "predictions": BERT_PREDICTIONS}[d.dim_param] for d in t.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        name = vi.name
        if name in weights:
            is_norm = name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight", "LayerNorm.weight", ".gamma"))
            out[name] = (np.ones(dims) if is_norm else rng.normal(0, 0.02, dims)).astype(dtype)
        elif dtype == np.bool_:
            out[name] = rng.random(dims) < 0.9
        elif np.issubdtype(dtype, np.floating):
            out[name] = rng.random(dims).astype(dtype)
        else:
            bound = {"segment_ids": 2, "input_mask": 1, "masked_lm_positions": BERT_SEQ,
                     "next_sentence_labels": 2}.get(name)
            if name == "input_mask":
                out[name] = np.ones(dims, dtype)
            else:
                vocab = 2048 if model == "bert" else common.MODELS[model].vocab_size
                out[name] = rng.integers(1 if name == "masked_lm_ids" else 0, bound or vocab, dims).astype(dtype)
    return out


def merge(path: Path, new: dict, append: bool = False) -> None:
    """Update the results file ``path`` with ``new``; ``append``: each value added to a list (a round)."""
    old = json.loads(path.read_text()) if path.exists() else {}
    for k, v in new.items():
        old[k] = old.get(k, []) + [v] if append else v
    path.write_text(json.dumps(old, indent=1))


class Loop:
    """One train graph in a session as the engine opens it: batch and gradient buffers bound once."""

    def __init__(self, path: Path, feeds: dict, threads: int):
        import onnxruntime as ort
        from trainrun.step.sessions import session_options
        self.sess = ort.InferenceSession(str(path), session_options(threads, path.stem),
                                         providers=["CPUExecutionProvider"])
        self.bind = self.sess.io_binding()
        self.keep = []
        names = {i.name for i in self.sess.get_inputs()}
        for k, v in feeds.items():
            if k in names:
                ov = ort.OrtValue.ortvalue_from_numpy(v)
                self.keep.append(ov)
                self.bind.bind_ortvalue_input(k, ov)
        for o in self.sess.get_outputs():
            if o.name.endswith("_grad") and o.name[:-5] in feeds:
                buf = np.empty_like(feeds[o.name[:-5]])
                buf = buf.reshape(o.shape) if all(isinstance(d, int) for d in o.shape) else buf   # graphs.fusion
                ov = ort.OrtValue.ortvalue_from_numpy(buf)
                self.keep.append(ov)
                self.bind.bind_ortvalue_output(o.name, ov)
            else:
                self.bind.bind_output(o.name, "cpu")

    def step(self) -> float:
        t = time.perf_counter()
        self.sess.run_with_iobinding(self.bind)
        return time.perf_counter() - t

    def loss(self) -> float:
        return float(self.bind.get_outputs()[0].numpy())


def tokens(model: str) -> int:
    if model == "bert":
        return 16 * BERT_SEQ
    m = common.MODELS[model]
    return max(1, m.global_batch // 2) * m.seq_len


def run_time(model: str, work: Path, steps: int, warmup: int, block: int, threads: int, only: list[str]) -> None:
    import onnxruntime as ort
    feeds = dict(np.load(work / model / "inputs.npz"))
    loops = {k: Loop(work / model / f"{k}.onnx", feeds, threads) for k in only}
    times = {k: [] for k in only}
    for k, loop in loops.items():
        for _ in range(warmup):
            loop.step()
    done = 0
    while done < steps:
        for k, loop in loops.items():
            times[k] += [loop.step() for _ in range(min(block, steps - done))]
        done += block
    res = {k: {"median_s": float(np.median(v)), "min_s": float(np.min(v)), "steps": len(v),
               "tokens_per_s": tokens(model) / float(np.median(v)), "loss": loops[k].loss()} for k, v in times.items()}
    key = "time_" + ort.__version__ + ("-training" if _training() else "")
    entry = {"threads": threads, "cpu": common.cpu_name(), "loadavg": common.loadavg(), "graphs": res,
             "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if len(only) == 2:
        entry["ratio"] = res["trainrun"]["tokens_per_s"] / res["onnxruntime"]["tokens_per_s"]
    merge(work / model / "results.json", {key: entry}, append=True)
    print(json.dumps({key: entry}, indent=1))


def _training() -> bool:
    try:
        from onnxruntime.capi._pybind_state import GradientGraphBuilder  # noqa: F401
        return True
    except ImportError:
        return False


def peak_one(path: Path, inputs: Path, threads: int, steps: int) -> None:
    """(in its own process) peak RSS of running one graph ``steps`` times."""
    import resource
    feeds = dict(np.load(inputs))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    loop = Loop(path, feeds, threads)
    for _ in range(steps):
        loop.step()
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "before_session_mb": base}))


def run_peak(model: str, work: Path, threads: int, steps: int, only: list[str]) -> None:
    import onnxruntime as ort
    res = {}
    for k in only:
        out = subprocess.run([sys.executable, __file__, "peak-one", str(work / model / f"{k}.onnx"),
                              str(work / model / "inputs.npz"), str(threads), str(steps)],
                             check=True, capture_output=True, text=True).stdout
        res[k] = json.loads(out.strip().splitlines()[-1])
    entry = {"graphs": res}
    if len(only) == 2:
        entry["ratio"] = res["trainrun"]["peak_rss_mb"] / res["onnxruntime"]["peak_rss_mb"]
    merge(work / model / "results.json", {"peak_" + ort.__version__ + ("-training" if _training() else ""): entry},
          append=True)
    print(json.dumps(entry, indent=1))


def write_report(work: Path, output: Path) -> None:
    """BENCHMARKS.md's section of this comparison from WORK's results (the other sections kept)."""
    import report
    models = {m: json.loads((work / m / "results.json").read_text()) for m in ("mid", "gpt2-124m", "bert")
              if (work / m / "results.json").exists()}
    old = output.read_text() if output.exists() else ""
    output.write_text(report.merge(old, report.render_only(old, {"builders": {"models": models}})))
    print(f"wrote {output}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "peak-one":
        peak_one(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["build", "time", "peak", "report"])
    ap.add_argument("--model", default="mid", choices=["mid", "gpt2-124m", "bert"])
    ap.add_argument("--work", type=Path, default=common.ROOT / "runs" / "builders")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per graph")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--block", type=int, default=2, help="steps of one graph before the other's")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (a rank's: 1 at 2 ranks)")
    ap.add_argument("--only", default=",".join(GRAPHS), help="graphs to time: onnxruntime,trainrun")
    ap.add_argument("--output", type=Path, default=common.ROOT / "BENCHMARKS.md", help="report: the file rewritten")
    args = ap.parse_args()
    only = [k for k in args.only.split(",") if k]
    if args.what == "build":
        build(args.model, args.work)
    elif args.what == "time":
        run_time(args.model, args.work, args.steps, args.warmup, args.block, args.threads, only)
    elif args.what == "peak":
        run_peak(args.model, args.work, args.threads, 3, only)
    else:
        write_report(args.work, args.output)


if __name__ == "__main__":
    main()
