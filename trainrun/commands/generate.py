"""``trainrun generate``: text from a language model (a model family with an attention-cache graph,
:attr:`~trainrun.models.registry.Family.kv_cache`: GPT-2) with plain onnxruntime, one new token per pass.

The source is an exported model.onnx, a checkpoint or a run directory (its latest committed
checkpoint). From a checkpoint the attention-cache graph is built in memory: the prompt is one full pass, each new token a pass over one position that
reads the keys and values of the earlier ones (``past.*``) and returns them extended (``present.*``).
An .onnx file written with ``export --kv-cache`` is used the same way; any other .onnx with an
``input_ids`` input and a ``logits`` output is run over the whole window for every token.
An empty prompt starts from the end-of-document token (unconditional samples).
Sampling: greedy at temperature 0, else softmax(logits / T) restricted to the top-k, then to the
smallest set of top-p probability; numpy's PCG64 seeded by ``--seed``: same seed, same text.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..graphs.manifest import load_manifest
from .. import config as C
from ..run import rundir
from ..hf import tokenizer as T
from ..checkpoint import pin
from ..errors import UsageError
from .export import checkpoint_weights, full_weights, kv_cache_model
from ..step.flat import FlatLayout, is_cupy, to_host
from ..models import registry
from ..step.sessions import session_options


class Decoder:
    """Next-token logits from an onnxruntime session, with the attention cache when the graph has one."""

    def __init__(self, session, n_positions: int):
        self.session, self.n_positions = session, n_positions
        inputs = {i.name: i for i in session.get_inputs()}
        outputs = [o.name for o in session.get_outputs()]
        if "input_ids" not in inputs or "logits" not in outputs:
            raise UsageError("generate: the model needs an input_ids input and a logits output")
        self.past = sorted((n for n in inputs if n.startswith("past.")), key=_layer_order)
        self.present = [n.replace("past.", "present.", 1) for n in self.past]
        self.dims = {n: inputs[n].shape for n in self.past}
        self.cache: list[np.ndarray] = []
        self.ids: list[int] = []

    @property
    def kv(self) -> bool:
        return bool(self.past)

    def start(self, ids: list[int]) -> np.ndarray:
        """Logits of the next token after the prompt ``ids`` (resets the cache)."""
        self.ids = list(ids)
        feeds = {"input_ids": np.array([ids], np.int64)}
        if self.kv:
            for n in self.past:
                _, heads, _, dim = self.dims[n]
                feeds[n] = np.zeros((1, heads, 0, dim), np.float32)
            out = self.session.run(["logits", *self.present], feeds)
            self.cache = out[1:]
            return out[0][0, -1]
        return self.session.run(["logits"], feeds)[0][0, -1]

    def next(self, token: int) -> np.ndarray:
        """Append ``token``; logits of the one after it."""
        self.ids.append(token)
        if not self.kv:
            return self.session.run(["logits"], {"input_ids": np.array([self.ids], np.int64)})[0][0, -1]
        feeds = {"input_ids": np.array([[token]], np.int64), **dict(zip(self.past, self.cache))}
        out = self.session.run(["logits", *self.present], feeds)
        self.cache = out[1:]
        return out[0][0, -1]


def _layer_order(name: str):
    _, layer, kind = name.split(".")
    return int(layer), kind


def pick(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_k: int, top_p: float) -> int:
    """One token id from ``logits`` [V]: greedy at temperature 0, else top-k then top-p (nucleus) sampling."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p)) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    return int(order[rng.choice(len(order), p=p)])


def generate(decoder: Decoder, prompt: list[int], max_new_tokens: int, rng: np.random.Generator, *,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_id: int | None = None,
             on_token=None) -> list[int]:
    """New token ids after ``prompt`` (at most ``max_new_tokens``; stops after ``eos_id`` or when the
    context window of n_positions is full; a longer prompt keeps its last n_positions - 1 tokens)."""
    prompt = prompt[-(decoder.n_positions - 1):]
    limit = min(max_new_tokens, decoder.n_positions - len(prompt))
    new: list[int] = []
    logits = decoder.start(prompt)
    while True:
        token = pick(logits, rng, temperature, top_k, top_p)
        new.append(token)
        if on_token:
            on_token(new)
        if token == eos_id or len(new) >= limit:
            return new
        logits = decoder.next(token)


def load_source(source: str, threads: int = 0) -> tuple[Decoder, str]:
    """(decoder, the run directory: the .onnx file's directory) for a .onnx file, a checkpoint or a run directory."""
    import onnxruntime as ort
    if os.path.isfile(source):
        try:
            model = onnx.load(source, load_external_data=False)
            why = "" if model.graph.node else "no graph"
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and the like: not an ONNX file
            why = f"{type(exc).__name__}: {exc}"
        if why:
            raise UsageError(f"{source}: not an ONNX model ({why}); SOURCE is an exported model.onnx, "
                             f"a checkpoint directory or a run directory (its latest checkpoint)")
        wpe = [i for i in model.graph.initializer if i.name in registry.positions_tensors()]
        n_positions = wpe[0].dims[0] if wpe else 1 << 30
        del model
        sess = ort.InferenceSession(source, session_options(threads), providers=["CPUExecutionProvider"])
        run_dir = os.path.dirname(os.path.abspath(source))
        return Decoder(sess, n_positions), run_dir
    with pin(source) as ckpt:        # held open: the run may prune it as it trains
        run_dir = rundir.run_dir_of(ckpt.dir)
        manifest = load_manifest(os.path.join(run_dir, "graphs"))
        model = kv_cache_model(manifest, lambda: full_weights(os.path.join(run_dir, "graphs"), manifest,
                                                              checkpoint_weights(ckpt, manifest)), where=ckpt.dir)
    n_positions = C.positions(registry.of_manifest(manifest).shape_of(manifest))
    sess = ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                providers=["CPUExecutionProvider"])
    return Decoder(sess, n_positions), run_dir


def run_generate(source: str, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 seed: int, num_samples: int, tokenizer: str | None, out=sys.stdout) -> list[str]:
    """The command: print each sample as its tokens come; return the texts."""
    decoder, run_dir = load_source(source)
    text = T.for_run(run_dir, tokenizer)
    ids = text.encode(prompt)
    if not ids:       # unconditional samples: from the end-of-document token, as a new document starts
        if text.eos_id is None:
            raise UsageError(f"--prompt {prompt!r} encodes to no tokens, and the run's tokenizer has no "
                             f"end-of-document token to start from: give a prompt")
        ids = [text.eos_id]
    rng = np.random.default_rng(seed)
    texts = []
    for m in range(num_samples):
        if num_samples > 1:
            out.write(f"---- sample {m + 1} ----\n")
        out.write(prompt)
        out.flush()
        shown = [0]

        def show(new):
            piece = text.decode(new)
            if not piece.endswith("\ufffd"):          # a character still incomplete: wait for its bytes
                out.write(piece[shown[0]:])
                out.flush()
                shown[0] = len(piece)

        new = generate(decoder, ids, max_new_tokens, rng, temperature=temperature, top_k=top_k, top_p=top_p,
                       eos_id=text.eos_id, on_token=show)
        piece = text.decode(new)
        out.write(piece[shown[0]:] + "\n")
        out.flush()
        texts.append(prompt + piece)
    return texts


class TrainingSampler:
    """``train.sample_every``: samples from the weights being trained (rank 0). The attention-cache graph is
    built once with the parameters and the frozen weights as inputs, fed views of a host copy of the flat
    parameter buffer and of the engine's frozen buffer (``frozen``: its layout and buffer; a host one
    viewed in place, a GPU one copied once, as it never changes), so training's own buffers and random
    streams are never touched."""

    NEW_TOKENS, TOP_K = 64, 40

    def __init__(self, manifest: dict, data_dir: str, prompt: str, threads: int, frozen: tuple):
        import onnxruntime as ort
        self.text = T.for_data(data_dir)
        self.prompt = self.text.encode(prompt)
        if not self.prompt:
            raise UsageError(f"train.sample_prompt: {prompt!r} encodes to no tokens")
        self.layout = FlatLayout.from_manifest(manifest)
        frozen_layout, frozen_buf = frozen
        if is_cupy(frozen_buf):
            frozen_buf = frozen_buf.get()
        model = kv_cache_model(manifest, lambda: {}, where="train.sample_every")
        model.graph.input.extend(onnx_inputs(self.layout) + onnx_inputs(frozen_layout))
        n_positions = C.positions(registry.of_manifest(manifest).shape_of(manifest))
        self.session = ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                            providers=["CPUExecutionProvider"])
        self.host = np.empty(self.layout.total, np.float32)
        weights = {**frozen_layout.unflatten(frozen_buf), **self.layout.unflatten(self.host)}
        self.decoder = Decoder(_WithWeights(self.session, weights), n_positions)

    def sample(self, params, seed: int, step: int) -> str:
        to_host(params, self.host)
        new = generate(self.decoder, self.prompt, self.NEW_TOKENS, np.random.default_rng([seed, step]),
                       temperature=1.0, top_k=self.TOP_K, eos_id=self.text.eos_id)
        return self.text.decode(self.prompt + new)


def onnx_inputs(layout) -> list:
    return [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in zip(layout.names, layout.shapes)]


class _WithWeights:
    """A session whose parameter inputs are always fed from ``weights``."""

    def __init__(self, session, weights: dict):
        self.session, self.weights = session, weights

    def get_inputs(self):
        return [i for i in self.session.get_inputs() if i.name not in self.weights]

    def get_outputs(self):
        return self.session.get_outputs()

    def run(self, names, feeds):
        return self.session.run(names, {**feeds, **self.weights})
