"""Runs the prepared graphs on flat buffers with onnxruntime IOBinding.

Parameters, gradients and optimizer state each live in ONE contiguous float32
array; every graph input/output that is a parameter, a gradient buffer or a
state is bound once to a view of those arrays (zero copy). Data inputs,
``lazy_reset_grad``, ``lr``/``step``/``grad_scale`` and the loss are small
preallocated arrays bound once too, so a step allocates nothing in Python.

On CUDA (``device: cuda``) the big buffers and the batches are cupy arrays.
The sessions and their bindings are :mod:`trainrun.step.bound`'s; the engine says
what is bound to what.

The optimizer is not the engine's: :mod:`trainrun.sync.update` builds it over the
engine's buffers; when it runs a graph, the engine opens that session
(:meth:`Engine.attach_optimizer`) and hands it over to be bound.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from safetensors import safe_open

from . import cuda
from . import feeding
from .bound import Bound, EngineOptions, Segmented
from .feeding import check_inputs
from ..graphs import frozen as frozen_weights
from ..graphs.gradients import direct_gradients
from ..graphs.manifest import load_manifest
from ..graphs.names import ACC_OUT_SUFFIX, BUFFER_SUFFIX, LOSS, MASK_PREFIX, METRIC_PREFIX, RESET
from .dropout import DropoutMasks
from ..errors import TrainrunError, UsageError
from .flat import FlatLayout, from_host, norm_sq


class Engine:
    """The train, eval and optimizer sessions over shared flat buffers.

    ``buffers``: (params, grads) allocated by the caller (host arrays of the layout's size, e.g. views of
    shared memory that several ranks' sessions bind to, :mod:`trainrun.sync.update`); by default the engine's own.
    ``frozen``: the frozen weights' buffer (manifest ``frozen``, graph inputs as the parameters), the caller's
    (once per node) or the engine's; ``fill_frozen`` False: another rank fills it from frozen.safetensors.
    ``lazy_eval``: the eval session opened on first use (:attr:`eval_s`), not at start-up.

    ``batch_shapes``: dataset feature -> (shape, dtype) of one micro-batch; ``feeds``: graph input ->
    the feature that feeds it (:func:`trainrun.step.feeding.feeds`, by default equal names and the labels
    input from the feature ``labels``). The engine owns one buffer per fed graph input, checked at
    start-up against the graph's declared type and dims; :meth:`set_batch` copies a batch into them.

    Model state that is not a parameter (BatchNormalization's running mean/var, the manifest's
    ``states``) lives in one flat float32 array, :attr:`state`: the train graph reads it and writes
    its update into :attr:`state_next`, copied back after each micro-batch; the eval graph reads it.
    The optimizer never sees it.
    """

    def __init__(self, graphs_dir: str, opts: EngineOptions, batch_shapes: dict, eval_batch_shapes: dict,
                 feeds: dict | None = None, buffers: tuple | None = None, frozen=None, fill_frozen: bool = True,
                 lazy_eval: bool = False):
        self.dir = graphs_dir
        self.opts = opts
        self.manifest = load_manifest(graphs_dir)
        self.layout = FlatLayout.from_manifest(self.manifest)
        N = self.layout.total
        if opts.device == "cuda":       # big buffers and batches on the GPU; scalars stay on the host
            cuda.setup()
            import cupy
            cupy.cuda.Device(opts.device_id).use()
            self.xp = cupy
        else:
            self.xp = np
        xp = self.xp
        if buffers is None:
            self.params = xp.zeros(N, np.float32)
            self.grads = xp.zeros(N, np.float32)
        else:       # allocated by the caller (host, e.g. in shared memory: trainrun.sync.update); bound as they are
            self.params, self.grads = buffers
            for what, b in zip(("params", "grads"), buffers):
                if not (isinstance(b, np.ndarray) and b.dtype == np.float32 and b.shape == (N,)
                        and b.flags.c_contiguous and xp is np):
                    raise TrainrunError(f"engine: the {what} buffer must be a contiguous float32 host array "
                                        f"of {N} elements")
        self.loss = np.zeros((), np.float32)
        self.eval_loss = np.zeros((), np.float32)
        self.reset = np.ones(1, bool)
        # fp16 train graph: its loss (and so every gradient) is multiplied by this input (precision.py)
        self.loss_scale = np.ones((), np.float32) if self.manifest.get("loss_scale") else None
        self.feeds = feeding.feeds(self.manifest, {}, batch_shapes) if feeds is None else dict(feeds)
        self.batch = self._batch_buffers(batch_shapes)
        self.eval_batch = self._batch_buffers(eval_batch_shapes)
        self._eval_rest: dict[int, dict] = {}     # buffers of an evaluation's smaller last micro-batch, by size
        self.state_layout = FlatLayout.from_manifest({"params": self.manifest.get("states", [])})
        self.state = xp.zeros(self.state_layout.total, np.float32)
        self.state_next = xp.zeros(self.state_layout.total, np.float32)
        self.frozen_layout = frozen_weights.layout(self.manifest)
        if frozen is None:
            frozen = xp.zeros(self.frozen_layout.total, np.float32)
        elif not (isinstance(frozen, np.ndarray) and frozen.dtype == np.float32 and xp is np
                  and frozen.shape == (self.frozen_layout.total,) and frozen.flags.c_contiguous):
            raise TrainrunError(f"engine: the frozen buffer must be a contiguous float32 host array of "
                                f"{self.frozen_layout.total} elements")
        self.frozen = frozen
        if fill_frozen and self.frozen_layout.names:
            host = frozen if xp is np else np.empty(self.frozen_layout.total, np.float32)
            frozen_weights.read_into(self.dir, self.manifest, host)
            if host is not frozen:
                from_host(frozen, host)
        self.lazy_eval = lazy_eval
        self.label_check = self._label_check()
        self.masks = self._masks(self.manifest.get("dropout"), opts.seed)

        self.stats_outputs = list(self.manifest.get("stats_outputs", []))   # debug.tensors, see stats.py
        self._graph_optimizer = None      # an optimizer that runs a graph (attach_optimizer)
        self.scratch = None     # a later micro-batch's gradients, direct form (forward_backward)
        self.reopen(opts)

    def reopen(self, opts: EngineOptions) -> tuple:
        """(Re-)create the three sessions with ``opts`` (e.g. profiling on), bound to the same buffers.
        Returns the previous sessions and options for :meth:`restore`."""
        old = (getattr(self, "train_s", None), getattr(self, "_eval_s", None), getattr(self, "opt_s", None),
               self.opts)
        self.opts = opts
        train = os.path.join(self.dir, "train.onnx")
        self.grad_outputs = None     # parameter -> its gradient output (the direct form)
        recompute = self.manifest.get("build", {}).get("recompute", "none") == "blocks"
        self.buckets = self._buckets(opts.bucket_bytes if opts.device == "cpu" else 0)
        # trainrun's builder writes the gradients as outputs: no accumulators to drop
        direct = opts.direct_gradients or self.manifest.get("builder") == "trainrun"
        model = onnx.load(train) if direct or len(self.buckets) > 1 else None
        if direct:
            model, self.grad_outputs = direct_gradients(model)
        if len(self.buckets) > 1:
            names = self.layout.names
            made = [[self.grad_outputs[n] if self.grad_outputs else n + ACC_OUT_SUFFIX for n in names[i:j]]
                    for i, j in self.bucket_tensors[:-1]]
            self.train_s = Segmented(model, made, train, opts, recompute=recompute)
        else:
            self.train_s = Bound(train, opts, "train", None if model is None else model.SerializeToString(),
                                  recompute=recompute)
        self._eval_s = None
        self.opt_s = None
        self._bind_all()
        if not self.lazy_eval:
            self._open_eval()
        if self._graph_optimizer is not None:
            self._open_optimizer()
        return old

    def _buckets(self, nbytes: int) -> list[tuple[int, int]]:
        """The flat gradient buffer as buckets of whole tensors of about ``nbytes`` each (``lo, hi`` element
        ranges), from its end: the backward pass makes the last layers' gradients first. One bucket
        (the whole buffer) when ``nbytes`` is 0. Sets :attr:`bucket_tensors` (tensor index ranges) too."""
        bounds = [*self.layout.offsets, self.layout.total]
        n = len(self.layout.names)
        ends = [n]
        for i in range(n - 1, 0, -1):
            if nbytes and 4 * (bounds[ends[-1]] - bounds[i]) >= nbytes:
                ends.append(i)
        ends.append(0)
        self.bucket_tensors = [(a, b) for b, a in zip(ends, ends[1:]) if a < b]
        return [(bounds[a], bounds[b]) for a, b in self.bucket_tensors]

    def attach_optimizer(self, optimizer) -> None:
        """``optimizer`` (:func:`trainrun.step.optim.build`, built by :mod:`trainrun.sync.update` over these buffers)
        runs a graph: the engine opens its session with the engine's options (again on :meth:`reopen`) and
        hands it over to be bound."""
        self._graph_optimizer = optimizer
        self._open_optimizer()

    def _open_optimizer(self) -> None:
        self.opt_s = Bound(os.path.join(self.dir, self._graph_optimizer.graph), self.opts, "optimizer")
        self._graph_optimizer.bind(self.opt_s)

    def restore(self, old: tuple) -> None:
        self.train_s, self._eval_s, self.opt_s, self.opts = old
        if self.opt_s is not None:
            self._graph_optimizer.bind(self.opt_s)

    # ------------------------------------------------------------------ binding
    def _batch_buffers(self, shapes: dict) -> dict:
        """One buffer per fed graph input, of its feature's batch shape and dtype."""
        missing = {g: f for g, f in self.feeds.items() if f not in shapes}
        if missing:
            raise UsageError("the dataset lacks the feature(s) that feed graph inputs (map others with data.inputs)",
                             [f"graph input '{g}' <- feature '{f}': not in the dataset (its features: "
                              f"{', '.join(shapes)})" for g, f in missing.items()])
        return {g: self.xp.zeros(*shapes[f]) for g, f in self.feeds.items()}

    def _label_check(self):
        """(graph input, feature, classes, ignore_index) of cross-entropy labels, checked per micro-batch."""
        labels, classes = self.manifest.get("labels"), self.manifest.get("classes")
        if not classes or labels not in self.feeds:
            return None
        return labels, self.feeds[labels], classes, self.manifest.get("ignore_index", -100)

    def _check_inputs(self, bound: "Bound", batch: dict) -> None:
        static = (self.manifest.get("build") or {}).get("static_shape")
        hint = f" (its train graph was prepared for the micro-batch x length {static}: prepare again " \
               f"for another)" if static and bound.name == "train" else ""
        check_inputs(bound.session, bound.path, batch, self.feeds, hint)

    def _masks(self, spec: dict | None, seed: int):
        """The dropout mask buffers (host; on the GPU a device twin of each, ``self.mask_dev``)."""
        if not spec:
            return None
        sizes = {}
        for sym, (name, axis) in spec["dims"].items():
            if name not in self.batch:
                raise UsageError(f"dropout masks: data input '{name}' (of the mask dim '{sym}') is not fed")
            sizes[sym] = self.batch[name].shape[axis]
        masks = DropoutMasks(spec, sizes, seed)
        self.mask_dev = masks.buffers if self.xp is np else \
            {k: self.xp.zeros(v.shape, v.dtype) for k, v in masks.buffers.items()}
        return masks

    @property
    def eval_s(self):
        """The eval session, opened and bound on first use (``lazy_eval``); None once closed."""
        if self._eval_s is None and self.train_s is not None:
            self._open_eval()
        return self._eval_s

    @property
    def eval_metrics(self) -> dict:
        """The eval graph's metric outputs (name -> float32 scalar) of its last run."""
        return self._eval_metrics if self.eval_s is not None else {}

    def _open_eval(self) -> None:
        self._eval_s = Bound(os.path.join(self.dir, "eval.onnx"), self.opts, "eval")
        self._bind_eval()

    def _bind_eval(self) -> None:
        L, S, e = self.layout, self.state_layout, self._eval_s
        self._check_inputs(e, self.eval_batch)
        for name, arr in self.eval_batch.items():
            e.bind_in(name, arr)
        for i, name in enumerate(S.names):
            e.bind_in(name, S.view(self.state, i))
        for i, name in enumerate(L.names):
            e.bind_in(name, L.view(self.params, i))
        for i, name in enumerate(self.frozen_layout.names):
            e.bind_in(name, self.frozen_layout.view(self.frozen, i))
        e.bind_out(LOSS, self.eval_loss)
        # eval metrics (metric/<name>/sum|count, float32 scalars) to host scalars; other outputs unbound: never copied
        self._eval_metrics = {}
        for out in e.session.get_outputs():
            if out.name.startswith(METRIC_PREFIX):
                if out.type != "tensor(float)" or any(d not in (1,) for d in (out.shape or [])):
                    raise UsageError(f"{e.path}: eval-metric output '{out.name}' must be a float32 scalar "
                                     f"(it is {out.type} of shape {out.shape})")
                self._eval_metrics[out.name] = np.zeros(out.shape or (), np.float32)
                e.bind_out(out.name, self._eval_metrics[out.name])
        # a task head's logits (manifest task_labels): onnxruntime's, read back after each run (:meth:`evaluate`)
        self._eval_allocated = [self.manifest["logits"]] if self.manifest.get("task_labels") else []

    def _bind_all(self) -> None:
        L, S = self.layout, self.state_layout
        t = self.train_s
        self._check_inputs(t, self.batch)
        for name, arr in self.batch.items():
            t.bind_in(name, arr)
        for name, arr in (self.mask_dev if self.masks else {}).items():
            t.check_shape(name, arr.shape)
            t.bind_in(name, arr)
        known = set(L.names) | set(S.names) | set(self.frozen_layout.names) | set(self.batch) \
            | {RESET, self.manifest.get("loss_scale")}
        missing = [n for n in t.input_names if n not in known
                   and not n.startswith(MASK_PREFIX) and not n.endswith(BUFFER_SUFFIX)]
        if missing:
            raise UsageError(f"graph input(s) neither parameters nor fed by a dataset feature: {', '.join(missing)} "
                             f"(feed each with data.inputs: {{INPUT: FEATURE}})")
        for i, (name, out) in enumerate(zip(S.names, (s["output"] for s in self.manifest.get("states", [])))):
            t.bind_in(name, S.view(self.state, i))
            t.bind_out(out, S.view(self.state_next, i))
        for i, name in enumerate(self.frozen_layout.names):
            if name in t.input_names:       # (a train graph cut in segments: in those that read it)
                t.bind_in(name, self.frozen_layout.view(self.frozen, i))
        self.flags = []
        self._grads_bound = self.grads      # where the gradient outputs are bound (forward_backward)
        for i, name in enumerate(L.names):
            p, g = L.view(self.params, i), L.view(self.grads, i)
            t.bind_in(name, p)
            if self.grad_outputs:
                t.bind_out(self.grad_outputs[name], g)
                continue
            t.bind_in(name + BUFFER_SUFFIX, g)
            flag = np.zeros(1, bool)
            self.flags.append(flag)
            t.bind_out(name + ACC_OUT_SUFFIX, flag)
        if not self.grad_outputs:
            t.bind_in(RESET, self.reset)
        if self.loss_scale is not None:
            t.bind_in(self.manifest["loss_scale"], self.loss_scale)
        t.bind_out(LOSS, self.loss)
        for name in self.stats_outputs:     # onnxruntime allocates them, on the device, each run
            t.bind_allocated(name)
        self.eval_logits = None


    # ------------------------------------------------------------------ steps
    def set_batch(self, batch: dict, target: dict | None = None, labels: bool = True) -> None:
        """``batch`` copied into the ``target`` buffers (default: the train batch's); ``labels``: a data
        batch, whose labels are checked (not the dropout masks)."""
        target = self.batch if target is None else target
        if self.label_check and labels:
            self._check_labels(batch)
        for k, buf in target.items():
            src = batch[self.feeds.get(k, k)]
            if src.shape != buf.shape:
                raise TrainrunError(f"batch '{k}' has shape {src.shape}, the engine was built for {buf.shape}")
            from_host(buf, src)

    def _check_labels(self, batch: dict) -> None:
        name, feature, classes, ignore = self.label_check
        y = batch[feature]
        bad = (y >= classes) | ((y < 0) & (y != ignore))
        if bad.any():
            value = int(y[bad].flat[0])
            raise UsageError(f"feature '{feature}' (graph input '{name}') holds label {value}: not a class of "
                             f"the {classes} (0..{classes - 1}) nor model.loss.ignore_index ({ignore})")

    def forward_backward(self, batch: dict, accumulate: bool, position: int | None = None,
                         between=None) -> float:
        """Loss of one micro-batch (unscaled); its gradients (times :attr:`loss_scale` when the graph has
        one) overwrite (accumulate=False) or add to the buffer.
        ``position``: the global position of its first sample (TrainLoader.sample_position), which
        keys its dropout masks; needed when the train graph has dropout.
        ``between``: with a train graph cut at gradient buckets (:attr:`buckets`), called with k when
        bucket k's gradients are final in the buffer (every bucket but the last), while the run goes on."""
        self.set_batch(batch)
        if self.masks:
            if position is None:
                raise TrainrunError("the train graph has dropout: forward_backward needs the micro-batch's "
                                    "global sample position")
            self.masks.fill(position)
            if self.mask_dev is not self.masks.buffers:
                self.set_batch(self.masks.buffers, self.mask_dev, labels=False)
        adding = accumulate and self.grad_outputs is not None
        if self.grad_outputs:
            self._gradients_into(self._scratch() if adding else self.grads)
        self.reset[0] = not accumulate
        if adding:
            self._run_adding(between)
        else:
            self.train_s.run(between)
        if self.state.size:       # the running statistics this micro-batch updated
            self.state[...] = self.state_next
        return float(self.loss) if self.loss_scale is None else float(self.loss) / float(self.loss_scale)

    def _scratch(self):
        """The flat buffer a later micro-batch's gradients are written into (direct form), allocated once."""
        if self.scratch is None:
            self.scratch = self.xp.zeros(self.layout.total, np.float32)
        return self.scratch

    def _gradients_into(self, flat) -> None:
        """The train graph's gradient outputs bound to the views of ``flat`` (the gradient buffer or
        :attr:`scratch`), unless they are already."""
        if self._grads_bound is flat:
            return
        for i, name in enumerate(self.layout.names):
            self.train_s.bind_out(self.grad_outputs[name], self.layout.view(flat, i), keep=False)
        self._grads_bound = flat

    def _run_adding(self, between) -> None:
        """One run of a direct-form train graph whose gradients go to :attr:`scratch`, each bucket of them
        added in place into the gradient buffer once it is final (before ``between`` hands the bucket
        on), the rest after the run: one add per element, the InPlaceAccumulatorV2's sum
        (buffer + gradient, float32), no other copy."""
        added = []

        def add(k, hand_on=True):
            lo, hi = self.buckets[k]
            g = self.grads[lo:hi]
            self.xp.add(g, self.scratch[lo:hi], out=g)
            added.append(k)
            if hand_on and between is not None:
                between(k)
        self.train_s.run(add)
        for k in [k for k in range(len(self.buckets)) if k not in added]:
            add(k, hand_on=False)

    @property
    def eval_batch_fixed(self) -> int | None:
        """The batch dim the eval graph fixes for its data inputs (a user graph may), else None: then an
        evaluation's last micro-batch may be smaller than the others (:meth:`evaluate`)."""
        return next((i.shape[0] for i in self.eval_s.session.get_inputs()
                     if i.name in self.eval_batch and i.shape and isinstance(i.shape[0], int)), None)

    def evaluate(self, batch: dict) -> float:
        """Loss of one eval micro-batch; its metric sums and counts are then in :attr:`eval_metrics`. A micro-batch
        smaller than the engine's (an evaluation's last) runs in buffers of its own size, bound for that run only;
        an output onnxruntime allocates (batch-sized logits) is bound anew each run (a binding keeps the last's)."""
        n = len(batch[self.feeds[next(iter(self.eval_batch))]])
        for name in self._eval_allocated:
            self.eval_s.binding.bind_output(name, "cpu")
        if n == next(iter(self.eval_batch.values())).shape[0]:
            self.set_batch(batch, self.eval_batch)
            self.eval_s.run()
        else:
            if n not in self._eval_rest:
                self._eval_rest[n] = {k: self.xp.zeros((n, *b.shape[1:]), b.dtype) for k, b in self.eval_batch.items()}
            rest = self._eval_rest[n]
            self.set_batch(batch, rest)
            for name, arr in rest.items():
                self.eval_s.bind_in(name, arr, keep=False)
            try:
                self.eval_s.run()
            finally:
                for name, arr in self.eval_batch.items():
                    self.eval_s.bind_in(name, arr, keep=False)
        if self._eval_allocated:
            self.eval_logits = self.eval_s.binding.get_outputs()[-1].numpy()
        return float(self.eval_loss)

    def close(self) -> None:
        """Drop the sessions and every buffer (the end of a run: what follows, e.g. rank 0's export,
        then does not stack on top of them)."""
        self.train_s = self._eval_s = self.opt_s = self._graph_optimizer = None
        self.params = self.grads = self.state = self.state_next = self.masks = self.frozen = None
        self.batch, self.eval_batch = {}, {}

    def load_weights(self, path: str | None = None) -> None:
        """Fill the parameter buffer from a safetensors file (default: the initial weights)."""
        self._fill(path or os.path.join(self.dir, "weights.safetensors"),
                   [(self.layout, self.params), (self.state_layout, self.state)])

    def _fill(self, path: str, parts) -> None:
        """Each (layout, flat buffer) of ``parts`` filled from the safetensors file ``path``, a tensor at a time."""
        with safe_open(path, framework="np") as f:
            held = set(f.keys())
            for layout, flat, i, name in [(L, b, i, n) for L, b in parts for i, n in enumerate(L.names)]:
                if name not in held:
                    raise UsageError(f"{path}: no tensor '{name}'")
                v, t = layout.view(flat, i), f.get_tensor(name)
                if t.shape != v.shape:
                    raise UsageError(f"{path}: tensor '{name}' has shape {t.shape}, the model expects {v.shape}")
                v[...] = self.xp.asarray(t)

    def extra_train_outputs(self) -> dict:
        """The train graph's statistics outputs (debug.tensors) of its last run, on the host."""
        if not self.stats_outputs:
            return {}
        return {n: self.train_s.value(n) for n in self.stats_outputs}

    def grad_norm_sq(self) -> float:
        """Squared L2 norm of the gradient buffer (inf/nan when it holds any).

        On the host: float32 dots of 64Ki-element chunks summed in float64. One float32 dot over
        the whole buffer carries a rounding error that grows with its length and depends on the
        CPU's BLAS (4e-5 relative seen on 0.55M parameters), and the norm sets the clip factor."""
        g = self.grads
        if self.xp is not np:      # cupy reduces in a tree on the device
            return float(self.xp.dot(g, g))
        return norm_sq(g)

