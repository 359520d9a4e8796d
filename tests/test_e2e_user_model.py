"""End to end on a user's forward ONNX model with ``.pb`` tensor data: train on 2 ranks, checkpoint every
step, resume; each optimizer and schedule checked against an independent float64 reference.

The model is a small MLP written with ``onnx.helper`` (x [B, 16] -> tanh -> scores [B, 5]; labels input
``target``, label -1 ignored); its data is
written by ``trainrun-data tensors`` in ONNX Runtime's ``.pb`` layout. With ``data.shuffle: false`` step
``t`` trains on samples ``16 (t-1) .. 16 t - 1`` (global batch 16), so the reference needs nothing of
trainrun: PyTorch computes the gradient of the mean cross-entropy, the optimizer rules come from
test_optim's NumPy references (written from the published update rules), the schedule from the formula
written out below. Every checkpointed step's weights must match the reference; a run resumed from step 3
must equal the uninterrupted one bit for bit (one intra-op thread per rank).
"""

import fnmatch
import json
import math
import os
import shutil

import numpy as np
import pytest

from conftest import TRAINRUN, TRAINRUN_DATA, mpirun, read_metrics, run
from test_optim import REFERENCE, decay_of

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too

IN, HIDDEN, CLASSES = 16, 32, 5
MICRO, ACCUM, WORLD = 4, 2, 2
GLOBAL = MICRO * ACCUM * WORLD
STEPS, SPLIT = 6, 3
IGNORE = -1          # model.loss.ignore_index


def initial_weights():
    rng = np.random.default_rng(7)
    return {"fc1.weight": rng.normal(0, 0.4, (IN, HIDDEN)).astype(np.float32),
            "fc1.bias": rng.normal(0, 0.1, (HIDDEN,)).astype(np.float32),
            "fc2.weight": rng.normal(0, 0.4, (HIDDEN, CLASSES)).astype(np.float32),
            "fc2.bias": np.zeros(CLASSES, np.float32)}        # ||w|| = 0: LAMB's unclamped branch


def write_mlp(path, weights):
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    nodes = [helper.make_node("MatMul", ["x", "fc1.weight"], ["h0"]),
             helper.make_node("Add", ["h0", "fc1.bias"], ["h1"]),
             helper.make_node("Tanh", ["h1"], ["h2"]),
             helper.make_node("MatMul", ["h2", "fc2.weight"], ["h3"]),
             helper.make_node("Add", ["h3", "fc2.bias"], ["scores"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", IN])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["b", CLASSES])],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


@pytest.fixture(scope="module")
def mlp_data(tmp_path_factory):
    """x and labels (a fixed random linear rule, learnable) as .pb tensors; the eval set without a
    manifest, as ONNX Runtime's own runner left its data."""
    root = tmp_path_factory.mktemp("mlp_data")
    rng = np.random.default_rng(3)
    rule = rng.normal(0, 1, (IN, CLASSES))
    out = {}
    for split, n in [("train", 160), ("eval", 48)]:
        x = rng.normal(0, 1, (n, IN)).astype(np.float32)
        y = np.argmax(x @ rule, axis=1).astype(np.int64)
        y[5::8] = IGNORE                                      # one ignored label in every micro-batch
        np.savez(root / f"{split}.npz", feat=x, y=y)
        run([TRAINRUN_DATA, "tensors", "--input", str(root / f"{split}.npz"), "--output", str(root / split),
             "--samples-per-file", "64", "--rename", "feat=x", "--rename", "y=target"], check=0)
        assert len(list((root / split).glob("*.pb"))) == math.ceil(n / 64)
        out[split] = (x, y)
    os.remove(root / "eval" / "manifest.json")
    return root, out


def lr_at(t, peak, s):
    """The documented schedule: linear warmup to ``peak`` over ``warmup`` steps, then the decay over the
    remaining steps to ``min_lr`` at STEPS."""
    warmup, floor = s.get("warmup_steps", 0), s.get("min_lr", 0.0)
    if t <= warmup:
        return peak * t / warmup
    x = (t - warmup) / (STEPS - warmup)
    decay = {"constant": 1.0, "linear": 1.0 - x, "poly": (1.0 - x) ** s.get("power", 0.5)}[s["name"]]
    return peak if s["name"] == "constant" else floor + (peak - floor) * decay


def reference(weights, data, opt, schedule, frozen):
    """float64: PyTorch's gradient of the mean cross-entropy, clipping, then the update rule; with
    LAMB's trust ratios (before clamping)."""
    import torch
    from trainrun.config import OptimizerConfig
    cfg = OptimizerConfig(**opt)
    x, y = (torch.from_numpy(a) for a in data)
    params = {k: v.astype(np.float64) for k, v in weights.items()}
    state = {k: {"momentum": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0} for k in params}
    trained, log = [k for k in params if not any(fnmatch.fnmatchcase(k, f) for f in frozen)], []
    history = []
    for t in range(1, STEPS + 1):
        p = {k: torch.tensor(v, requires_grad=k in trained) for k, v in params.items()}
        rows = slice((t - 1) * GLOBAL, t * GLOBAL)
        h = torch.tanh(x[rows].double() @ p["fc1.weight"] + p["fc1.bias"])
        logits = h @ p["fc2.weight"] + p["fc2.bias"]
        # the mean over micro-batches of each one's mean over its counted labels
        loss = sum(torch.nn.functional.cross_entropy(logits[i:i + MICRO], y[rows][i:i + MICRO],
                                                     ignore_index=IGNORE)
                   for i in range(0, GLOBAL, MICRO)) / (GLOBAL // MICRO)
        loss.backward()
        grads = {k: p[k].grad.numpy() for k in trained}
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
        if cfg.max_grad_norm and norm > cfg.max_grad_norm:
            grads = {k: g * (cfg.max_grad_norm / norm) for k, g in grads.items()}
        lr = lr_at(t, cfg.lr, schedule)
        for k in trained:
            params[k] = REFERENCE[cfg.name](cfg, params[k], grads[k], state[k], lr, t, decay_of(cfg, k), log)
        history.append({"loss": loss.item(), "grad_norm": norm, "params": dict(params)})
    return history, [r for r in log if r is not None]


CASES = {
    # SGD, Nesterov momentum, L2 decay, clipping active, poly schedule (power 2) with warmup and floor,
    # a frozen weight matrix
    "sgd_nesterov_poly_frozen": dict(
        optimizer={"name": "sgd", "lr": 0.5, "momentum": 0.8, "nesterov": True, "weight_decay": 0.01,
                   "max_grad_norm": 0.5},
        lr_schedule={"name": "poly", "power": 2.0, "warmup_steps": 2, "min_lr": 0.01},
        frozen=["fc1.w*"], eval=True),
    # Adam (L2 into the gradient), ORT's eps placement, own betas and no_decay, linear schedule, no eval set
    "adam_linear_no_eval": dict(
        optimizer={"name": "adam", "lr": 0.05, "betas": [0.8, 0.95], "eps": 1e-6, "eps_mode": "ort",
                   "weight_decay": 0.02, "no_decay": ["fc2.*"], "max_grad_norm": 0.0},
        lr_schedule={"name": "linear", "warmup_steps": 1, "min_lr": 0.005},
        engine={"graph_optimization": "basic"}, frozen=[], eval=False),
    # LAMB with the trust ratio clamped at both ends, no bias correction, constant schedule, the ONNX
    # optimizer graph instead of the host kernel, a frozen bias
    "lamb_ratio_clamped_graph": dict(
        optimizer={"name": "lamb", "lr": 0.1, "weight_decay": 0.01, "ratio_min": 0.1, "ratio_max": 0.15,
                   "bias_correction": False, "max_grad_norm": 2.0},
        lr_schedule={"name": "constant"}, engine={"optimizer_kernel": "graph"}, backend="mpi",
        frozen=["fc1.bias"], eval=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.torch
def test_user_onnx_model_trains_like_the_reference_and_resumes_exactly(tmp_path, mlp_data, case):
    import yaml
    from safetensors.numpy import load_file
    c = CASES[case]
    root, data = mlp_data
    weights = initial_weights()
    write_mlp(tmp_path / "mlp.onnx", weights)
    cfg = {
        "run": {"name": case, "output_dir": str(tmp_path / "run")},
        "model": {"builtin": None, "onnx": "mlp.onnx", "inputs": ["x"], "frozen": c["frozen"],
                  "loss": {"logits": "scores", "labels": "target", "ignore_index": IGNORE}},
        "data": {"train": str(root / "train"), "eval": str(root / "eval") if c["eval"] else None,
                 "shuffle": False, "prefetch": 0},
        "train": {"micro_batch_size": MICRO, "gradient_accumulation_steps": ACCUM, "max_steps": STEPS,
                  "eval_every": SPLIT, "eval_steps": 2, "log_every": 1},
        "optimizer": c["optimizer"], "lr_schedule": c["lr_schedule"],
        "checkpoint": {"every": 1, "keep_last": STEPS},
        "engine": {"threads": 1, **c.get("engine", {})},
        "tensorboard": {"enabled": False},
        "distributed": {"backend": c.get("backend", "auto")},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    mpirun(WORLD, "train", "--config", str(tmp_path / "c.yaml"))
    out = tmp_path / "run"
    train, evals = read_metrics(str(out))
    ref, ratios = reference(weights, data["train"], c["optimizer"], c["lr_schedule"], c["frozen"])
    if c["optimizer"]["name"] == "lamb":     # the case clamps LAMB's trust ratio at both ends
        assert min(ratios) < c["optimizer"]["ratio_min"] and max(ratios) > c["optimizer"]["ratio_max"]
    assert sorted(train) == list(range(1, STEPS + 1))
    assert train[STEPS]["loss"] < train[1]["loss"]
    trained = [k for k in weights if not any(fnmatch.fnmatchcase(k, p) for p in c["frozen"])]
    for t in range(1, STEPS + 1):
        assert train[t]["lr"] == pytest.approx(lr_at(t, c["optimizer"]["lr"], c["lr_schedule"]), rel=1e-12)
        assert train[t]["loss"] == pytest.approx(ref[t - 1]["loss"], rel=1e-5)
        assert train[t]["grad_norm"] == pytest.approx(ref[t - 1]["grad_norm"], rel=1e-5)
        got = load_file(str(out / "checkpoints" / str(t) / "model.safetensors"))
        assert sorted(got) == sorted(trained)            # frozen tensors are not parameters
        for k in trained:
            np.testing.assert_allclose(got[k], ref[t - 1]["params"][k], rtol=1e-4, atol=1e-6,
                                       err_msg=f"{k} at step {t}")
    # frozen tensors reach the exported model bit for bit; the trained ones changed
    import onnx
    from onnx import numpy_helper
    exported = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(out / "model.onnx")).graph.initializer}
    for k, w in weights.items():
        assert np.array_equal(exported[k], w) == (k not in trained), k
    if c["eval"]:
        assert sorted(evals) == [SPLIT, STEPS]
        x, y = (a[:2 * GLOBAL] for a in data["eval"])
        p = ref[-1]["params"]
        logits = np.tanh(x @ p["fc1.weight"] + p["fc1.bias"]) @ p["fc2.weight"] + p["fc2.bias"]
        shifted = logits - logits.max(axis=1, keepdims=True)
        nll = np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(y)), np.maximum(y, 0)]
        ce = np.mean([nll[i:i + MICRO][y[i:i + MICRO] != IGNORE].mean() for i in range(0, len(y), MICRO)])
        assert evals[STEPS]["eval_loss"] == pytest.approx(ce, rel=1e-5)
    else:
        assert not evals and json.loads((out / "summary.json").read_text())["final_eval_loss"] is None

    # an inference model of step 3 at another opset: the reference's logits
    run([TRAINRUN, "export", str(out / "checkpoints" / str(SPLIT)), "--output", str(tmp_path / "m.onnx"),
         "--opset", "18"], check=0)
    import onnxruntime as ort
    m = onnx.load(str(tmp_path / "m.onnx"))
    assert [o.version for o in m.opset_import if o.domain in ("", "ai.onnx")] == [18]
    x = data["train"][0][:8]
    p = ref[SPLIT - 1]["params"]
    logits = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(
        ["scores"], {"x": x})[0]
    np.testing.assert_allclose(logits, np.tanh(x @ p["fc1.weight"] + p["fc1.bias"]) @ p["fc2.weight"]
                               + p["fc2.bias"], rtol=1e-4, atol=1e-5)

    # resume from step 3 in a copy: steps 4..6 and the final state equal the uninterrupted run's bytes
    again = tmp_path / "again"
    shutil.copytree(out, again)
    for t in range(SPLIT + 1, STEPS + 1):
        shutil.rmtree(again / "checkpoints" / str(t))
    (again / "metrics.jsonl").write_text("")
    mpirun(WORLD, "resume", str(again / "checkpoints" / str(SPLIT)))
    cont, _ = read_metrics(str(again))
    assert sorted(cont) == list(range(SPLIT + 1, STEPS + 1))
    assert all(cont[t]["loss"] == train[t]["loss"] and cont[t]["lr"] == train[t]["lr"] for t in cont)
    for name in ("model.safetensors", "optimizer.safetensors"):
        a = (out / "checkpoints" / str(STEPS) / name).read_bytes()
        assert (again / "checkpoints" / str(STEPS) / name).read_bytes() == a, name
