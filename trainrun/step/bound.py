"""The onnxruntime sessions the engine runs, each with its IOBinding: inputs and outputs bound once, by
pointer, to views of numpy (host) or cupy (GPU) arrays (:class:`Bound`); the train graph cut in segments at
the gradient buckets run as one such session (:class:`Segmented`). Both open their sessions with
:func:`trainrun.step.sessions.session_options` from :class:`EngineOptions`. What is bound to what is the
engine's (:mod:`trainrun.step.engine`); an optimizer that runs a graph binds its own session
(:mod:`trainrun.step.optim`).

On CUDA (``device: cuda``) the small host scalars are bound again before each run (onnxruntime copies a
host input to the GPU when it is bound, not when the graph runs), and cupy's stream is synchronized before
each run (onnxruntime computes on its own stream): :meth:`Bound.run` and :mod:`trainrun.step.cuda`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from . import cuda
from .feeding import ORT_TYPES
from ..graphs import segments
from ..errors import TrainrunError, UsageError
from .flat import is_cupy
from .sessions import disabled_optimizers, session_options

@dataclass
class EngineOptions:
    device: str = "cpu"           # "cpu" or "cuda"
    device_id: int = 0            # the GPU of this rank (its local rank)
    threads: int = 1
    graph_optimization: str = "all"
    log_severity: int = 3          # onnxruntime: 0 verbose .. 3 error
    deterministic: bool = False
    profile_prefix: str | None = None
    optimized_dir: str | None = None   # debug.save_graphs: write each graph as onnxruntime optimized it
    log_id: str | None = None          # names this rank in onnxruntime's own log lines
    seed: int = 0                      # run.seed: the dropout masks' stream (trainrun/step/dropout.py)
    # the train graph's gradients written straight into the gradient buffer (graphs.gradients.direct_gradients)
    # when its graph accumulates in place (onnxruntime-training's builder): for runs that never accumulate.
    # A graph of trainrun's builder is always run so; accumulation then adds in the engine (forward_backward)
    direct_gradients: bool = False
    # the train graph cut into segments, one per bucket of about this many bytes of gradients (0: one run),
    # so that a bucket's reduction can start before the backward pass ends (distributed.overlap_grad_reduce,
    # trainrun.sync.update); CPU only
    bucket_bytes: int = 0



class Bound:
    """One session with its IOBinding; inputs/outputs bound by pointer to numpy (host)
    or cupy (GPU) arrays."""

    def __init__(self, path: str, opts: EngineOptions, name: str, model: bytes | None = None,
                 recompute: bool = False, chained: bool = False):
        """``model``: the graph as serialized bytes, when it differs from the file at ``path``;
        ``recompute``: the graph has recomputed blocks (train.recompute); ``chained``: one of the sessions
        that run one after the other (:func:`trainrun.step.sessions.session_options`)."""
        import onnxruntime as ort
        providers = ["CPUExecutionProvider"]
        self.cuda = opts.device == "cuda"
        if self.cuda:
            cuda.setup()        # the pip-installed CUDA 11 libraries, before the provider loads
            cuda_opts = {"device_id": opts.device_id}
            if opts.deterministic:      # fp32 MatMuls in fp32, not TF32 (the provider's default on Ampere+)
                cuda_opts["use_tf32"] = 0
            providers = [("CUDAExecutionProvider", cuda_opts), "CPUExecutionProvider"]
        self.device_id = opts.device_id
        # the eval and optimizer graphs run briefly between train steps: their pools do not spin after a run
        so = session_options(max(1, opts.threads), name, graph_optimization=opts.graph_optimization,
                             log_severity=opts.log_severity, deterministic=opts.deterministic,
                             spinning=name not in ("eval", "optimizer"), profile_prefix=opts.profile_prefix,
                             optimized_dir=opts.optimized_dir, log_id=opts.log_id, recompute=recompute,
                             chained=chained)
        try:
            self.session = ort.InferenceSession(path if model is None else model, sess_options=so,
                                                providers=providers,
                                                disabled_optimizers=disabled_optimizers(recompute))
        except Exception as exc:  # noqa: BLE001
            raise TrainrunError(f"{path}: onnxruntime cannot load the {name} graph: "
                                f"{str(exc).strip().splitlines()[0]}") from None
        if self.cuda:
            cuda.check_session(self.session, path, name)
        self.binding = self.session.io_binding()
        self.name, self.path = name, path
        self.sessions = [self.session]       # what profiling ends (a segmented graph has several)
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.keep = []   # arrays whose memory is bound: keep them alive
        self.out_names: list[str] = []      # bound outputs in binding order (get_outputs()' order)
        # host arrays bound as inputs of a CUDA session: bound again before each run (see run())
        self.host_inputs: dict[str, np.ndarray] = {}

    def _where(self, arr):
        assert arr.flags.c_contiguous
        if is_cupy(arr):
            return "cuda", self.device_id, arr.data.ptr
        return "cpu", 0, arr.ctypes.data

    def check_shape(self, name: str, shape: tuple) -> None:
        """UsageError when the graph declares fixed dims for input ``name`` that ``shape`` does not have."""
        declared = next((i.shape for i in self.session.get_inputs() if i.name == name), None)
        if declared is None or (len(declared) == len(shape) and all(
                not isinstance(d, int) or d == s for d, s in zip(declared, shape))):
            return
        raise UsageError(f"{self.path}: input '{name}' has shape {declared}, the batch has {list(shape)} "
                         f"(graphs prepared for another micro-batch or sequence length: prepare again)")

    def bind_in(self, name: str, arr, keep: bool = True) -> None:
        """``keep`` False: the caller keeps ``arr`` alive as long as it is bound."""
        dev, dev_id, ptr = self._where(arr)
        self.binding.bind_input(name, dev, dev_id, arr.dtype, list(arr.shape), ptr)
        if keep:
            self.keep.append(arr)
        if self.cuda and dev == "cpu":
            self.host_inputs[name] = arr

    def declared(self, name: str, arr):
        """``arr`` viewed in output ``name``'s declared dims where they differ but hold as many elements: a
        gradient output left in its producer's dims (a Conv weight's [M, C K], ``graphs.fusion``) is bound
        to the parameter's view of the gradient buffer so."""
        dims = next((o.shape for o in self.session.get_outputs() if o.name == name), None)
        if dims is None or list(dims) == list(arr.shape) or not all(isinstance(d, int) for d in dims) \
                or int(np.prod(dims)) != arr.size:
            return arr
        return arr.reshape(dims)

    def bind_out(self, name: str, arr, keep: bool = True) -> None:
        """``keep`` False: the caller keeps ``arr``'s memory alive as long as it is bound. ``arr`` in the
        output's declared dims (:meth:`declared`)."""
        arr = self.declared(name, arr)
        dev, dev_id, ptr = self._where(arr)
        self.binding.bind_output(name, dev, dev_id, arr.dtype, list(arr.shape), ptr)
        if keep:
            self.keep.append(arr)
        if name not in self.out_names:
            self.out_names.append(name)

    def bind_allocated(self, name: str) -> None:
        """Output ``name`` allocated by onnxruntime on the session's device at each run (:meth:`value`)."""
        self.binding.bind_output(name, *(("cuda", self.device_id) if self.cuda else ("cpu", 0)))
        if name not in self.out_names:
            self.out_names.append(name)

    def value(self, name: str):
        """Bound output ``name`` of the last run, on the host."""
        return self.binding.get_outputs()[self.out_names.index(name)].numpy()

    def run(self, between=None) -> None:
        """One run (``between``: for :class:`Segmented`'s interface; one graph has no point between)."""
        if self.cuda:
            cuda.synchronize()       # cupy's writes to bound buffers (batches, weights) are done first
            # IOBinding::BindInput copies a bound tensor to the device its consumer runs on at BIND
            # time (utils::CopyOneInputAcrossDevices): a host scalar (lr, step, grad_scale) read on the
            # GPU would keep the value of its first bind forever. Binding again copies the current
            # value; a host input the graph reads on the CPU (the accumulators' reset flag) is not
            # copied, so this is a few small copies per run.
            for name, arr in self.host_inputs.items():
                self.binding.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        self.session.run_with_iobinding(self.binding)


class Segmented:
    """The train graph as consecutive segments (:mod:`trainrun.graphs.segments`), with :class:`Bound`'s
    interface: a name is bound in every segment that reads it, an output in the one that makes it. A tensor
    one segment hands to later ones (a forward activation a lower layer's backward reads, the gradient
    flowing down) is allocated by onnxruntime when it is made, handed to the later segments as it is (an
    OrtValue, no copy) and let go by each reader once it has run, so it lives from the segment that makes
    it to the last one that reads it, as in the whole graph, and its shape is what each run makes. The
    segments allocate from one arena (:func:`trainrun.step.sessions.shared_cpu_arena`): a segment reuses the
    memory the ones before it freed, so the cut graph's memory peaks where the whole graph's does.
    ``run(between)`` calls ``between(k)`` after segment k (every segment but the last): the gradients of
    ``targets[0..k]`` are final then."""

    def __init__(self, model: onnx.ModelProto, targets: list[list[str]], path: str, opts: EngineOptions,
                 recompute: bool = False):
        import onnxruntime as ort
        self.name, self.path, self.cuda, self.keep = "train", path, False, []
        made, self.parts = {}, []
        self.hand_on: list[list[str]] = []      # per segment: the tensors it makes that later segments read
        self.takes: list[list[str]] = []        # per segment: those it reads, let go of after it runs
        self.readers: dict[str, list] = {}      # a tensor a segment hands on -> the later segments that read it
        self._none: dict = {}       # name -> a one-element OrtValue of its type, bound once a reader is done
        outputs = {v.name for v in model.graph.output}
        for seg in segments.split(model, targets):
            if seg is None:             # a bucket whose gradients an earlier segment already made
                self.parts.append(None)
                self.hand_on.append([])
                self.takes.append([])
                continue
            handed = segments.boundary_inputs(seg)
            for name in handed:
                segments.typed_input(seg, name, made[name].type, made[name].shape)
            part = Bound(path, opts, f"train.segment{len(self.parts)}", seg.SerializeToString(),
                          recompute=recompute, chained=True)
            for name in handed:
                self.readers.setdefault(name, []).append(part)
            mine = [o.name for o in part.session.get_outputs()]
            made.update((o.name, o) for o in part.session.get_outputs())
            self.hand_on.append([n for n in mine if n not in outputs])
            for name in self.hand_on[-1]:
                part.bind_allocated(name)
            self.takes.append([n for n in handed if n not in outputs])
            for name in self.takes[-1]:
                self._none[name] = ort.OrtValue.ortvalue_from_numpy(np.zeros(1, ORT_TYPES[made[name].type]))
            self.parts.append(part)
        live = [p for p in self.parts if p is not None]
        self.sessions = [p.session for p in live]
        self.handed = set(self.readers) - outputs       # the graph's own outputs stay the engine's to bind
        self.input_names = set().union(*(p.input_names for p in live)) - set(self.readers)
        self.session = _Union(live, set(self.readers), self.handed)

    def _owners(self, name: str, inputs: bool) -> list:
        found = [p for p in self.parts if p is not None and name in (
            p.input_names if inputs else {o.name for o in p.session.get_outputs()})]
        if not found:
            raise TrainrunError(f"{self.path}: the train graph has no {'input' if inputs else 'output'} '{name}'")
        return found

    def check_shape(self, name: str, shape: tuple) -> None:
        for p in self._owners(name, True):
            p.check_shape(name, shape)

    def bind_in(self, name: str, arr, keep: bool = True) -> None:
        for p in self._owners(name, True):
            p.bind_in(name, arr, keep)

    def bind_out(self, name: str, arr, keep: bool = True) -> None:
        """Also the input of the later segments that read this output of the graph (zero copy)."""
        owner = self._owners(name, False)[0]
        arr = owner.declared(name, arr)
        owner.bind_out(name, arr, keep)
        for later in self.readers.get(name, []):
            later.bind_in(name, arr, keep)

    def bind_allocated(self, name: str) -> None:
        """An output onnxruntime allocates at each run; one a later segment reads (debug statistics of a
        layer's output) is handed to it after each run."""
        maker = self._owners(name, False)[0]
        maker.bind_allocated(name)
        if name in self.readers:
            self.hand_on[self.parts.index(maker)].append(name)

    def value(self, name: str):
        return self._owners(name, False)[0].value(name)

    def run(self, between=None) -> None:
        last = len(self.parts) - 1
        for k, part in enumerate(self.parts):
            if part is not None:
                part.run()
                if self.hand_on[k]:
                    values = part.binding.get_outputs()
                    for name in self.hand_on[k]:
                        value = values[part.out_names.index(name)]
                        for later in self.readers[name]:
                            later.binding.bind_ortvalue_input(name, value)
                        if name in self.handed:     # the maker lets go of it; the next run allocates anew
                            part.bind_allocated(name)
                for name in self.takes[k]:          # this reader is done with it
                    part.binding.bind_ortvalue_input(name, self._none[name])
            if between is not None and k < last:
                between(k)


class _Union:
    """The inputs and outputs of all segments as one session shows them (for the engine's checks)."""

    def __init__(self, parts: list, handed: set, internal: set):
        """``handed``: what segments hand to later ones (no input of the graph); ``internal``: those of
        them that are no output of the graph either."""
        self.parts, self.handed, self.internal = parts, handed, internal

    def get_inputs(self) -> list:
        seen = {}
        for p in self.parts:
            for i in p.session.get_inputs():
                if i.name not in self.handed:
                    seen.setdefault(i.name, i)
        return list(seen.values())

    def get_outputs(self) -> list:
        return [o for p in self.parts for o in p.session.get_outputs() if o.name not in self.internal]

