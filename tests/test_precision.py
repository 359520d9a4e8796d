"""Mixed precision on the CPU: what runs there. onnxruntime-training 1.19.2's CPU provider cannot run
an fp16 or bf16 train graph (measured: fp16 fails in SliceGrad, "Type for T or Tind not supported";
bf16 finds no Add kernel), so the fp16/bf16 training runs are in tests/test_gpu.py; here: the cast
pass's graphs, the fp16 forward (onnxruntime's CPU provider runs it, casting to fp32 where it lacks
an fp16 kernel), the loss scaler's rules and its state, and the config check."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from conftest import TRAINRUN, run, write_config
from trainrun import config as C
from trainrun.graphs.casts import PRECISIONS, cast_pass, FP32_OPS, scale_loss
from trainrun.graphs.dropout_nodes import dropout_masks
from trainrun.graphs.forward import forward_from_config
from trainrun.graphs.gradients import build_train_graph, builder
from trainrun.graphs.losses import with_loss
from trainrun.graphs.names import BUFFER_SUFFIX, GRAD_SUFFIX
from trainrun.graphs.onnx_edit import params_to_inputs
from trainrun.step.precision import LossScaler

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too


def loss_graph(precision, shape):
    cfg = C.Config()
    for k, v in shape.items():
        setattr(cfg.model.gpt2, k, v)
    fwd = forward_from_config(cfg)
    model = params_to_inputs(with_loss(fwd, -100, keep_logits=False), fwd.params)
    model, _ = dropout_masks(model, fwd.inputs, "gpt2")
    return fwd, scale_loss(cast_pass(model, precision), precision)


def test_fp32_graph_is_untouched(tiny_gpt2):
    fwd, model = loss_graph("fp32", tiny_gpt2)
    _, again = loss_graph("fp32", tiny_gpt2)
    assert not any(n.op_type == "Cast" for n in model.graph.node)
    assert model.SerializeToString() == again.SerializeToString()


@pytest.mark.parametrize("precision,elem", [("fp16", TensorProto.FLOAT16), ("bf16", TensorProto.BFLOAT16)])
def test_cast_after_each_parameter_fp32_islands_and_fp32_gradients(tiny_gpt2, precision, elem):
    fwd, model = loss_graph(precision, tiny_gpt2)
    casts = {n.input[0]: n.attribute[0].i for n in model.graph.node if n.op_type == "Cast"}
    by_input = {}
    for n in model.graph.node:
        for i in n.input:
            by_input.setdefault(i, []).append(n)
    for p in fwd.params:
        users = by_input[p]
        # a parameter feeds fp32 ops (LayerNorm) directly, everything else through its Cast
        assert all(u.op_type in FP32_OPS or (u.op_type == "Cast" and casts[p] == elem) for u in users), p
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    for n in model.graph.node:
        if n.op_type in ("LayerNormalization", "Softmax", "SoftmaxCrossEntropyLoss"):
            assert all(types.get(i) not in (TensorProto.FLOAT16, TensorProto.BFLOAT16) for i in n.input), n.name
        if n.op_type == "MatMul":
            assert types[n.output[0]] == elem, n.name
    assert ("loss_scale" in {i.name for i in model.graph.input}) == (precision == "fp16")
    made_by = builder("auto")[0]       # onnxruntime-training's where installed, else trainrun's
    train = build_train_graph(model, fwd.params, "gpt2", builder=made_by)
    ins = {i.name: i.type.tensor_type.elem_type for i in train.graph.input}
    grads = {o.name: o.type.tensor_type.elem_type for o in train.graph.output} if made_by == "trainrun" else \
        {p + GRAD_SUFFIX: ins[p + BUFFER_SUFFIX] for p in fwd.params}
    for p in fwd.params:       # the master parameters and their gradients (or gradient buffers) stay float32
        assert ins[p] == grads[p + GRAD_SUFFIX] == TensorProto.FLOAT


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_values_of_integers_and_constants_alone_keep_float32(precision):
    """The Llama family's rotary angles (positions x inverse frequencies, their cos and sin) and causal mask
    come from integers and constants only: they keep float32 (a position above 256 is not exact in bf16,
    above 2048 not in fp16) and are cast to the compute type only where an activation reads them."""
    cfg = C.Config()
    cfg.model.builtin = "llama"
    cfg.model.llama = C.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                                    num_hidden_layers=1, max_position_embeddings=8192)
    fwd = forward_from_config(cfg)
    model = cast_pass(params_to_inputs(with_loss(fwd, -100, keep_logits=False), fwd.params), precision)
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in list(inferred.graph.value_info) + list(inferred.graph.input)}
    trig = [n for n in model.graph.node if n.op_type in ("Cos", "Sin")]
    assert len(trig) == 2 and all(types[n.input[0]] == types[n.output[0]] == TensorProto.FLOAT for n in trig)
    ints = [n for n in model.graph.node if n.op_type == "Cast" and types.get(n.input[0]) == TensorProto.INT64]
    assert ints and all(n.attribute[0].i == TensorProto.FLOAT for n in ints)
    assert any(n.op_type == "MatMul" and types[n.output[0]] == PRECISIONS[precision] for n in model.graph.node)


def test_fp16_forward_on_cpu_close_to_fp32(tiny_gpt2):
    """fp16 rounds each op's result to 11 significant bits (relative 2^-11 = 4.9e-4); a 2-layer model
    is a few tens of such roundings deep, most of which average out: the loss (a mean over 256 tokens
    of log-probabilities computed in fp32 from fp16 logits) within 1e-2 relative of fp32's, and not
    equal to it (the cast pass did change the computation)."""
    out = {}
    ids = (np.arange(256).reshape(4, 64) * 7) % tiny_gpt2["vocab_size"]
    for prec in ("fp32", "fp16"):
        fwd, model = loss_graph(prec, tiny_gpt2)
        inits = {t.name: numpy_helper.to_array(t) for t in fwd.model.graph.initializer}
        feeds = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1), **{p: inits[p] for p in fwd.params}}
        if prec == "fp16":
            feeds["loss_scale"] = np.array(1024.0, np.float32)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        out[prec] = float(s.run(["loss"], feeds)[0]) / (1024.0 if prec == "fp16" else 1.0)
    assert out["fp16"] == pytest.approx(out["fp32"], rel=1e-2)
    assert out["fp16"] != out["fp32"]


def test_loss_scaler_rules_are_onnxruntimes():
    s = LossScaler()
    assert (s.scale, s.growth_interval) == (2.0 ** 16, 2000)      # onnxruntime's defaults
    assert s.update(False) and s.scale == 2.0 ** 15                # overflow: halve (the step is skipped)
    for _ in range(1999):
        assert s.update(True)
    assert s.scale == 2.0 ** 15                                     # not yet
    s.update(True)
    assert s.scale == 2.0 ** 16 and s.good_steps == 0              # 2000 finite steps in a row: double
    for _ in range(1500):
        s.update(True)
    s.update(False)
    assert s.good_steps == 0 and s.scale == 2.0 ** 15              # an overflow restarts the count
    small = LossScaler(init_scale=2.0, min_scale=1.0)
    assert small.update(False) and small.scale == 1.0
    assert not small.update(False)                                  # at the floor: a real divergence
    big = LossScaler(init_scale=2.0 ** 24, growth_interval=1)
    big.update(True)
    assert big.scale == 2.0 ** 24                                   # capped


def test_loss_scaler_state_resumes_exactly():
    a = LossScaler(growth_interval=7)
    for finite in [True] * 5 + [False] + [True] * 9:
        a.update(finite)
    b = LossScaler(growth_interval=7)
    b.load_state_dict(__import__("json").loads(__import__("json").dumps(a.state_dict())))
    for finite in [True] * 20 + [False, True]:
        assert a.update(finite) == b.update(finite)
        assert (a.scale, a.good_steps) == (b.scale, b.good_steps)



def test_loss_scaler_keeps_the_graph_input_at_its_scale():
    """The scaler is the one place the loss scale lives: the train graph's ``loss_scale`` input (the engine's
    buffer bound to it) holds the scaler's scale from the start, after every change and after a restore."""
    bound = np.zeros((), np.float32)
    s = LossScaler(growth_interval=2, graph_input=bound)
    assert float(bound) == 2.0 ** 16
    s.update(False)
    assert float(bound) == s.scale == 2.0 ** 15
    s.update(True)
    s.update(True)
    assert float(bound) == s.scale == 2.0 ** 16
    s.load_state_dict({"scale": 8.0, "good_steps": 1})
    assert float(bound) == 8.0

@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_low_precision_on_cpu_is_a_config_error(tmp_path, byte_dataset, precision):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.precision": precision})
    for cmd in (["config", "validate", "--config", cfg], ["train", "--config", cfg]):
        proc = run([TRAINRUN, *cmd], check=2)
        assert f"train.precision: {precision} needs device: cuda" in proc.stderr + proc.stdout
    run([TRAINRUN, "config", "validate", "--config", cfg, "--set", "train.precision=fp32"], check=0)
