"""The train graph's gradients, by the builder ``graphs.builder`` chooses (:func:`builder`): onnxruntime-
training's (:mod:`.ort_gradients`: accumulated in place by InPlaceAccumulatorV2) or trainrun's own
(:mod:`.autodiff`: standard ONNX ops, the gradients as outputs, the direct form); a graph's gradients
written straight into the flat buffer (:func:`direct_gradients`); chosen intermediate tensors as outputs
(``debug.tensors``)."""

from __future__ import annotations

import copy
import fnmatch
from functools import lru_cache

import onnx
from onnx import helper

from ..errors import TrainrunError, UsageError
from .names import BUFFER_SUFFIX, GRAD_SUFFIX, LOSS, RESET
from .ort_gradients import independent, ort_train_graph

# the builders, as a message names them
BUILDER_NAMES = {"onnxruntime": "onnxruntime-training's", "trainrun": "trainrun's own"}


@lru_cache(maxsize=None)
def ort_builder_missing() -> str | None:
    """Why onnxruntime-training's gradient builder cannot be used here (None: it can)."""
    try:
        import onnxruntime
    except ImportError as exc:
        return f"onnxruntime does not import ({exc})"
    try:
        from onnxruntime.capi._pybind_state import GradientGraphBuilder  # noqa: F401
    except ImportError:
        return f"the installed onnxruntime {onnxruntime.__version__} is not the training build"
    return None


def builder(choice: str) -> tuple[str, str]:
    """(the builder ``graphs.builder: choice`` uses, why). UsageError for ``onnxruntime`` where
    onnxruntime-training is not installed."""
    missing = ort_builder_missing()
    if choice == "trainrun":
        return "trainrun", "graphs.builder: trainrun"
    if choice == "onnxruntime":
        if missing:
            raise UsageError(f"graphs.builder: onnxruntime needs onnxruntime-training's gradient builder: {missing}",
                             ["install the training extra in place of stock onnxruntime (Python 3.10-3.12: "
                              "pip install --no-deps -e . && pip install $(python scripts/requirements.py "
                              "training); make setup-training), or set graphs.builder: auto or trainrun "
                              "(trainrun's own builder, stock onnxruntime)"])
        return "onnxruntime", "graphs.builder: onnxruntime"
    if missing:
        return "trainrun", f"graphs.builder: auto, and onnxruntime-training's builder is not available ({missing})"
    return "onnxruntime", "graphs.builder: auto, and onnxruntime-training is installed"


def build_train_graph(loss_model: onnx.ModelProto, params: list[str], source: str, keep=(),
                      builder: str = "onnxruntime") -> onnx.ModelProto:
    """Gradients of ``loss`` w.r.t. ``params`` (already graph inputs) by ``builder``; the outputs
    ``keep`` (e.g. BatchNormalization's updated running stats) stay outputs. onnxruntime: accumulated
    in place (:func:`trainrun.graphs.ort_gradients.ort_train_graph`); trainrun: the direct form, outputs
    ``loss``, ``keep``, then ``<param>_grad`` per parameter, no accumulators."""
    if builder == "onnxruntime":
        return ort_train_graph(loss_model, params, source, keep)
    from .autodiff import NoGradient, blocked_by, differentiate, unreached
    cannot = f"{source}: trainrun's gradient builder cannot differentiate this graph: "
    missing = unreached(loss_model, params, LOSS)
    stops = blocked_by(loss_model, missing, LOSS) if missing else []
    if stops:       # the loss reads them, through ops without a gradient only (a Round of a weight)
        named = [f"operator {n.op_type}{f' (node {n.name!r})' if n.name else ''} has no gradient" for n in stops]
        raise UsageError(cannot + "; ".join(named[:3]) + f" (the only paths from {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''} to the loss); freeze the parameters that feed it "
                         f"(model.frozen) or express it with differentiable operators")
    if missing:
        raise independent(source, missing)
    try:
        model = differentiate(loss_model, params, LOSS)
    except NoGradient as exc:
        raise UsageError(cannot + str(exc),
                         ["onnxruntime-training's builder may (graphs.builder: onnxruntime, where "
                          "onnxruntime-training is installed); or freeze the parameters that feed the operator "
                          "(model.frozen)"]) from None
    outputs = {o.name: o for o in model.graph.output}
    order = [LOSS, *keep, *(p + GRAD_SUFFIX for p in params)]
    del model.graph.output[:]
    model.graph.output.extend(outputs[n] for n in order)
    return model


def direct_gradients(train: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str]]:
    """``train`` (a :func:`build_train_graph` graph) without its accumulators, for runs that never
    accumulate (``train.gradient_accumulation_steps`` 1): each parameter's gradient becomes a graph
    output, which the engine binds to the parameter's view of the flat gradient buffer, so the kernel
    that computes it writes it there. With InPlaceAccumulatorV2 every gradient is first written into
    onnxruntime's arena and then copied into the buffer (~2.5% of a GPT-2 124M forward/backward).
    Returns (the graph, parameter -> its gradient output). The bits are the same: a reset accumulator
    copies its value. A graph already in that form (trainrun's builder: ``<param>_grad`` outputs, no
    accumulators) is returned as it is."""
    model = onnx.ModelProto()
    model.CopyFrom(train)
    g = model.graph
    acc = [n for n in g.node if n.op_type == "InPlaceAccumulatorV2" and n.input[0].endswith(BUFFER_SUFFIX)]
    if not acc:
        outputs = {o.name[:-len(GRAD_SUFFIX)]: o.name for o in g.output if o.name.endswith(GRAD_SUFFIX)}
        if not outputs or any(i.name == RESET for i in g.input):
            raise TrainrunError("the train graph has neither gradient accumulators nor gradient outputs "
                                "(not built by trainrun prepare?)")
        return model, outputs
    buffers = {i.name: i for i in g.input if i.name.endswith(BUFFER_SUFFIX)}
    outputs, dropped = {}, {n.output[0] for n in acc}
    for n in acc:
        g.node.remove(n)
        param = n.input[0][:-len(BUFFER_SUFFIX)]
        out = copy.deepcopy(buffers[n.input[0]])     # the buffer's type and shape = the gradient's
        out.name = outputs[param] = n.input[1]
        g.output.append(out)
    kept = [i for i in g.input if i.name not in buffers and i.name != RESET]
    del g.input[:]
    g.input.extend(kept)
    kept = [o for o in g.output if o.name not in dropped]
    del g.output[:]
    g.output.extend(kept)
    return model, outputs


def select_outputs(model: onnx.ModelProto, patterns: list[str], protected=()) -> list[str]:
    """Names of node outputs of ``model`` matching any fnmatch pattern, in graph order.

    Raises a UsageError naming ``debug.tensors`` for a pattern that matches nothing."""
    existing = {o.name for o in model.graph.output} | set(protected)
    candidates = [o for n in model.graph.node for o in n.output if o and o not in existing]
    chosen, unmatched = [], []
    for pat in patterns:
        hits = [c for c in candidates if fnmatch.fnmatchcase(c, pat)]
        if not hits:
            unmatched.append(pat)
        chosen += [h for h in hits if h not in chosen]
    if unmatched:
        some = ", ".join(c for c in candidates[:40] if "/" not in c)
        raise UsageError("debug.tensors: no tensor of the train graph matches "
                         + ", ".join(repr(p) for p in unmatched),
                         [f"tensor names of the train graph include: {some} ...",
                          "list them all: python -c \"import onnx,sys; print(*[o for n in onnx.load(sys.argv[1])"
                          ".graph.node for o in n.output])\" RUN/graphs/train.onnx"])
    order = {c: i for i, c in enumerate(candidates)}
    return sorted(chosen, key=order.__getitem__)


def reads(nodes) -> set[str]:
    """The tensor names ``nodes`` read, those of their subgraphs (If, Loop, Scan bodies) included."""
    names = set()
    for n in nodes:
        names.update(n.input)
        for a in n.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                names |= reads(g.node)
    return names


def keep_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """``model`` (in place) with the outputs ``names`` only, the nodes they need and the graph inputs and
    initializers those nodes read: e.g. without a loss, its metrics and the labels input only they read.
    The nodes are found by reachability from ``names``, whatever order they are stored in (ONNX Runtime
    accepts a graph whose nodes are not in topological order); the kept ones stay in their stored order."""
    graph = model.graph
    producer = {o: k for k, n in enumerate(graph.node) for o in n.output if o}
    needed, stack, kept = set(names), list(names), set()
    while stack:
        k = producer.get(stack.pop())
        if k is None or k in kept:
            continue
        kept.add(k)
        new = reads([graph.node[k]]) - needed
        needed |= new
        stack.extend(new)
    nodes = [n for k, n in enumerate(graph.node) if k in kept]
    parts = {"node": nodes, "output": [o for o in graph.output if o.name in names],
             "input": [i for i in graph.input if i.name in needed],
             "initializer": [t for t in graph.initializer if t.name in needed],
             "value_info": [v for v in graph.value_info if v.name in {o for n in nodes for o in n.output}]}
    for field, kept in parts.items():
        kept = [copy.deepcopy(k) for k in kept]
        graph.ClearField(field)
        getattr(graph, field).extend(kept)
    return model


def add_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """Make the intermediate tensors ``names`` graph outputs too (type left to onnxruntime)."""
    for name in names:
        model.graph.output.append(helper.make_empty_tensor_value_info(name))
    return model
