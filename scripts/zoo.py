"""The model zoo: models nobody here wrote, exported by torch, trained one SGD step through the real CLI,
their gradients against torch autograd's.

    .venv/bin/python scripts/zoo.py [--exporter dynamo|legacy|both] [--builder trainrun|onnxruntime|both]
                                    [--only NAME[,NAME]] [--markdown]

Each model (random weights, a tiny config, every dropout p=0, train() mode) is exported by torch's dynamo
exporter (``dynamo=True, optimize=False``) and by the legacy one (``dynamo=False``,
``TrainingMode.TRAINING``, ``do_constant_folding=False``), trained one step of SGD (lr 1, no weight decay,
no clipping, no momentum) by ``trainrun train`` with ``graphs.builder: trainrun`` (and ``onnxruntime``,
where onnxruntime-training is installed, as the reference), and each parameter's gradient is read back from
the first checkpoint: ``g = before - after``.

The bound. torch computes the same gradients twice, on the same inputs: in float32 (``g32``) and in float64
(``g64``, the reference). ``g32`` goes through the same float32 step and read-back as trainrun's
(``g32 := before - float32(before - g32)``), so its distance to ``g64`` holds both float32's rounding in the
model and the rounding of the read-back. Per parameter tensor, in max-norm relative to the tensor's largest
reference gradient ``s = max |g64|``:

    err   = max |g_trainrun - g64| / s          noise = max |g32 - g64| / s
    equal when err <= max(8 * noise, 1e-6)      (a tensor whose g64 is all zero: g_trainrun all zero)

A parameter torch gives no gradient (unused by the output) may be absent from the checkpoint. The status
of a (model, exporter, builder): ``exact`` (every tensor within its bound), ``differs`` (the worst tensor,
its err and its bound), ``refused`` (the CLI's error, first line), ``export failed`` (torch's error, first
line), ``failed`` (the CLI exited otherwise).

tests/test_zoo.py runs a subset through :func:`check`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml
from torch import nn

BIN = Path(sys.executable).parent
N = 4                       # the micro-batch
SEQ, VOCAB, CLASSES = 8, 64, 3
FACTOR, FLOOR = 8.0, 1e-6   # the bound: err <= max(FACTOR * noise, FLOOR)
EXPORTERS = ("dynamo", "legacy")


@dataclasses.dataclass
class Model:
    """A zoo entry: the module (float32, train mode), its inputs in call order and its loss."""
    module: nn.Module
    inputs: dict[str, np.ndarray]
    loss: str = "cross_entropy"         # or mse: the output against float labels of its shape
    labels: np.ndarray | None = None    # default: CLASSES classes per sample, or one per token for [N, S, V]


ZOO: dict[str, Callable[[], Model]] = {}


def entry(name: str):
    def register(make):
        ZOO[name] = make
        return make
    return register


def _tokens(rng, low=3, mask=False):
    """Token ids (and an attention mask of ones: without one transformers' decoders look for packed
    sequences with torch.diff, which the legacy exporter cannot export)."""
    ids = {"input_ids": rng.integers(low, VOCAB, (N, SEQ)).astype(np.int64)}
    return {**ids, "attention_mask": np.ones((N, SEQ), np.int64)} if mask else ids


# ---- transformers tiny configs --------------------------------------------------------------------------

class Logits(nn.Module):
    """A transformers model called with keyword inputs, returning its ``logits`` only."""

    def __init__(self, model, names):
        super().__init__()
        self.model, self.names = model, names

    extra: dict = {}

    def forward(self, *args):
        return self.model(**dict(zip(self.names, args)), **self.extra).logits


class CausalLogits(Logits):
    """A model with a key-value cache: without it (the cache is no output)."""
    extra = {"use_cache": False}


def _hf(config_cls, model_cls, inputs: dict, wrapper=Logits, **fields) -> Model:
    import transformers
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    config = getattr(transformers, config_cls)(**fields)
    for key, value in config.to_dict().items():     # every dropout probability 0 (GPT-2's *_pdrop too)
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    for sub in model.modules():
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0
    return Model(wrapper(model, list(inputs)), inputs)


DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@entry("gpt2")
def _gpt2():
    return _hf("GPT2Config", "GPT2LMHeadModel", _tokens(np.random.default_rng(0), mask=True), CausalLogits,
               vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4)


@entry("llama")
def _llama():
    return _hf("LlamaConfig", "LlamaForCausalLM", _tokens(np.random.default_rng(1), mask=True), CausalLogits,
               **DECODER)


@entry("qwen2")
def _qwen2():
    return _hf("Qwen2Config", "Qwen2ForCausalLM", _tokens(np.random.default_rng(2), mask=True), CausalLogits,
               **DECODER)


@entry("mistral")
def _mistral():
    return _hf("MistralConfig", "MistralForCausalLM", _tokens(np.random.default_rng(3), mask=True), CausalLogits,
               sliding_window=4, **DECODER)


@entry("gpt_neox")
def _gpt_neox():
    return _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", _tokens(np.random.default_rng(4), mask=True), CausalLogits,
               vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5)


def _seq2seq(rng):
    return {"input_ids": rng.integers(3, VOCAB, (N, SEQ)).astype(np.int64),
            "decoder_input_ids": rng.integers(3, VOCAB, (N, SEQ)).astype(np.int64)}


@entry("t5")
def _t5():
    return _hf("T5Config", "T5ForConditionalGeneration", _seq2seq(np.random.default_rng(5)), CausalLogits,
               vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               relative_attention_num_buckets=8, relative_attention_max_distance=16)


@entry("bart")
def _bart():
    return _hf("BartConfig", "BartForConditionalGeneration", _seq2seq(np.random.default_rng(6)), CausalLogits,
               vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)


ENCODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=64)


@entry("bert")
def _bert():
    return _hf("BertConfig", "BertForMaskedLM", _tokens(np.random.default_rng(7)), **ENCODER)


@entry("roberta_cls")
def _roberta():
    return _hf("RobertaConfig", "RobertaForSequenceClassification", _tokens(np.random.default_rng(8)),
               num_labels=CLASSES, **{**ENCODER, "max_position_embeddings": SEQ + 4})


@entry("distilbert_cls")
def _distilbert():
    return _hf("DistilBertConfig", "DistilBertForSequenceClassification", _tokens(np.random.default_rng(9)),
               vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64,
               num_labels=CLASSES)


@entry("vit")
def _vit():
    x = np.random.default_rng(10).normal(0, 1, (N, 3, 16, 16)).astype(np.float32)
    return _hf("ViTConfig", "ViTForImageClassification", {"pixel_values": x}, image_size=16, patch_size=4,
               num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               num_labels=CLASSES)


@entry("whisper_encoder")
def _whisper():
    x = np.random.default_rng(11).normal(0, 1, (N, 8, 16)).astype(np.float32)      # 8 mels x 2 * 8 frames
    return _hf("WhisperConfig", "WhisperForAudioClassification", {"input_features": x}, vocab_size=VOCAB,
               num_mel_bins=8, d_model=32, encoder_layers=2, encoder_attention_heads=4, decoder_layers=1,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
               max_target_positions=16, classifier_proj_size=16, num_labels=CLASSES)


# ---- plain torch modules --------------------------------------------------------------------------------

def _seeded(module_cls, x: dict, **kw) -> Model:
    torch.manual_seed(0)
    m = module_cls()
    with torch.no_grad():       # BatchNorm away from its identity start: affine and running statistics
        for sub in m.modules():
            if isinstance(sub, (nn.BatchNorm1d, nn.BatchNorm2d)):
                sub.weight.uniform_(0.5, 1.5)
                sub.bias.uniform_(-0.2, 0.2)
                sub.running_mean.uniform_(-0.5, 0.5)
                sub.running_var.uniform_(0.5, 2.0)
    return Model(m.train(), x, **kw)


def _images(seed, c=3, hw=16):
    return {"x": np.random.default_rng(seed).normal(0, 1, (N, c, hw, hw)).astype(np.float32)}


def conv_bn(cin, cout, k=3, stride=1, groups=1, act=nn.ReLU):
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), act() if act else nn.Identity())


class Basic(nn.Module):
    """ResNet's basic block: two 3x3 conv-BN, the shortcut a strided 1x1 conv-BN where the shape changes."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.a, self.b = conv_bn(cin, cout, 3, stride), conv_bn(cout, cout, 3, 1, act=None)
        self.short = conv_bn(cin, cout, 1, stride, act=None) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x):
        return torch.relu(self.b(self.a(x)) + self.short(x))


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn(3, 8)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.layers = nn.Sequential(Basic(8, 8, 1), Basic(8, 16, 2))
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, x):
        h = self.layers(self.pool(self.stem(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))


@entry("resnet_bn")
def _resnet():
    return _seeded(ResNet, _images(20))


class SqueezeExcite(nn.Module):
    def __init__(self, c, squeeze, act, gate):
        super().__init__()
        self.down, self.up, self.act, self.gate = nn.Conv2d(c, squeeze, 1), nn.Conv2d(squeeze, c, 1), act(), gate()

    def forward(self, x):
        return x * self.gate(self.up(self.act(self.down(x.mean((2, 3), keepdim=True)))))


class InvertedResidual(nn.Module):
    """MobileNetV3's / EfficientNet's block: 1x1 expand, depthwise 3x3, squeeze-excitation, 1x1 project."""

    def __init__(self, c, expand, act, se_act, gate):
        super().__init__()
        e = c * expand
        self.block = nn.Sequential(conv_bn(c, e, 1, act=act), conv_bn(e, e, 3, groups=e, act=act),
                                   SqueezeExcite(e, max(4, e // 4), se_act, gate), conv_bn(e, c, 1, act=None))

    def forward(self, x):
        return x + self.block(x)


class Mobile(nn.Module):
    def __init__(self, act, se_act, gate):
        super().__init__()
        self.stem = conv_bn(3, 8, 3, 2, act=act)
        self.block = InvertedResidual(8, 3, act, se_act, gate)
        self.fc = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.fc(self.block(self.stem(x)).mean((2, 3)))


@entry("mobilenetv3_block")
def _mobilenet():
    return _seeded(lambda: Mobile(nn.Hardswish, nn.ReLU, nn.Hardsigmoid), _images(21))


@entry("efficientnet_block")
def _efficientnet():
    return _seeded(lambda: Mobile(nn.SiLU, nn.SiLU, nn.Sigmoid), _images(22))


class TextCNN(nn.Module):
    """Kim's text CNN: embeddings, Conv1d of widths 3 and 5, ReLU, MaxPool1d, max over time."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.convs = nn.ModuleList([nn.Conv1d(16, 8, 3, padding=1), nn.Conv1d(16, 8, 5, padding=2, stride=1)])
        self.pool = nn.MaxPool1d(2)
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, ids):
        h = self.emb(ids).transpose(1, 2)
        return self.fc(torch.cat([self.pool(torch.relu(c(h))).amax(2) for c in self.convs], 1))


@entry("conv1d_text")
def _textcnn():
    return _seeded(TextCNN, _tokens(np.random.default_rng(23), low=0))


class Recurrent(nn.Module):
    def __init__(self, kind, bidirectional):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.rnn = getattr(nn, kind)(16, 12, num_layers=1, batch_first=True, bidirectional=bidirectional)
        self.fc = nn.Linear(12 * (2 if bidirectional else 1), CLASSES)

    def forward(self, ids):
        out, _ = self.rnn(self.emb(ids))
        return self.fc(out.mean(1))


for _kind in ("LSTM", "GRU"):
    for _bi in (False, True):
        entry(f"{_kind.lower()}{'_bi' if _bi else ''}")(
            lambda kind=_kind, bi=_bi: _seeded(lambda: Recurrent(kind, bi), _tokens(np.random.default_rng(24))))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.mha = nn.MultiheadAttention(16, 4, dropout=0.0, batch_first=True)
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, ids):
        h = self.emb(ids)
        return self.fc(self.mha(h, h, h, need_weights=False)[0].mean(1))


@entry("multihead_attention")
def _mha():
    return _seeded(Attention, _tokens(np.random.default_rng(25)))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, ids):
        return self.fc(self.layer(self.emb(ids)).mean(1))


@entry("transformer_encoder_layer")
def _encoder_layer():
    return _seeded(Encoder, _tokens(np.random.default_rng(26)))


@entry("mlp_activations")
def _mlp():
    def make():
        return nn.Sequential(nn.Linear(10, 16), nn.ELU(), nn.Linear(16, 16), nn.SELU(), nn.Linear(16, 16),
                             nn.Softplus(), nn.Linear(16, 16), nn.Mish(), nn.Linear(16, CLASSES))
    return _seeded(make, {"x": np.random.default_rng(27).normal(0, 1, (N, 10)).astype(np.float32)})


class CumEinTile(nn.Module):
    """CumSum over the sequence, an Einsum against a weight, a Tile, regressed (mse) against targets."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 5) * 0.3)
        self.proj = nn.Linear(6, 6)

    def forward(self, x):
        h = torch.cumsum(self.proj(x), dim=1)
        h = torch.einsum("bsi,ij->bsj", h, self.w)
        return torch.tanh(h.tile(1, 2, 1))


@entry("cumsum_einsum_tile")
def _cum():
    rng = np.random.default_rng(28)
    return _seeded(CumEinTile, {"x": rng.normal(0, 1, (N, 5, 6)).astype(np.float32)}, loss="mse",
                   labels=rng.normal(0, 1, (N, 10, 5)).astype(np.float32))


# ---- export, train, compare -----------------------------------------------------------------------------

def _first_line(text: str) -> str:
    """The error's first line (and its first listed problem), shortened."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    at = next((k for k, ln in enumerate(lines) if ln.lower().startswith(("error", "trainrun: error"))), None)
    line = lines[-1] if at is None else lines[at]
    if at is not None and "problem(s)" in line and at + 1 < len(lines):
        line = lines[at + 1]
    line = line.removeprefix("trainrun: error: ")
    return line if len(line) <= 240 else line[:237] + "..."


def export(model: Model, path: Path, exporter: str) -> None:
    """torch.onnx.export of a copy of the module (tracing runs it: BatchNorm's running statistics move)."""
    module = copy.deepcopy(model.module).train()
    args = tuple(torch.from_numpy(v) for v in model.inputs.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.export(module, args, str(path), dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                              do_constant_folding=False, opset_version=17, input_names=list(model.inputs),
                              output_names=["logits"])
        else:
            torch.onnx.export(module, args, str(path), dynamo=True, optimize=False, input_names=list(model.inputs),
                              output_names=["logits"], verbose=False)


def labels_of(model: Model, logits_shape) -> np.ndarray:
    if model.labels is not None:
        return model.labels
    rng = np.random.default_rng(99)
    classes = logits_shape[-1]
    return rng.integers(0, classes, tuple(logits_shape[:-1])).astype(np.int64)


def torch_loss(model: Model, module: nn.Module, dtype, labels: np.ndarray):
    args = [torch.from_numpy(v).to(dtype) if v.dtype.kind == "f" else torch.from_numpy(v)
            for v in model.inputs.values()]
    out = module(*args)
    if model.loss == "mse":
        return ((out - torch.from_numpy(labels).to(dtype)) ** 2).mean()
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), torch.from_numpy(labels).reshape(-1))


def torch_gradients(model: Model, labels: np.ndarray, dtype) -> dict[str, np.ndarray]:
    """{parameter: float64 gradient} of the loss of the module run in ``dtype`` (None: torch gives none)."""
    module = copy.deepcopy(model.module).to(dtype).train()
    torch_loss(model, module, dtype, labels).backward()
    return {k: None if p.grad is None else p.grad.double().numpy() for k, p in module.named_parameters()}


def read_back(before: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """What a float32 SGD step (lr 1) and ``before - after`` make of ``grad``."""
    after = (before - grad.astype(np.float32)).astype(np.float32)
    return before.astype(np.float64) - after.astype(np.float64)


def write_data(model: Model, labels: np.ndarray, folder: Path) -> Path:
    """The batch twice (the step reads the first N samples), as a trainrun-data tensors dataset."""
    feats = {k: np.concatenate([v, v]) for k, v in model.inputs.items()}
    feats["labels"] = np.concatenate([labels, labels])
    np.savez(folder / "data.npz", **feats)
    out = folder / "data"
    subprocess.run([str(BIN / "trainrun-data"), "tensors", "--input", str(folder / "data.npz"), "--output",
                    str(out)], check=True, capture_output=True, text=True, timeout=300)
    return out


def train_one_step(onnx_path: Path, data: Path, folder: Path, builder: str, loss: str, seq_len: int | None,
                   frozen=()):
    run_dir = folder / f"run-{builder}"
    cfg = {"run": {"name": "zoo", "output_dir": str(run_dir)},
           "model": {"builtin": None, "onnx": str(onnx_path),
                     "loss": {"type": loss, "logits": "logits", "labels": "labels"}, "frozen": list(frozen)},
           "data": {"train": str(data), "shuffle": False, "prefetch": 0,
                    **({"seq_len": seq_len} if seq_len else {})},
           "train": {"micro_batch_size": N, "max_steps": 1, "eval_every": 0, "log_every": 1},
           "optimizer": {"name": "sgd", "lr": 1.0, "max_grad_norm": 0.0, "weight_decay": 0.0, "momentum": 0.0},
           "lr_schedule": {"name": "constant", "warmup_steps": 0},
           "graphs": {"builder": builder},
           "checkpoint": {"every": 1}, "tensorboard": {"enabled": False}, "engine": {"threads": 1}}
    path = folder / f"c-{builder}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([str(BIN / "trainrun"), "train", "--config", str(path)], capture_output=True,
                          text=True, timeout=900)
    return proc, run_dir / "checkpoints" / "1" / "model.safetensors"


def initializers(onnx_path: Path) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(onnx_path)).graph.initializer}


def name_map(trained: dict, inits: dict, params: dict[str, np.ndarray]) -> dict[str, tuple[str, bool]]:
    """{torch parameter: (checkpoint tensor, transposed)}: by name, else by the exported initial value."""
    out = {k: (k, False) for k in params if k in trained}
    for name in trained:
        if name in params or name not in inits:
            continue
        value = inits[name]
        for k, p in params.items():
            if k in out:
                continue
            if p.shape == value.shape and np.array_equal(p, value):
                out[k] = (name, False)
                break
            if p.ndim == 2 and p.T.shape == value.shape and np.array_equal(p.T, value):
                out[k] = (name, True)
                break
    return out


@dataclasses.dataclass
class Outcome:
    model: str
    exporter: str
    builder: str
    status: str                 # exact, differs, refused, export failed, failed
    detail: str = ""
    err: float = 0.0            # the worst tensor's err / its bound (<= 1: within)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "exact"


def compare(trained: dict, inits: dict, before: dict, g64: dict, g32: dict) -> tuple[str, str, float]:
    """(status, detail, worst err/bound) of the checkpoint's read-back gradients against torch's."""
    where = name_map(trained, inits, before)
    worst, detail = 0.0, ""
    for k, ref in g64.items():
        if k not in where:
            if ref is None or not np.any(ref):
                continue
            return "differs", f"{k}: not in the checkpoint", float("inf")
        name, transposed = where[k]
        after = trained[name].T if transposed else trained[name]
        got = before[k].astype(np.float64) - after.astype(np.float64)
        ref = np.zeros_like(got) if ref is None else ref
        scale = np.abs(ref).max()
        if scale == 0:
            ratio, line = (0.0 if not np.any(got) else float("inf")), f"{k}: torch's gradient is 0"
        else:
            err = np.abs(got - ref).max() / scale
            noise = np.abs(read_back(before[k], g32[k] if g32[k] is not None else np.zeros_like(ref)) - ref).max()
            bound = max(FACTOR * noise / scale, FLOOR)
            ratio, line = err / bound, f"{k}: err {err:.1e}, bound {bound:.1e}"
        if ratio > worst or not detail:
            worst, detail = max(worst, ratio), line
    return ("exact" if worst <= 1 else "differs"), detail, worst


def check(name: str, exporter: str, builders=("trainrun",), folder: Path | None = None) -> list[Outcome]:
    """Export zoo model ``name`` with ``exporter``, train it one step with each builder, compare."""
    from safetensors.numpy import load_file
    model = ZOO[name]()
    with tempfile.TemporaryDirectory(prefix=f"zoo-{name}-") as tmp:
        folder = Path(folder or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        with torch.no_grad():
            shape = copy.deepcopy(model.module)(*[torch.from_numpy(v) for v in model.inputs.values()]).shape
        labels = labels_of(model, shape)
        before = {k: p.detach().numpy().copy() for k, p in model.module.named_parameters()}
        path = folder / f"{name}-{exporter}.onnx"
        t0 = time.perf_counter()
        try:
            export(model, path, exporter)
        except Exception as e:      # noqa: BLE001 - torch's failure is the outcome
            while e.__cause__ is not None:      # the dynamo exporter's summary wraps what failed
                e = e.__cause__
            why = f"{type(e).__name__}: " + next((ln for ln in str(e).splitlines() if ln.strip()), "")
            return [Outcome(name, exporter, b, "export failed", _first_line(why),
                            seconds=time.perf_counter() - t0) for b in builders]
        g64 = torch_gradients(model, labels, torch.float64)
        g32 = torch_gradients(model, labels, torch.float32)
        again = torch_gradients(model, labels, torch.float64)
        if any((a is None) != (b is None) or (a is not None and not np.array_equal(a, b))
               for a, b in zip(g64.values(), again.values())):
            return [Outcome(name, exporter, b, "torch varies", "two float64 gradients differ: a dropout left?",
                            float("inf")) for b in builders]
        data = write_data(model, labels, folder)
        inits = initializers(path)
        # what torch does not train (requires_grad False: Whisper's sinusoidal positions) is model.frozen, as
        # docs/models.md says: both exporters write such a tensor as a parameter
        frozen = [k for k, p in model.module.named_parameters() if not p.requires_grad]
        outcomes = []
        for builder in builders:
            t0 = time.perf_counter()
            seq_len = model.inputs["input_ids"].shape[1] if "input_ids" in model.inputs else None
            proc, ckpt = train_one_step(path, data, folder, builder, model.loss, seq_len, frozen)
            took = time.perf_counter() - t0
            if proc.returncode != 0 or not ckpt.exists():
                status = "refused" if proc.returncode == 2 else f"failed (exit {proc.returncode})"
                why = _first_line(proc.stderr or proc.stdout).replace(f"{folder}{os.sep}", "")
                outcomes.append(Outcome(name, exporter, builder, status, why, float("inf"), took))
                continue
            status, detail, worst = compare(load_file(str(ckpt)), inits, before, g64, g32)
            outcomes.append(Outcome(name, exporter, builder, status, detail, worst, took))
        return outcomes


def ort_training_installed() -> bool:
    from trainrun.graphs.gradients import ort_builder_missing
    return ort_builder_missing() is None


def _cell(o: Outcome) -> str:
    """One builder's outcome, short: exact / differs with the worst tensor, or the error without its file."""
    if o.status in ("exact", "differs"):
        return f"{o.status}: {o.detail}"
    why = re.sub(r"^\S+\.onnx: .*?cannot differentiate this graph: ", "", o.detail)
    why = re.sub(r"^\S+/(train|loss)\.onnx: ", "", why)
    return f"{o.status}: {why if len(why) <= 110 else why[:107] + '...'}"


def markdown(outcomes: list[Outcome]) -> str:
    """The table: a row per model and exporter, a column per builder."""
    builders = list(dict.fromkeys(o.builder for o in outcomes))
    head = {"trainrun": "trainrun's builder", "onnxruntime": "onnxruntime-training's builder (reference)"}
    rows = ["| model | exporter | " + " | ".join(head[b] for b in builders) + " |",
            "|---|---|" + "---|" * len(builders)]
    cells: dict[tuple, dict] = {}
    for o in outcomes:
        cells.setdefault((o.model, o.exporter), {})[o.builder] = _cell(o).replace("|", "\\|")
    for (model, exporter), by in cells.items():
        rows.append(f"| {model} | {exporter} | " + " | ".join(by.get(b, "") for b in builders) + " |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--exporter", choices=["dynamo", "legacy", "both"], default="both")
    p.add_argument("--builder", choices=["trainrun", "onnxruntime", "both"], default="both",
                   help="onnxruntime (the reference) only where onnxruntime-training is installed")
    p.add_argument("--only", default="", help="comma-separated zoo names (default: all): " + ", ".join(ZOO))
    p.add_argument("--markdown", action="store_true", help="print the table as markdown at the end")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(ZOO)
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        p.error(f"--only: no zoo model {unknown}; the zoo: {', '.join(ZOO)}")
    exporters = EXPORTERS if args.exporter == "both" else (args.exporter,)
    if "dynamo" in exporters and importlib.util.find_spec("onnxscript") is None:
        p.error("--exporter dynamo needs onnxscript (the test extra)")
    builders = ["trainrun", "onnxruntime"] if args.builder == "both" else [args.builder]
    if "onnxruntime" in builders and not ort_training_installed():
        builders.remove("onnxruntime")
        print("onnxruntime-training is not installed: the trainrun builder only", file=sys.stderr)
    if not builders:
        p.error("--builder onnxruntime needs onnxruntime-training")
    outcomes = []
    for name in names:
        for exporter in exporters:
            for o in check(name, exporter, tuple(builders)):
                outcomes.append(o)
                print(f"{o.model:28s} {o.exporter:7s} {o.builder:12s} {o.status:14s} {o.detail}  "
                      f"({o.seconds:.0f} s)", flush=True)
    if args.markdown:
        print()
        print(markdown(outcomes))
    return 0 if all(o.ok for o in outcomes if o.builder == "trainrun") else 1


if __name__ == "__main__":
    sys.exit(main())
