"""CNN train steps: trainrun's own gradient builder against onnxruntime-training's, and PyTorch eager.

    .venv-training/bin/python scripts/bench/cnn_builders.py [--models resnet18,squeezenet,efficientnet_b0,shufflenet]
        [--rounds 5] [--steps 4] [--work runs/cnn-builders] [--baseline DIR] [--no-build] [--profile]

Four hand-written torch modules with torchvision's architectures (torchvision does not import beside this
torch): ResNet-18 (BasicBlock), SqueezeNet 1.1, an EfficientNet-B0-like net (MBConv with squeeze-excitation
and SiLU, no stochastic depth) and a ShuffleNetV2 x1.0-like net; random weights (torch's initialisation,
seeded), 1000 classes, batch 2 x 3 x 64 x 64. Each is exported in training mode
(``torch.onnx.export(dynamo=False, training=TrainingMode.TRAINING, do_constant_folding=False)``) and its loss
graph made as ``trainrun prepare`` makes it (``graphs.manifest.loss_graph``: cross-entropy, the batch fixed:
engine.static_shapes), then built into a train graph by each builder (``build_train_graph`` with builder
onnxruntime, then ``direct_gradients``; with builder trainrun, then ``graphs.fusion.fuse`` as ``prepare``
applies it by default, ``graphs.fuse``), written to WORK/<model>/. ``time`` opens
each in a session as the engine does (``trainrun.step.sessions.session_options``, 1 thread, optimisation
'all'), binds the weights, batch and gradient buffers once, and runs forward + backward: ``--rounds``
rounds, each ``--steps`` steps of trainrun's graph, then onnxruntime-training's, then PyTorch eager (the
same module, train mode, the same batch: forward, cross-entropy, backward, 1 thread), in turn, after
warm-up (``--baseline DIR``: an older checkout's own-builder graphs, built by its copy of this script into
DIR, timed in the same rounds). Prints min and median per setup and the 1-minute load over the rounds, and
writes WORK/results.json. ``--profile`` instead runs each graph under onnxruntime's profiler and prints the
time by operator type, by the forward op a node belongs to, and the slowest nodes. Stock onnxruntime (no
training build, so no onnxruntime-training builder): build with the training build's venv, then time the
same WORK there with ``--no-build``; onnxruntime-training's graph does not open (its training ops) and is
left out.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
BATCH, SIZE, CLASSES = 2, 64, 1000
GRAPHS = ("trainrun", "onnxruntime")


def modules():
    """{name: a function making the torch module}."""
    import torch
    from torch import nn

    def conv_bn(cin, cout, k, stride=1, groups=1, act=nn.ReLU):
        layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, *([act()] if act else []))

    class Basic(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.a = conv_bn(cin, cout, 3, stride)
            self.b = conv_bn(cout, cout, 3, act=None)
            self.down = conv_bn(cin, cout, 1, stride, act=None) if stride != 1 or cin != cout else None

        def forward(self, x):
            return torch.relu(self.b(self.a(x)) + (x if self.down is None else self.down(x)))

    def resnet18():
        layers = [conv_bn(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1)]
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [Basic(cin, cout, stride), Basic(cout, cout, 1)]
            cin = cout
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, CLASSES))

    class Fire(nn.Module):
        def __init__(self, cin, squeeze, e1, e3):
            super().__init__()
            self.s = nn.Conv2d(cin, squeeze, 1)
            self.e1, self.e3 = nn.Conv2d(squeeze, e1, 1), nn.Conv2d(squeeze, e3, 3, padding=1)

        def forward(self, x):
            s = torch.relu(self.s(x))
            return torch.cat([torch.relu(self.e1(s)), torch.relu(self.e3(s))], 1)

    def squeezenet():
        pool = lambda: nn.MaxPool2d(3, 2, ceil_mode=True)   # noqa: E731
        return nn.Sequential(
            nn.Conv2d(3, 64, 3, 2), nn.ReLU(), pool(), Fire(64, 16, 64, 64), Fire(128, 16, 64, 64), pool(),
            Fire(128, 32, 128, 128), Fire(256, 32, 128, 128), pool(), Fire(256, 48, 192, 192),
            Fire(384, 48, 192, 192), Fire(384, 64, 256, 256), Fire(512, 64, 256, 256),
            nn.Dropout(0.5), nn.Conv2d(512, CLASSES, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())

    class MBConv(nn.Module):
        def __init__(self, cin, cout, expand, k, stride):
            super().__init__()
            mid = cin * expand
            self.expand = conv_bn(cin, mid, 1, act=nn.SiLU) if expand != 1 else None
            self.dw = conv_bn(mid, mid, k, stride, groups=mid, act=nn.SiLU)
            sq = max(1, cin // 4)
            self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(mid, sq, 1), nn.SiLU(), nn.Conv2d(sq, mid, 1),
                                    nn.Sigmoid())
            self.project = conv_bn(mid, cout, 1, act=None)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            h = self.dw(x if self.expand is None else self.expand(x))
            h = self.project(h * self.se(h))
            return h + x if self.residual else h

    def efficientnet_b0():
        layers, cin = [conv_bn(3, 32, 3, 2, act=nn.SiLU)], 32
        for expand, k, stride, cout, n in ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
                                           (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)):
            for i in range(n):
                layers.append(MBConv(cin, cout, expand, k, stride if i == 0 else 1))
                cin = cout
        return nn.Sequential(*layers, conv_bn(320, 1280, 1, act=nn.SiLU), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Dropout(0.2), nn.Linear(1280, CLASSES))

    class Shuffle(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            half = cout // 2
            self.stride = stride
            self.branch1 = nn.Sequential(conv_bn(cin, cin, 3, stride, groups=cin, act=None),
                                         conv_bn(cin, half, 1)) if stride > 1 else None
            self.branch2 = nn.Sequential(conv_bn(cin if stride > 1 else half, half, 1),
                                         conv_bn(half, half, 3, stride, groups=half, act=None), conv_bn(half, half, 1))

        def forward(self, x):
            if self.stride == 1:
                a, b = x.chunk(2, dim=1)
                out = torch.cat([a, self.branch2(b)], 1)
            else:
                out = torch.cat([self.branch1(x), self.branch2(x)], 1)
            n, c, h, w = out.shape
            return out.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)

    def shufflenet():
        layers, cin = [conv_bn(3, 24, 3, 2), nn.MaxPool2d(3, 2, 1)], 24
        for cout, n in ((116, 4), (232, 8), (464, 4)):
            for i in range(n):
                layers.append(Shuffle(cin, cout, 2 if i == 0 else 1))
                cin = cout
        return nn.Sequential(*layers, conv_bn(464, 1024, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(1024, CLASSES))

    return {"resnet18": resnet18, "squeezenet": squeezenet, "efficientnet_b0": efficientnet_b0,
            "shufflenet": shufflenet}


def build(name: str, work: Path) -> None:
    """WORK/<name>/: model.onnx (the export), trainrun.onnx and onnxruntime.onnx (the train graphs),
    inputs.npz (weights and a batch), module.pt (the torch module's weights)."""
    import onnx
    import torch
    from trainrun import config as C
    from trainrun.graphs.casts import restore_fp32
    from trainrun.graphs.forward import forward_from_config
    from trainrun.graphs.fusion import fuse
    from trainrun.graphs.gradients import build_train_graph, direct_gradients
    from trainrun.graphs.manifest import build_options, loss_graph
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    net = modules()[name]().train()
    torch.save(net.state_dict(), out / "module.pt")
    x = torch.randn(BATCH, 3, SIZE, SIZE)
    torch.onnx.export(net, (x,), str(out / "model.onnx"), input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "b"}, "logits": {0: "b"}}, opset_version=17, dynamo=False,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    net.load_state_dict(torch.load(out / "module.pt"))     # the export ran the module: running stats moved
    cfg = C.from_dict({"model": {"builtin": None, "onnx": str(out / "model.onnx"), "loss": {"logits": "logits"}},
                       "train": {"micro_batch_size": BATCH}, "run": {"output_dir": str(out / "run")}})
    fwd = forward_from_config(cfg)
    opts = build_options(cfg)
    loss_model, dropout = loss_graph(cfg, fwd, opts)
    states = list((fwd.states or {}).values())
    timing = {}
    t = time.perf_counter()
    theirs, _ = direct_gradients(restore_fp32(build_train_graph(loss_model, fwd.params, name, keep=states),
                                              opts["precision"]))
    timing["onnxruntime"] = time.perf_counter() - t
    t = time.perf_counter()
    ours = fuse(restore_fp32(build_train_graph(loss_model, fwd.params, name, keep=states, builder="trainrun"),
                             opts["precision"]))
    timing["trainrun"] = time.perf_counter() - t
    onnx.save(theirs, out / "onnxruntime.onnx")
    onnx.save(ours, out / "trainrun.onnx")
    from onnx import helper, numpy_helper
    inits = {t.name: numpy_helper.to_array(t) for t in fwd.model.graph.initializer}
    rng = np.random.default_rng(0)
    feeds = {"x": x.numpy(), "labels": rng.integers(0, CLASSES, BATCH).astype(np.int64)}
    for vi in loss_model.graph.input:
        if vi.name in inits:
            feeds[vi.name] = inits[vi.name]
        elif vi.name not in feeds:       # a dropout mask: keep everything (torch's dropout is off below)
            dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
            feeds[vi.name] = np.ones(dims, helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
    np.savez(out / "inputs.npz", **feeds)
    counts = {k: dict(collections.Counter(n.op_type for n in g.graph.node).most_common())
              for k, g in (("onnxruntime", theirs), ("trainrun", ours))}
    (out / "graphs.json").write_text(json.dumps({"build_s": timing, "op_types": counts}, indent=1))
    print(name, json.dumps({"build_s": timing, "nodes": {k: sum(v.values()) for k, v in counts.items()}}))


class Torch:
    """The same module in PyTorch eager, train mode (dropout off, as the graphs' masks of ones), 1 thread."""

    def __init__(self, name: str, work: Path, feeds: dict):
        import torch
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.torch = torch
        self.net = modules()[name]()
        self.net.load_state_dict(torch.load(work / name / "module.pt"))
        self.net.train()
        for m in self.net.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        self.x, self.y = torch.tensor(feeds["x"]), torch.tensor(feeds["labels"])

    def step(self) -> float:
        t = time.perf_counter()
        for p in self.net.parameters():
            p.grad = None
        loss = self.torch.nn.functional.cross_entropy(self.net(self.x), self.y)
        loss.backward()
        self.last = float(loss)
        return time.perf_counter() - t


def time_model(name: str, work: Path, rounds: int, steps: int, warmup: int, baseline: Path | None) -> dict:
    from builders import Loop
    import onnxruntime as ort
    feeds = dict(np.load(work / name / "inputs.npz"))
    setups = {}
    for k in GRAPHS:
        try:
            setups[k] = Loop(work / name / f"{k}.onnx", feeds, 1)
        except Exception as exc:  # noqa: BLE001 - onnxruntime's own error types: an op this build lacks
            print(f"{name}: {k}.onnx does not open on onnxruntime {ort.__version__} ({str(exc).splitlines()[0][:160]})")
    if baseline is not None:        # the own builder's graph of an older checkout, the same model and batch
        setups["baseline"] = Loop(baseline / name / "trainrun.onnx", feeds, 1)
    setups["torch"] = Torch(name, work, feeds)
    return alternate(setups, rounds, steps, warmup)


def alternate(setups: dict, rounds: int, steps: int, warmup: int, ready=None) -> dict:
    """Time ``setups`` ({name: an object whose ``step()`` returns its seconds}) in turn: ``warmup`` steps
    each, then ``rounds`` rounds of ``steps`` steps of each setup after the other; ``ready()`` (a barrier
    of other processes timing at once) is called between the warm-up and the rounds. Returns the ms per
    step (min, median, steps), each setup's last loss (``loss()``, or ``last``) and the 1-minute load's
    least and largest over the rounds."""
    times = {k: [] for k in setups}
    for s in setups.values():
        for _ in range(warmup):
            s.step()
    if ready is not None:
        ready()
    load = [os.getloadavg()[0]]
    for _ in range(rounds):
        for k, s in setups.items():
            times[k] += [s.step() for _ in range(steps)]
        load.append(os.getloadavg()[0])
    losses = {k: (s.loss() if hasattr(s, "loss") else s.last) for k, s in setups.items()}
    return {"ms": {k: {"min": 1e3 * min(v), "median": 1e3 * float(np.median(v)), "steps": len(v)}
                   for k, v in times.items()},
            "loss": losses, "load_1min": [min(load), max(load)]}


def profile(name: str, work: Path, steps: int, top: int = 40, graphs=GRAPHS) -> None:
    """Each graph (WORK/<name>/<graph>.onnx, fed WORK/<name>/inputs.npz) by time per operator type, per
    forward op behind it, and its slowest nodes (onnxruntime's profiler, ``steps`` runs after one warm-up,
    each node's fastest run)."""
    import onnxruntime as ort
    from trainrun.step.sessions import session_options
    feeds = dict(np.load(work / name / "inputs.npz"))
    for k in graphs:
        path = work / name / f"{k}.onnx"
        so = session_options(1, k, profile_prefix=str(work / name / "profile"))
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        names = {i.name for i in sess.get_inputs()}
        fed = {n: v for n, v in feeds.items() if n in names}
        for _ in range(steps + 1):
            sess.run(None, fed)
        events = json.loads(Path(sess.end_profiling()).read_text())
        runs = [e for e in events if e.get("name") == "model_run"]
        first_end = runs[0]["ts"] + runs[0]["dur"]           # the warm-up run left out
        fastest = {}       # each node's fastest run: a shared machine's preemptions left out
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] > first_end:
                key = (e["args"]["op_name"], e["name"][:-12])
                fastest[key] = min(fastest.get(key, np.inf), e["dur"] / 1e3)
        by_op, by_node, by_rule = collections.Counter(), collections.Counter(), collections.Counter()
        for (op, node), ms in fastest.items():
            by_op[op] += ms
            by_node[(op, node)] += ms
            by_rule[_rule(node, op)] += ms
        total = sum(by_op.values())
        print(f"\n{name} {k}: {total:.1f} ms in kernels (each node's fastest of {steps}), {len(fastest)} nodes; "
              f"model_run median "
              f"{np.median([r['dur'] for r in runs[1:]]) / 1e3:.1f} ms")
        for op, ms in by_op.most_common(top):
            print(f"  {op:32s} {ms:7.2f} ms {100 * ms / total:5.1f}%")
        print("  by the forward op a node differentiates (own builder) or computes:")
        for rule, ms in by_rule.most_common(top):
            print(f"    {rule:30s} {ms:7.2f} ms {100 * ms / total:5.1f}%")
        print("  slowest nodes:")
        for (op, node), ms in by_node.most_common(top):
            print(f"    {op:24s} {ms:7.2f} ms  {node}")


def _rule(node: str, op: str) -> str:
    """The forward op behind a node: "grad <op>" for the own builder's (named grad/<forward node>/<op>),
    onnxruntime-training's (<forward node>_Grad/...), else the node's own op."""
    if node.startswith("grad/"):
        return "grad " + node[5:].rsplit("/", 1)[0].rsplit("/", 1)[-1].split("_")[0].split(".")[0]
    if "_Grad/" in node:
        return "grad " + node.split("_Grad/")[0].rsplit("/", 1)[-1].split("_")[0]
    return op


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet18,squeezenet,efficientnet_b0,shufflenet")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "cnn-builders")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="steps of one setup before the next's, per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-build", action="store_true", help="time the graphs WORK already holds")
    ap.add_argument("--profile", action="store_true", help="profile the graphs instead of timing them")
    ap.add_argument("--baseline", type=Path, help="also time DIR/<model>/trainrun.onnx (an older checkout's "
                    "own-builder graphs, built by this script into DIR) in the same rounds")
    args = ap.parse_args()
    names = [m for m in args.models.split(",") if m]
    if not args.no_build:
        for name in names:
            build(name, args.work)
    if args.profile:
        for name in names:
            profile(name, args.work, args.steps)
        return
    results = {}
    for name in names:
        results[name] = time_model(name, args.work, args.rounds, args.steps, args.warmup, args.baseline)
    import onnxruntime as ort
    import common
    meta = {"cpu": common.cpu_name(), "onnxruntime": ort.__version__, "threads": 1, "baseline": str(args.baseline),
            "batch": [BATCH, 3, SIZE, SIZE], "rounds": args.rounds, "steps": args.steps,
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    (args.work / "results.json").write_text(json.dumps({"meta": meta, "models": results}, indent=1))
    print(f"\n{meta['cpu']}, onnxruntime {meta['onnxruntime']}, 1 thread, batch {BATCH}x3x{SIZE}x{SIZE}; "
          f"ms per forward+backward, min / median of {args.rounds} x {args.steps}")
    cols = [("trainrun", "own builder"), ("onnxruntime", "ORT builder"), ("torch", "PyTorch eager")]
    if args.baseline is not None:
        cols.insert(1, ("baseline", "own (baseline)"))
    print(f"{'model':16s} " + " ".join(f"{title:>16s}" for _, title in cols) + f" {'own/ORT (med)':>14s} {'load':>10s}")
    for name, r in results.items():
        ms = r["ms"]
        cells = [f"{ms[k]['min']:6.1f} / {ms[k]['median']:6.1f}" if k in ms else "-" for k, _ in cols]
        ratio = (f"{ms['trainrun']['median'] / ms['onnxruntime']['median']:.2f}" if "onnxruntime" in ms
                 else "-")      # stock onnxruntime: the training build's graph does not open
        print(f"{name:16s} " + " ".join(f"{c:>16s}" for c in cells) + f" {ratio:>14s} "
              f"{r['load_1min'][0]:4.1f}-{r['load_1min'][1]:4.1f}")


if __name__ == "__main__":
    main()
