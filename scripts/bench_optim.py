"""Optimizer update time: the in-place ONNX graph (trainrun.optim) vs NumPy.

    .venv/bin/python scripts/bench_optim.py [--params 10e6] [--threads 2] [--repeats 20]

The parameters are GPT-2-like tensors (weights, biases, LayerNorms; the last two
excluded from weight decay) totalling about --params elements. The ONNX graph
runs in an onnxruntime session with --threads intra-op threads, bound in place
with IOBinding. The NumPy version does the same math in place on the same flat
buffers (preallocated temporaries, per-tensor views, BLAS dot for the norms).
The two run interleaved, so that both see the same load on a shared machine.
Prints the median and the minimum ms per update and per million parameters,
their ratio, and the full-size ops of the graph (one pass over memory each).
Both implementations are first checked against each other on one step.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort

from trainrun.config import OptimizerConfig
from trainrun.optim import build_optimizer_graph, state_names, weight_decays


def gpt2_like(target: float, d: int = 512, vocab: int = 1024) -> list[tuple[str, tuple[int, ...]]]:
    params = [("wte", (vocab, d)), ("wpe", (256, d))]
    layer = 0
    while sum(math.prod(s) for _, s in params) < target:
        h = f"h.{layer}."
        params += [(h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
                   (h + "attn.c_attn.weight", (d, 3 * d)), (h + "attn.c_attn.bias", (3 * d,)),
                   (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
                   (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
                   (h + "mlp.c_fc.weight", (d, 4 * d)), (h + "mlp.c_fc.bias", (4 * d,)),
                   (h + "mlp.c_proj.weight", (4 * d, d)), (h + "mlp.c_proj.bias", (d,))]
        layer += 1
    return params + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


class NumpyOptimizer:
    """AdamW (torch eps placement) and LAMB in place on flat float32 buffers."""

    def __init__(self, cfg: OptimizerConfig, params, n: int):
        self.cfg = cfg
        sizes = [math.prod(s) for _, s in params]
        starts = np.cumsum([0] + sizes)
        self.views = [(slice(a, b), wd) for a, b, wd in zip(starts, starts[1:],
                                                            weight_decays(cfg, [name for name, _ in params]))]
        self.tmp = np.empty(n, np.float32)
        self.tmp2 = np.empty(n, np.float32)

    def _moments_and_direction(self, g, m, v, lr, t, gs):
        """m, v updated in place; returns c, q with direction = c * q (q in self.tmp)."""
        b1, b2 = self.cfg.betas
        tmp = self.tmp
        m *= b1
        np.multiply(g, np.float32((1 - b1) * gs), out=tmp)
        m += tmp
        v *= b2
        np.multiply(g, g, out=tmp)
        tmp *= np.float32((1 - b2) * gs * gs)
        v += tmp
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        np.sqrt(v, out=tmp)
        tmp += np.float32(self.cfg.eps * math.sqrt(bc2))
        np.divide(m, tmp, out=tmp)
        return math.sqrt(bc2) / bc1, tmp

    def adamw(self, p, g, m, v, lr, t, gs):
        c, q = self._moments_and_direction(g, m, v, lr, t, gs)
        for view, wd in self.views:
            if wd:
                p[view] *= np.float32(1 - lr * wd)
        q *= np.float32(lr * c)
        p -= q

    def lamb(self, p, g, m, v, lr, t, gs):
        c, q = self._moments_and_direction(g, m, v, lr, t, gs)
        q *= np.float32(c)
        cfg = self.cfg
        for view, wd in self.views:
            pv, dv = p[view], q[view]
            if wd:
                tv = self.tmp2[view]
                np.multiply(pv, np.float32(wd), out=tv)
                dv += tv
            w_norm, d_norm = math.sqrt(float(np.dot(pv, pv))), math.sqrt(float(np.dot(dv, dv)))
            r = lr * min(max(w_norm / d_norm, cfg.ratio_min), cfg.ratio_max) if w_norm and d_norm else lr
            dv *= np.float32(r)
            pv -= dv


def full_size_ops(model: onnx.ModelProto, n: int) -> list[str]:
    """Op types of the nodes that write N elements (a pass over memory each); views excluded."""
    inferred = onnx.shape_inference.infer_shapes(model)
    sizes = {v.name: math.prod(d.dim_value for d in v.type.tensor_type.shape.dim)
             for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    return [node.op_type for node in model.graph.node
            if node.op_type not in ("Reshape", "Identity") and any(sizes.get(o) == n for o in node.output)]


def interleaved_times(fns, repeats: int) -> list[list[float]]:
    """ms of each call of each function; calls interleaved so that all see the same machine load."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - start) * 1e3)
    return times


def bench(cfg: OptimizerConfig, params, threads: int, repeats: int) -> dict:
    n = sum(math.prod(s) for _, s in params)
    rng = np.random.default_rng(0)
    init = rng.normal(0, 0.02, n).astype(np.float32)
    grads = rng.normal(0, 1e-3, n).astype(np.float32)
    lr, gs = 1e-3, 0.5

    model = build_optimizer_graph(cfg, params)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    bufs = {"params": init.copy(), **{s: np.zeros(n, np.float32) for s in state_names(cfg)}}
    binding = sess.io_binding()
    for name, arr in bufs.items():
        value = ort.OrtValue.ortvalue_from_numpy(arr)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(f"{name}_out", value)
    binding.bind_cpu_input("grads", grads)
    binding.bind_cpu_input("lr", np.array(lr, np.float32))
    binding.bind_cpu_input("step", np.array(1, np.int64))
    binding.bind_cpu_input("grad_scale", np.array(gs, np.float32))

    np_opt = NumpyOptimizer(cfg, params, n)
    np_bufs = {"params": init.copy(), "exp_avg": np.zeros(n, np.float32), "exp_avg_sq": np.zeros(n, np.float32)}
    update = getattr(np_opt, cfg.name)

    def run_numpy():
        update(np_bufs["params"], grads, np_bufs["exp_avg"], np_bufs["exp_avg_sq"], lr, 1, gs)

    # same math: one step each from the same state
    sess.run_with_iobinding(binding)
    run_numpy()
    err = float(np.abs(bufs["params"] - np_bufs["params"]).max())
    if err > 1e-6:
        raise SystemExit(f"{cfg.name}: ONNX and NumPy disagree by {err}")

    onnx_ms, numpy_ms = interleaved_times([lambda: sess.run_with_iobinding(binding), run_numpy], repeats)
    slices = sum(node.op_type == "Slice" for node in model.graph.node)
    return dict(n=n, onnx_ms=onnx_ms, numpy_ms=numpy_ms, full_ops=full_size_ops(model, n), slices=slices,
                max_diff=err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=10e6, help="about this many parameters")
    ap.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    ap.add_argument("--repeats", type=int, default=20, help="timed updates per implementation")
    ap.add_argument("--optimizers", default="adamw,lamb")
    args = ap.parse_args()
    params = gpt2_like(args.params)
    print(f"{len(params)} tensors, {sum(math.prod(s) for _, s in params) / 1e6:.2f}M params, "
          f"{args.threads} ORT threads, {args.repeats} interleaved calls each")
    for name in args.optimizers.split(","):
        cfg = OptimizerConfig(name=name, weight_decay=0.01)
        r = bench(cfg, params, args.threads, args.repeats)
        per_m = 1e6 / r["n"]
        for stat in (statistics.median, min):
            onnx_ms, numpy_ms = stat(r["onnx_ms"]), stat(r["numpy_ms"])
            print(f"{name:6s} {stat.__name__:6s} ONNX {onnx_ms:7.2f} ms = {onnx_ms * per_m:.2f} ms/M   "
                  f"NumPy {numpy_ms:7.2f} ms = {numpy_ms * per_m:.2f} ms/M   "
                  f"ONNX/NumPy time {onnx_ms / numpy_ms:.2f}")
        print(f"       full-size ops {len(r['full_ops'])}: {' '.join(r['full_ops'])}"
              + (f" + {r['slices']} per-tensor Slices" if r["slices"] else "")
              + f"; ONNX vs NumPy max diff {r['max_diff']:.1e}")


if __name__ == "__main__":
    main()
