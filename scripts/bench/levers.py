"""Levers on trainrun's train graph, measured side by side in one process.

    .venv/bin/python scripts/bench/levers.py numerics --out numerics.json
    .venv/bin/python scripts/bench/levers.py timing --model mid --threads 1 \
        --variants fastgelu,sigmoid,fastgelu@nospin --rounds 6 --out timing.json
    .venv/bin/python scripts/bench/levers.py profile --model mid --threads 1 --variants fastgelu,sigmoid

A variant is ``GRAPH[@OPTIONS]``: GRAPH is a graph form from variants.py
(``fastgelu`` = trainrun today, ``tanh``, ``sigmoid``, ``erf``, ``biasgelu``,
``onnx20``, optionally ``+static``); OPTIONS are session-option changes joined
by ``,``-free ``:`` (``basic``/``extended``/``disabled`` graph optimization,
``nospin`` = no intra-op spinning, ``nomempattern``, ``noarena``, ``daz``).

numerics: for each GELU form, the forward graph's logits against transformers'
GPT2LMHeadModel (gelu_new) at the initial weights and at weights scaled x3
(pre-activations of order 1, where GELU forms differ), and the train graph's
gradients against torch autograd (max |diff| / max |ref| over each tensor).

timing: every variant gets its own Engine over the same real micro-batch; the
variants' steps are interleaved (order reversed every round) so that a shared
machine's load hits them alike; median/min/max ms per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import variants as V  # noqa: E402

OPTION_SETS = {
    "": {},
    "basic": {"graph_optimization": "basic"},
    "extended": {"graph_optimization": "extended"},
    "disabled": {"graph_optimization": "disabled"},
    "nospin": {"session_config": {"session.intra_op.allow_spinning": "0"}},
    "daz": {"session_config": {"session.set_denormal_as_zero": "1"}},
    "nomempattern": {"mem_pattern": False},
    "noarena": {"arena": False},
    "dims": {"free_dims": True},      # session option: free dimension overrides batch/seq -> fixed values
}


def bench_config(model: common.BenchModel, work: Path, data: str, micro_batch: int | None = None) -> tuple[str, list]:
    """The config file (configs/gpt2-tiny.yaml) and the --set overrides of this benchmark model."""
    mb = micro_batch or model.global_batch // 2
    sets = [f"run.output_dir={work / 'runs' / model.name}", f"data.train={data}", "data.eval=null",
            f"data.seq_len={model.seq_len}", f"train.micro_batch_size={mb}",
            *[f"model.gpt2.{k}={v}" for k, v in model.gpt2().items()]]
    return str(common.ROOT / "configs" / "gpt2-tiny.yaml"), sets


def graphs_for(model: common.BenchModel, variant_graph: str, work: Path, data: str, micro_batch: int) -> str:
    """The prepared graphs folder of a graph variant (made once per work folder)."""
    out = work / "lever-graphs" / f"{model.name}-{variant_graph}-mb{micro_batch}" if "static" in variant_graph \
        else work / "lever-graphs" / f"{model.name}-{variant_graph}"
    if not (out / "manifest.json").exists():
        cfg, sets = bench_config(model, work, data, micro_batch)
        V.prepare_variant(cfg, sets, str(out), variant_graph, micro_batch, model.seq_len)
    return str(out)


def split_variant(name: str) -> tuple[str, dict]:
    graph, _, opts = name.partition("@")
    merged: dict = {}
    for o in filter(None, opts.split(":")):
        for k, v in OPTION_SETS[o].items():
            if k == "session_config":
                merged.setdefault(k, {}).update(v)
            else:
                merged[k] = v
    return graph or "fastgelu", merged


# --------------------------------------------------------------------------- numerics
def hf_model(shape: dict, weights: dict):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"],
                     n_positions=shape["n_positions"], vocab_size=shape["vocab_size"], resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new", bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=False)
    return model


def numerics(forms: list[str], work: Path, data: str) -> dict:
    import onnxruntime as ort
    import torch
    from trainrun import config as C
    from trainrun.models.gpt2 import init_weights
    from ceiling import TrainGraphLoop
    torch.set_num_threads(2)
    shape = dict(n_layer=3, n_head=6, n_embd=96, n_positions=128, vocab_size=1024)   # the test's largest shape
    base = init_weights(C.GPT2Config(**shape), seed=7)
    scaled = {k: (v * 3 if v.ndim == 2 else v) for k, v in base.items()}
    rng = np.random.default_rng(0)
    ids = rng.integers(0, shape["vocab_size"], (3, 128))
    out = {}
    refs = {}
    for tag, w in (("init", base), ("scaled_x3", scaled)):
        with torch.no_grad():
            refs[tag] = hf_model(shape, w).eval()(torch.from_numpy(ids)).logits.numpy()
    # gradients: the tiny benchmark model's train graph on a real micro-batch vs torch autograd
    tiny = common.MODELS["tiny"]
    for form in forms:
        row = {}
        for tag, w in (("init", base), ("scaled_x3", scaled)):
            try:
                sess = ort.InferenceSession(V.forward_model(shape, form, w).SerializeToString(),
                                            providers=["CPUExecutionProvider"])
                row[f"logits_maxdiff_{tag}"] = float(np.abs(sess.run(["logits"], {"input_ids": ids})[0] - refs[tag]).max())
            except Exception as exc:  # noqa: BLE001 - a form onnxruntime cannot run
                row[f"logits_maxdiff_{tag}"] = None
                row["error"] = str(exc).splitlines()[0][:200]
        try:
            loop = TrainGraphLoop(graphs_for(tiny, form, work, data, tiny.global_batch // 2), data,
                                  tiny.global_batch // 2, tiny.seq_len, threads=2)
            eng = loop.engine
            for k, v in eng.layout.unflatten(eng.params).items():      # x3 weights: GELU in its curved range
                if v.ndim == 2:
                    v *= 3
            loss = loop.step()
            weights = {k: v.copy() for k, v in eng.layout.unflatten(eng.params).items()}
            hf = hf_model(tiny.gpt2(), weights)
            x = torch.from_numpy(eng.batch["input_ids"].copy())
            y = torch.from_numpy(eng.batch["labels"].copy())
            logits = hf(x).logits
            ref = torch.nn.functional.cross_entropy(logits.reshape(-1, tiny.vocab_size), y.reshape(-1))
            ref.backward()
            named = dict(hf.named_parameters())
            rel = max(float(np.abs(g - named[k].grad.numpy()).max() / np.abs(named[k].grad.numpy()).max())
                      for k, g in eng.layout.unflatten(eng.grads).items())
            row["grad_rel_err"] = rel
            row["loss_diff"] = abs(loss - ref.item())
            row["train_ops"] = {k: c for k, c in V.op_counts(os.path.join(graphs_for(
                tiny, form, work, data, tiny.global_batch // 2), "train.onnx")).items()
                if "elu" in k or k.startswith(("Tanh", "Sigmoid"))}
        except Exception as exc:  # noqa: BLE001
            row["grad_rel_err"] = None
            row["error"] = str(exc).splitlines()[0][:200]
        row["matches_gelu_new_1e-4"] = bool(row.get("logits_maxdiff_init") is not None
                                            and row["logits_maxdiff_init"] < 1e-4
                                            and (row.get("logits_maxdiff_scaled_x3") or 1) < 1e-4
                                            and (row.get("grad_rel_err") or 1) < 1e-4)
        out[form] = row
    return out


# --------------------------------------------------------------------------- timing
def timing(model: common.BenchModel, names: list[str], threads: int, micro_batch: int, rounds: int,
           work: Path, data: str, warmup: int = 2) -> dict:
    from ceiling import TrainGraphLoop
    loops = {}
    for name in names:
        graph, opts = split_variant(name)
        loops[name] = TrainGraphLoop(graphs_for(model, graph, work, data, micro_batch), data, micro_batch,
                                     model.seq_len, threads, **opts)
    for loop in loops.values():
        for _ in range(warmup):
            loop.step()
    times = {n: [] for n in names}
    losses = {}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            losses[n] = loops[n].step()
            times[n].append((time.perf_counter() - t) * 1e3)
    base = common.summarize(times[names[0]])["median"]
    tokens = micro_batch * model.seq_len
    return {"model": model.name, "threads": threads, "micro_batch": micro_batch, "rounds": rounds,
            "loadavg": common.loadavg(),
            "variants": {n: {**common.summarize(times[n]), "tokens_per_sec": tokens / (common.summarize(times[n])["median"] / 1e3),
                             "speedup_vs_first": base / common.summarize(times[n])["median"], "loss": losses[n]}
                         for n in names}}


def profile(model: common.BenchModel, names: list[str], threads: int, micro_batch: int, steps: int,
            work: Path, data: str) -> dict:
    from ceiling import TrainGraphLoop, profile_summary
    out = {}
    prof_dir = work / "profiles"
    prof_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        graph, opts = split_variant(name)
        prefix = str(prof_dir / f"{model.name}-{name.replace('@', '_').replace(':', '_')}-t{threads}")
        loop = TrainGraphLoop(graphs_for(model, graph, work, data, micro_batch), data, micro_batch, model.seq_len,
                              threads, profile_prefix=prefix, **opts)
        t = time.perf_counter()
        for _ in range(steps):
            loop.step()
        ms = (time.perf_counter() - t) / steps * 1e3
        path = loop.end_profile()
        out[name] = {"step_ms": ms, "ops": profile_summary(path, top=10), "file": path}
    return out


def scaling(model: common.BenchModel, names: list[str], micro_batch: int, steps: int, work: Path, data: str) -> dict:
    """Per-op kernel time at 1 and 2 threads (onnxruntime profile): which ops do not parallelise."""
    from ceiling import TrainGraphLoop
    prof_dir = work / "profiles"
    prof_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names:
        graph, opts = split_variant(name)
        per: dict = {}
        for threads in (1, 2):
            prefix = str(prof_dir / f"scaling-{model.name}-{name.replace('@', '_').replace(':', '_')}-t{threads}")
            loop = TrainGraphLoop(graphs_for(model, graph, work, data, micro_batch), data, micro_batch, model.seq_len,
                                  threads, profile_prefix=prefix, **opts)
            loop.step()                      # allocation run: in the profile, but the same for both
            for _ in range(steps):
                loop.step()
            per[threads] = {o["op"]: o["ms"] / (steps + 1) for o in __import__("ceiling").profile_summary(
                loop.end_profile(), top=1000)}
        t1, t2 = sum(per[1].values()), sum(per[2].values())
        ops = sorted(per[2], key=lambda o: -per[2][o])
        out[name] = {"ms_1t": t1, "ms_2t": t2, "speedup": t1 / t2,
                     "ops": [{"op": o, "ms_1t": per[1].get(o, 0.0), "ms_2t": per[2][o],
                              "speedup": per[1].get(o, 0.0) / per[2][o] if per[2][o] else None,
                              "share_2t": per[2][o] / t2} for o in ops[:14]]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["numerics", "timing", "profile", "scaling"])
    ap.add_argument("--model", default="tiny", choices=list(common.MODELS))
    ap.add_argument("--variants", default="fastgelu,tanh,sigmoid,erf,biasgelu,onnx20")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, help="default: the per-rank batch at 2 ranks x threads/1")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--work", default=str(common.ROOT / "runs" / "bench"))
    ap.add_argument("--data", default=str(common.ROOT / "data" / "stdlib" / "train"))
    ap.add_argument("--out")
    args = ap.parse_args()
    work = Path(args.work)
    names = args.variants.split(",")
    model = common.MODELS[args.model]
    mb = args.micro_batch or model.global_batch // 2 * (1 if args.threads == 1 else 2)
    if args.what == "numerics":
        result = numerics(names, work, args.data)
        for k, v in result.items():
            print(k, v)
    elif args.what == "timing":
        result = timing(model, names, args.threads, mb, args.rounds, work, args.data)
        for k, v in result["variants"].items():
            print(f"{k:28s} median {v['median']:8.1f} ms  min {v['min']:8.1f}  max {v['max']:8.1f}  "
                  f"x{v['speedup_vs_first']:.3f}")
    elif args.what == "scaling":
        result = scaling(model, names, args.micro_batch or model.global_batch, args.steps, work, args.data)
        for k, v in result.items():
            print(k, f"1 thread {v['ms_1t']:.0f} ms, 2 threads {v['ms_2t']:.0f} ms, x{v['speedup']:.2f}",
                  [(o["op"], round(o["speedup"] or 0, 2), round(o["share_2t"], 3)) for o in v["ops"][:8]])
    else:
        result = profile(model, names, args.threads, mb, args.steps, work, args.data)
        for k, v in result.items():
            print(k, f"{v['step_ms']:.1f} ms/step", [(o["op"], o["share"]) for o in v["ops"][:8]])
    if args.out:
        common.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
