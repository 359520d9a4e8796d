"""The optimizer update: trainrun's ONNX optimizer graph vs its host kernel.

    .venv/bin/python scripts/bench/fastopt.py --model mid --threads 1 --repeats 12 --out fastopt.json

``engine.optimizer_kernel`` picks who runs the update: ``graph`` =
graphs/optimizer.onnx in onnxruntime (every elementwise op a pass over the
whole flat buffer, full-size intermediates in the session's arena), ``host`` =
trainrun.kernels.host.HostOptimizer (the same rule as fused in-place loops;
the default on the CPU). For AdamW (the benchmark config's), LAMB and SGD with
momentum, on the flat buffers of a benchmark model's real parameter tensors:
ms per update of each, interleaved (so both see the same machine load), the
max |difference| of params and state after one update from the same state, and
the resident memory each adds on its first update (the graph's session arena
vs the host kernel's none, or LAMB's one chunk-sized buffer).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2 ** 20


def rules():
    from trainrun.config import OptimizerConfig
    return {"adamw": OptimizerConfig(name="adamw", weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8),
            "lamb": OptimizerConfig(name="lamb", weight_decay=0.01),
            "sgd momentum": OptimizerConfig(name="sgd", momentum=0.9, weight_decay=0.1)}


def interleaved(fns, repeats: int) -> list[list[float]]:
    import time
    times = [[] for _ in fns]
    for r in range(repeats):
        order = list(range(len(fns))) if r % 2 == 0 else list(range(len(fns)))[::-1]
        for i in order:
            t = time.perf_counter()
            fns[i]()
            times[i].append((time.perf_counter() - t) * 1e3)
    return times


def compare(cfg, shapes, threads: int, repeats: int) -> dict:
    import onnxruntime as ort
    from trainrun.kernels.host import HostOptimizer
    from trainrun.optim import build_optimizer_graph, state_names
    names = [n for n, _ in shapes]
    sizes = [math.prod(s) for _, s in shapes]
    n = sum(sizes)
    rng = np.random.default_rng(0)
    init = rng.normal(0, 0.02, n).astype(np.float32)
    grads = rng.normal(0, 1e-3, n).astype(np.float32)
    lr, gs = 1e-3, 0.5
    states = state_names(cfg)
    # np.full, not np.zeros: the pages are touched now, so the RSS deltas below are the updates' own memory
    gbuf = {"params": init.copy(), **{s: np.full(n, 0.0, np.float32) for s in states}}
    hbuf = {"params": init.copy(), **{s: np.full(n, 0.0, np.float32) for s in states}}

    before = rss_mb()
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")    # as trainrun's engine
    sess = ort.InferenceSession(build_optimizer_graph(cfg, shapes).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    binding = sess.io_binding()                     # in place, as trainrun's engine binds it
    for name, arr in gbuf.items():
        val = ort.OrtValue.ortvalue_from_numpy(arr)
        binding.bind_ortvalue_input(name, val)
        binding.bind_ortvalue_output(f"{name}_out", val)
    binding.bind_cpu_input("grads", grads)
    binding.bind_cpu_input("lr", np.array(lr, np.float32))
    binding.bind_cpu_input("grad_scale", np.array(gs, np.float32))
    binding.bind_cpu_input("step", np.array(1, np.int64))
    sess.run_with_iobinding(binding)
    graph_rss = rss_mb() - before

    before = rss_mb()
    host = HostOptimizer(cfg, sizes, names)
    hstate = {s: hbuf[s] for s in states}
    host.step(hbuf["params"], grads, hstate, lr, 1, gs)
    host_rss = rss_mb() - before
    diff = max(float(np.abs(gbuf[k] - hbuf[k]).max()) for k in gbuf)
    scale = float(np.abs(gbuf["params"]).max())

    g_ms, h_ms = interleaved([lambda: sess.run_with_iobinding(binding),
                              lambda: host.step(hbuf["params"], grads, hstate, lr, 1, gs)], repeats)
    g, h = common.summarize(g_ms), common.summarize(h_ms)
    return {"graph": g, "host": h, "graph_ms_per_M": g["median"] / n * 1e6, "host_ms_per_M": h["median"] / n * 1e6,
            "speedup": g["median"] / h["median"], "max_diff": diff, "max_rel_diff": diff / scale if scale else None,
            "graph_extra_rss_mb": graph_rss, "host_extra_rss_mb": host_rss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mid", choices=list(common.MODELS))
    ap.add_argument("--threads", type=int, default=1, help="the graph session's intra-op threads")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rules", default="adamw,lamb,sgd momentum")
    ap.add_argument("--out")
    args = ap.parse_args()
    from trainrun.config import GPT2Config
    from trainrun.models.gpt2 import init_weights
    model = common.MODELS[args.model]
    shapes = [(k, tuple(v.shape)) for k, v in init_weights(GPT2Config(**model.gpt2()), seed=0).items()]
    n = sum(math.prod(s) for _, s in shapes)
    out = {"model": model.name, "params": n, "threads": args.threads, "repeats": args.repeats, "rules": {}}
    for name in args.rules.split(","):
        r = compare(rules()[name], shapes, args.threads, args.repeats)
        out["rules"][name] = r
        print(f"{name:13s} graph {r['graph']['median']:7.1f} ms  host {r['host']['median']:7.1f} ms  "
              f"x{r['speedup']:.2f}  max diff {r['max_diff']:.1e}  extra RSS graph {r['graph_extra_rss_mb']:.0f} MB, "
              f"host {r['host_extra_rss_mb']:.1f} MB", flush=True)
    out["loadavg"] = common.loadavg()
    if args.out:
        common.write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
