"""Lever: AdamW over trainrun's flat buffers as cache-sized NumPy chunks (a prototype).

trainrun's optimizer graph (trainrun/optim.py + kernels/) runs each elementwise
op over the whole flat buffer, so every op is a pass over main memory and every
intermediate is a full-size buffer in the session's arena (~4-5 x the
parameter bytes for AdamW). Here the same math (trainrun's adamw, both eps
modes, bias correction, per-tensor decoupled weight decay, grad_scale) runs on
chunks of ``chunk`` elements: the ~11 NumPy ops of a chunk stay in cache, so
the whole update is about one pass over p, g, m, v and needs two chunk-sized
temporaries.

    .venv/bin/python scripts/bench/fastopt.py --params 11.14e6 --threads 1 --out fastopt.json

compares, interleaved on the same buffers: trainrun's ONNX optimizer graph,
bench_optim.py's whole-buffer NumPy AdamW and this chunked version (several
chunk sizes), checks that they agree, and reports the extra resident memory
each needs. ``install()`` patches trainrun.engine.Engine in the calling process
so that trainrun's own runner uses it (scripts/bench/trainrun_rank.py
--patch '{"chunked_adamw": true}').
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


class ChunkedAdamW:
    """trainrun's adamw rule (kernels/optimizers.py) on flat float32 buffers, chunk by chunk."""

    def __init__(self, sizes: list[int], weight_decays: list[float], betas, eps: float, eps_mode: str = "torch",
                 bias_correction: bool = True, chunk: int = 1 << 18):
        self.b1, self.b2 = float(betas[0]), float(betas[1])
        self.eps, self.eps_mode, self.bias_correction = float(eps), eps_mode, bias_correction
        # runs of consecutive tensors with the same weight decay, cut into chunks
        self.chunks: list[tuple[int, int, float]] = []
        start = 0
        runs: list[list] = []
        for n, wd in zip(sizes, weight_decays):
            if runs and runs[-1][2] == wd:
                runs[-1][1] += n
            else:
                runs.append([start, start + n, wd])
            start += n
        for a, b, wd in runs:
            for s in range(a, b, chunk):
                self.chunks.append((s, min(b, s + chunk), wd))
        self.tmp = np.empty(chunk, np.float32)
        self.tmp2 = np.empty(chunk, np.float32)

    def step(self, p, g, m, v, lr: float, t: int, grad_scale: float) -> None:
        b1, b2 = self.b1, self.b2
        f32 = np.float32
        c1, c2 = f32((1 - b1) * grad_scale), f32((1 - b2) * grad_scale * grad_scale)
        if self.bias_correction:
            bc1, root_bc2 = 1 - b1 ** t, math.sqrt(1 - b2 ** t)
            e = self.eps * root_bc2 if self.eps_mode == "torch" else self.eps
            k = lr * root_bc2 / bc1
        else:
            e, k = self.eps, lr
        e, k, b1f, b2f = f32(e), f32(k), f32(b1), f32(b2)
        torch_mode = self.eps_mode == "torch"
        for a, b, wd in self.chunks:
            n = b - a
            pp, gg, mm, vv = p[a:b], g[a:b], m[a:b], v[a:b]
            t1, t2 = self.tmp[:n], self.tmp2[:n]
            mm *= b1f
            np.multiply(gg, c1, out=t1)
            mm += t1
            vv *= b2f
            np.multiply(gg, gg, out=t1)
            t1 *= c2
            vv += t1
            np.sqrt(vv, out=t1)
            t1 += e
            np.divide(mm, t1, out=t2)
            t2 *= k
            if wd and torch_mode:
                pp *= f32(1 - lr * wd)
                pp -= t2
            elif wd:
                pp -= t2
                pp *= f32(1 - lr * wd)
            else:
                pp -= t2


def install(chunk: int = 1 << 18) -> None:
    """Make trainrun.engine.Engine run AdamW with ChunkedAdamW instead of its optimizer graph (CPU only)."""
    from trainrun import engine as E
    from trainrun.config import OptimizerConfig
    from trainrun.optim import weight_decays
    original_init = E.Engine.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        o = self.manifest.get("optimizer", {})
        if o.get("name") != "adamw" or self.xp is not np:
            return
        cfg = OptimizerConfig(**{k: v for k, v in o.items() if k in OptimizerConfig.__dataclass_fields__})
        sizes = [math.prod(s) for s in self.layout.shapes]
        opt = ChunkedAdamW(sizes, weight_decays(cfg, self.layout.names), cfg.betas, cfg.eps, cfg.eps_mode,
                           cfg.bias_correction, chunk)

        def optimizer_step(lr, step, grad_scale):
            opt.step(self.params, self.grads, self.state["exp_avg"], self.state["exp_avg_sq"], lr, step, grad_scale)
        self.optimizer_step = optimizer_step

    E.Engine.__init__ = __init__


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2 ** 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=11.14e6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--chunks", default="16384,65536,262144")
    ap.add_argument("--out")
    args = ap.parse_args()
    sys.path.insert(0, str(common.ROOT / "scripts"))
    import bench_optim
    import onnxruntime as ort
    from trainrun.config import OptimizerConfig
    from trainrun.optim import build_optimizer_graph, weight_decays

    cfg = OptimizerConfig(name="adamw", weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8)
    shapes = bench_optim.gpt2_like(args.params)
    names = [n for n, _ in shapes]
    sizes = [math.prod(s) for _, s in shapes]
    n = sum(sizes)
    rng = np.random.default_rng(0)
    init = rng.normal(0, 0.02, n).astype(np.float32)
    grads = rng.normal(0, 1e-3, n).astype(np.float32)
    lr, gs = 1e-3, 0.5

    results: dict = {"params": n, "threads": args.threads, "rows": {}}
    base_rss = rss_mb()
    # the ONNX graph, as trainrun's engine binds it (in place)
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    sess = ort.InferenceSession(build_optimizer_graph(cfg, shapes).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    onnx_bufs = {"params": init.copy(), "exp_avg": np.zeros(n, np.float32), "exp_avg_sq": np.zeros(n, np.float32)}
    binding = sess.io_binding()
    for name, arr in onnx_bufs.items():
        val = ort.OrtValue.ortvalue_from_numpy(arr)
        binding.bind_ortvalue_input(name, val)
        binding.bind_ortvalue_output(f"{name}_out", val)
    binding.bind_cpu_input("grads", grads)
    binding.bind_cpu_input("lr", np.array(lr, np.float32))
    binding.bind_cpu_input("grad_scale", np.array(gs, np.float32))
    step_arr = np.array(1, np.int64)
    binding.bind_cpu_input("step", step_arr)
    before = rss_mb()
    sess.run_with_iobinding(binding)
    results["onnx_extra_rss_mb"] = rss_mb() - before

    whole = bench_optim.NumpyOptimizer(cfg, shapes, n)
    whole_bufs = {"params": init.copy(), "exp_avg": np.zeros(n, np.float32), "exp_avg_sq": np.zeros(n, np.float32)}
    chunked = {}
    for c in [int(x) for x in args.chunks.split(",")]:
        chunked[c] = (ChunkedAdamW(sizes, weight_decays(cfg, names), cfg.betas, cfg.eps, cfg.eps_mode,
                                   cfg.bias_correction, c),
                      {"params": init.copy(), "exp_avg": np.zeros(n, np.float32), "exp_avg_sq": np.zeros(n, np.float32)})
    # one step each from the same state: the same numbers
    whole.adamw(whole_bufs["params"], grads, whole_bufs["exp_avg"], whole_bufs["exp_avg_sq"], lr, 1, gs)
    for c, (opt, b) in chunked.items():
        opt.step(b["params"], grads, b["exp_avg"], b["exp_avg_sq"], lr, 1, gs)
        results.setdefault("max_diff_vs_onnx", {})[c] = float(np.abs(b["params"] - onnx_bufs["params"]).max())
    results["numpy_whole_max_diff_vs_onnx"] = float(np.abs(whole_bufs["params"] - onnx_bufs["params"]).max())

    fns = {"onnx graph (trainrun today)": lambda: sess.run_with_iobinding(binding),
           "numpy whole-buffer (bench_optim)": lambda: whole.adamw(whole_bufs["params"], grads, whole_bufs["exp_avg"],
                                                                   whole_bufs["exp_avg_sq"], lr, 2, gs)}
    for c, (opt, b) in chunked.items():
        fns[f"numpy chunked {c}"] = (lambda o=opt, bb=b: o.step(bb["params"], grads, bb["exp_avg"], bb["exp_avg_sq"],
                                                                 lr, 2, gs))
    times = bench_optim.interleaved_times(list(fns.values()), args.repeats)
    base = None
    for (name, _), ts in zip(fns.items(), times):
        s = common.summarize(ts)
        base = base or s["median"]
        results["rows"][name] = {**s, "ms_per_M": s["median"] / n * 1e6, "speedup": base / s["median"]}
        print(f"{name:34s} {s['median']:7.1f} ms [{s['min']:.1f}-{s['max']:.1f}]  {s['median'] / n * 1e6:.2f} ms/M "
              f" x{base / s['median']:.2f}")
    print(f"max |diff| vs the ONNX graph after one step: {results['max_diff_vs_onnx']}; "
          f"extra RSS of the ONNX optimizer session's first run: {results['onnx_extra_rss_mb']:.0f} MB "
          f"(parameter buffer {n * 4 / 2**20:.0f} MB); base RSS {base_rss:.0f} MB")
    results["loadavg"] = common.loadavg()
    if args.out:
        common.write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
