"""`trainrun prepare`: the three graphs from the built-in GPT-2 and from a user's torch.onnx export."""

import json
import os

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from trainrun import config as C
from trainrun.graphs.gradients import ort_builder_missing
from trainrun.graphs.manifest import load_manifest, prepare, up_to_date
from trainrun.graphs.names import BUFFER_SUFFIX, RESET
from trainrun.step.engine import Engine, EngineOptions
from trainrun.errors import UsageError
from trainrun.step.optim import state_names
from trainrun.run.rundir import sha256_file
from trainrun.run.validity import check
from trainrun.sync.update import optimizer_for

from conftest import ROOT, TRAINRUN, run, optional

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too

torch = optional("torch")


def test_prepare_cli_writes_graphs(tmp_path):
    out = tmp_path / "run"
    run([TRAINRUN, "prepare", "--config", os.path.join(ROOT, "configs", "gpt2-tiny.yaml"),
         "--set", f"run.output_dir={out}"], check=0)
    g = out / "graphs"
    for f in ("train.onnx", "eval.onnx", "optimizer.onnx", "forward.onnx", "weights.safetensors", "manifest.json"):
        assert (g / f).exists(), f
    manifest = json.loads((g / "manifest.json").read_text())
    assert manifest["num_params"] == sum(int(np.prod(p["shape"])) for p in manifest["params"])
    assert manifest["files"]["train.onnx"] == sha256_file(str(g / "train.onnx"))
    train = onnx.load(str(g / "train.onnx"))
    names = {i.name for i in train.graph.input}
    ops = {n.op_type for n in train.graph.node}
    # onnxruntime-training's builder (auto where installed): accumulators; trainrun's: gradients as outputs
    if manifest["builder"] == "onnxruntime":
        assert {"input_ids", "labels", RESET, "transformer.wte.weight",
                "transformer.wte.weight" + BUFFER_SUFFIX} <= names and "InPlaceAccumulatorV2" in ops
    else:
        assert {"input_ids", "labels", "transformer.wte.weight"} <= names and RESET not in names
        assert "transformer.wte.weight_grad" in {o.name for o in train.graph.output}
    assert manifest["builder"] == ("trainrun" if ort_builder_missing() else "onnxruntime")
    assert not train.graph.initializer or all(t.name not in names for t in train.graph.initializer)
    assert train.ir_version <= 10
    forward = onnx.load(str(g / "forward.onnx"))
    assert not {n.op_type for n in forward.graph.node} & {"InPlaceAccumulatorV2", "SoftmaxCrossEntropyLoss"}
    # graphs are reused while the config matches; a manifest from before dropout masks (no "dropout"
    # entry: its graphs ran onnxruntime's Dropout, at ratio 0 under run.deterministic) is prepared again
    cfg = C.load_config(os.path.join(ROOT, "configs", "gpt2-tiny.yaml"), [f"run.output_dir={out}"])
    assert up_to_date(str(g), cfg)
    for key in ("dropout", "graph_version"):    # graphs of an older trainrun's surgery
        (g / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != key}))
        assert not up_to_date(str(g), cfg), key


def export_user_gpt2(path, shape, seq, pdrop=0.0):
    """A GPT-2 forward exported from transformers with torch.onnx (the legacy exporter)."""
    torch.manual_seed(0)
    from transformers import GPT2Config, GPT2LMHeadModel
    hf = GPT2LMHeadModel(GPT2Config(**shape, resid_pdrop=pdrop, embd_pdrop=pdrop, attn_pdrop=pdrop,
                                    bos_token_id=0, eos_token_id=0))

    class Forward(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):   # an explicit mask keeps the trace exportable (transformers 5)
            return self.m(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits

    ids = torch.zeros((2, seq), dtype=torch.int64)
    torch.onnx.export(Forward(hf), (ids,), str(path), input_names=["input_ids"], output_names=["logits"],
                      dynamic_axes={"input_ids": {0: "batch"}, "logits": {0: "batch"}}, opset_version=14,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, dynamo=False)
    return hf


@pytest.mark.torch
def test_user_torch_onnx_gpt2_prepares_and_trains(tmp_path, tiny_gpt2):
    seq, batch = 16, 4
    hf = export_user_gpt2(tmp_path / "user.onnx", tiny_gpt2, seq)
    cfg = C.from_dict({"model": {"builtin": None, "onnx": str(tmp_path / "user.onnx"), "inputs": ["input_ids"]},
                       "optimizer": {"name": "adamw", "lr": 1e-2},
                       "run": {"output_dir": str(tmp_path / "run")}, "data": {"seq_len": seq},
                       "train": {"micro_batch_size": batch}})
    graphs_dir = prepare(cfg)
    manifest = load_manifest(graphs_dir)
    assert manifest["num_params"] == sum(p.numel() for p in hf.parameters())
    shapes = {"input_ids": ((batch, seq), np.int64), "labels": ((batch, seq), np.int64)}
    eng = Engine(graphs_dir, EngineOptions(threads=2), shapes, shapes)
    opt = optimizer_for(eng, cfg.optimizer)
    eng.load_weights()
    rng = np.random.default_rng(0)
    data = {"input_ids": rng.integers(0, 300, (batch, seq)), "labels": rng.integers(0, 300, (batch, seq))}

    # gradients agree with torch for the same weights
    loss0 = eng.forward_backward(data, accumulate=False)
    logits = hf(torch.from_numpy(data["input_ids"])).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), torch.from_numpy(data["labels"]).reshape(-1))
    ref.backward()
    assert loss0 == pytest.approx(ref.item(), rel=1e-5)
    named = {"m." + k: v for k, v in hf.named_parameters()}
    for name, grad in eng.layout.unflatten(eng.grads).items():
        r = named[name].grad.numpy()
        assert np.abs(grad - r).max() <= 1e-4 * np.abs(r).max() + 1e-9, name

    # and it trains: memorising one batch drives the loss down
    losses = []
    for step in range(1, 31):
        losses.append(eng.forward_backward(data, accumulate=False))
        opt.step(lr=1e-2, t=step, grad_scale=1.0)
    assert losses[-1] < 0.5 * losses[0], losses


def _model(op_nodes, inits, out="logits"):
    g = helper.make_graph(op_nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["b", 3])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def test_the_checked_user_graph_is_the_one_prepared(tmp_path):
    """Start-up builds a user's forward graph once: the one validity's check built, handed to prepare, gives
    the graphs prepare builds on its own."""
    onnx.save(_model([helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Tanh", ["h"], ["logits"])],
                     {"W": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)}), str(tmp_path / "user.onnx"))
    cfg = C.from_dict({"model": {"builtin": None, "onnx": str(tmp_path / "user.onnx"), "inputs": ["x"]},
                       "run": {"output_dir": str(tmp_path / "run")}})
    fwd = check(cfg).forward
    assert fwd is not None and fwd.params == ["W"]
    own = load_manifest(prepare(cfg, str(tmp_path / "own")))
    os.remove(tmp_path / "user.onnx")       # not read again: prepare takes the graph the check built
    shared = load_manifest(prepare(cfg, str(tmp_path / "shared"), fwd))
    assert shared["files"] == own["files"]
    assert shared["params"] == own["params"] == [{"name": "W", "shape": [4, 3]}]
    assert check(C.from_dict({"run": {"output_dir": str(tmp_path / "run")}})).forward is None    # built-in GPT-2


@pytest.mark.parametrize("case,expected", [
    ("no_gradient", "operator Round has no gradient"),
    # an assertion of onnxruntime-training's builder: a gradient that reads an optional output the node does
    # not write; trainrun's builder (where the training build is not installed) has no rule for the op
    ("builder_check", "onnxruntime's gradient builder cannot differentiate this graph: its internal check "
                      "'i < node_->OutputDefs().size()' failed: the gradient of a node reads an output the node "
                      "does not write; SimplifiedLayerNormalization node 'norm' (an operator onnx does not define: "
                      "its optional outputs unknown here). Export the model with every output of such a node"
                      if ort_builder_missing() is None else
                      "trainrun's gradient builder cannot differentiate this graph: no gradient rule for op type "
                      "'SimplifiedLayerNormalization' (node 'norm')"),
    ("missing_input", "model.inputs: 'features' is not an input"),
    ("missing_logits", "model.loss.logits: 'scores' is not an output"),
    ("loss_not_scalar", "model.loss.output: 'logits' of {src} must be a scalar (rank 0), its shape is ['b', 3]"),
    ("class_weights", "model.loss.weights: 2 weights, but 'logits' of {src} has 3 classes (axis -1)"),
])
def test_bad_user_graphs_are_named(tmp_path, case, expected):
    w = {"W": np.ones((4, 3), np.float32)}
    if case == "no_gradient":
        m = _model([helper.make_node("Round", ["W"], ["Wr"]), helper.make_node("MatMul", ["x", "Wr"], ["logits"])], w)
    elif case == "builder_check":       # onnxruntime's op: its gradient reads the optional inv_std_var output
        m = _model([helper.make_node("MatMul", ["x", "W"], ["h"]),
                    helper.make_node("SimplifiedLayerNormalization", ["h", "g"], ["logits"], axis=-1, name="norm")],
                   {**w, "g": np.ones(3, np.float32)})
    else:
        m = _model([helper.make_node("MatMul", ["x", "W"], ["logits"])], w)
    onnx.save(m, str(tmp_path / "user.onnx"))
    model = {"builtin": None, "onnx": "user.onnx", "inputs": ["x"]}
    if case == "missing_input":
        model["inputs"] = ["features"]
    if case == "missing_logits":
        model["loss"] = {"logits": "scores"}
    if case == "loss_not_scalar":
        model["loss"] = {"output": "logits"}
    if case == "class_weights":
        model["loss"] = {"weights": [1.0, 2.0]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"model": model, "run": {"output_dir": "run"}}))
    proc = run([TRAINRUN, "prepare", "--config", str(tmp_path / "c.yaml")], check=2)
    assert expected.format(src=tmp_path / "user.onnx") in proc.stderr and "user.onnx" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_static_shapes_fix_only_the_train_graph(tmp_path, tiny_gpt2):
    cfg = C.from_dict({"model": {"gpt2": tiny_gpt2}, "data": {"seq_len": 16}, "train": {"micro_batch_size": 3},
                       "run": {"output_dir": str(tmp_path / "run")}})
    graphs_dir = prepare(cfg)
    assert load_manifest(graphs_dir)["build"]["static_shape"] == [3, 16]

    def dims(name, tensor):
        graph = onnx.load(os.path.join(graphs_dir, f"{name}.onnx")).graph
        vi = next(v for v in list(graph.input) + list(graph.output) if v.name == tensor)
        return [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim]
    assert dims("train", "input_ids") == [3, 16] and dims("train", "labels") == [3, 16]
    assert dims("eval", "input_ids") == ["batch", "seq"] and dims("forward", "logits") == ["batch", "seq", 300]
    wrong = {"input_ids": ((2, 16), np.int64), "labels": ((2, 16), np.int64)}
    with pytest.raises(UsageError, match=r"train.onnx: the data does not fit the graph's inputs \(its train graph "
                                         r"was prepared for the micro-batch x length \[3, 16\]: prepare again"):
        Engine(graphs_dir, EngineOptions(), wrong, wrong)
