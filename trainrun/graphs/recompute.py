"""Activation recomputation (``train.recompute: blocks``): a rewrite of the train graph.

Without it, every activation of the forward pass that the backward pass reads stays alive from the
forward pass to its backward consumer: for GPT-2 the attention scores and probabilities of every layer
([batch, heads, seq, seq] each) dominate the memory of a step. With it, each transformer block's forward
nodes are duplicated for the backward pass: the backward consumers read the duplicates' outputs, so the
forward pass keeps only each block's output (the next block's input) and the originals inside a block
are freed as soon as the forward pass is done with them. The duplicates of block ``i`` sit, in the
node list, just before the first backward node that reads them, and read the block's inputs through
``Where(gate, x, x)`` (= x) whose scalar ``gate`` is taken from a gradient that node reads: they cannot
run before the backward pass reaches the block. The train session runs nodes in list order
(``sessions.session_options(recompute=True)``: priority-based order) without common-subexpression
elimination, which would merge each duplicate back into its original (``sessions.disabled_optimizers``).
Dropout is a product with a mask input (``graphs.dropout_masks``), so the recomputed values equal the
originals: measured, the gradients are the same bits.

Why not onnxruntime-training's own memory optimizer (session config
``optimization.memory_optimizer_config``): in 1.19 it only acts on graphs split by a ``YieldOp``
(ORTModule's forward/backward boundary), which trainrun's train graph (one session runs forward and
backward) does not have; measured: the session accepts the config and changes nothing.

Blocks are found from the parameter names: ``PREFIX.<i>.…`` (the built-in families' transformers names
are so). A forward node belongs to block ``i`` when the last block whose
parameters it depends on is ``i`` and a block's parameters are read at or after it (the nodes after
the last block, e.g. the final LayerNorm, the head and the loss, are not recomputed).
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper

from ..errors import TrainrunError, UsageError

SUFFIX = "/recompute"
_FLAT, _ZERO = "recompute/c_flat", "recompute/c_zero"
_INDEXED = re.compile(r"^(.*?)\.(\d+)\.")
_INF = float("inf")
_RANDOM = {"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
           "Bernoulli", "BitmaskDropout", "BiasDropout"}


def block_of_params(params: list[str]) -> dict[str, int]:
    """{parameter: its block}, for the parameters named ``PREFIX.<i>.…`` under the prefix that most
    parameters share (at least two blocks); {} when there is none."""
    by_prefix: dict[str, dict[str, int]] = defaultdict(dict)
    for p in params:
        m = _INDEXED.match(p)
        if m:
            by_prefix[m.group(1)][p] = int(m.group(2))
    best = max(by_prefix.values(), key=len, default={})
    return best if len(set(best.values())) >= 2 else {}


def recompute_blocks(train: onnx.ModelProto, params: list[str], loss: str, source: str,
                     outputs_kept=()) -> onnx.ModelProto:
    """``train`` (a graph from :func:`trainrun.graphs.build_train_graph`) with each block's forward
    recomputed for its backward consumers. ``loss`` and ``outputs_kept`` (state updates): the forward
    outputs; every node they depend on is a forward node, the others are backward nodes. Returns a new
    model; UsageError when the parameters name no blocks."""
    blocks = block_of_params(params)
    if not blocks:
        raise UsageError(f"{source}: train.recompute blocks needs repeated blocks whose parameters are named "
                         f"PREFIX.<i>.… (a prefix, the block number, then the parameter's name); none found")
    nodes = list(train.graph.node)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    for k, n in enumerate(nodes):
        if any(producer.get(t, -1) >= k for t in n.input if t):
            raise TrainrunError(f"{source}: the train graph's nodes are not in topological order")

    forward: set[int] = set()          # the nodes that the loss and the state updates depend on
    stack = [producer[t] for t in (loss, *outputs_kept) if t in producer]
    while stack:
        k = stack.pop()
        if k not in forward:
            forward.add(k)
            stack.extend(producer[t] for t in nodes[k].input if t in producer)

    lo = {}        # the last block whose parameters a forward node depends on (-1: none)
    for k in sorted(forward):
        lo[k] = max([blocks.get(t, -1) for t in nodes[k].input]
                    + [lo[producer[t]] for t in nodes[k].input if t in producer], default=-1)
    consumers = defaultdict(list)
    for k, n in enumerate(nodes):
        for t in n.input:
            consumers[t].append(k)
    hi = {}        # the first block whose parameters a forward node or one after it reads
    for k in sorted(forward, reverse=True):
        own = [blocks[t] for t in nodes[k].input if t in blocks]
        after = [hi[c] for o in nodes[k].output for c in consumers[o] if c in forward]
        hi[k] = min(own + after, default=_INF)
    # random ops are not run twice (another draw): their outputs are kept like the block's inputs
    block = {k: lo[k] for k in forward if lo[k] >= 0 and hi[k] < _INF and nodes[k].op_type not in _RANDOM}

    # a block's outputs read by forward nodes outside it (the next block's input) stay as they are
    kept = {o for k, b in block.items() for o in nodes[k].output
            if any(c in forward and block.get(c) != b for c in consumers[o])}
    stash: dict[int, set[str]] = defaultdict(set)     # block -> its tensors that backward nodes read
    for k, b in block.items():
        for o in nodes[k].output:
            if o and o not in kept and any(c not in forward for c in consumers[o]):
                stash[b].add(o)

    renamed: dict[str, str] = {}
    made: set[str] = set()          # the gated tensors written so far
    inserts: dict[int, list[onnx.NodeProto]] = defaultdict(list)   # before node k: these duplicates
    for b, tensors in sorted(stash.items()):
        need, todo = set(), [producer[t] for t in tensors]
        while todo:
            k = todo.pop()
            if k not in need:
                need.add(k)
                todo.extend(producer[t] for t in nodes[k].input if t in producer and block.get(producer[t]) == b
                            and producer[t] not in need)
        outs = {o for k in need for o in nodes[k].output if o}
        first = min(c for t in tensors for c in consumers[t] if c not in forward)
        # the duplicates read the block's inputs through a gate that waits for a gradient (one the first
        # backward consumer reads): they cannot run before the backward pass reaches the block
        grad = next((t for t in nodes[first].input if t in producer and producer[t] not in forward), None)
        ext = sorted({t for k in need for t in nodes[k].input if t in producer and t not in outs})
        dups, gated = [], {}
        if grad is not None and ext:
            gate = f"recompute/{b}/gate"
            dups.append(onnx.helper.make_node("Reshape", [grad, _FLAT], [gate + "/flat"], name=gate + "/flat"))
            dups.append(onnx.helper.make_node("Gather", [gate + "/flat", _ZERO], [gate + "/one"], name=gate + "/one",
                                              axis=0))
            dups.append(onnx.helper.make_node("Cast", [gate + "/one"], [gate], name=gate, to=onnx.TensorProto.BOOL))
            for t in ext:      # Where(gate, t, t) == t, a scalar gate broadcasts to any shape
                # a tensor several blocks read (a shape computed once before the blocks, which trainrun's
                # gradient builder keeps and onnxruntime-training's folds): gated once per block
                gated[t] = f"{t}{SUFFIX}/gated" if f"{t}{SUFFIX}/gated" not in made else f"{t}{SUFFIX}/{b}/gated"
                made.add(gated[t])
                dups.append(onnx.helper.make_node("Where", [gate, t, t], [gated[t]], name=gated[t]))
        for k in sorted(need):
            d = onnx.NodeProto()
            d.CopyFrom(nodes[k])
            d.name = (nodes[k].name or nodes[k].output[0]) + SUFFIX
            d.input[:] = [t + SUFFIX if t in outs else gated.get(t, t) for t in d.input]
            d.output[:] = [o + SUFFIX if o else o for o in d.output]
            dups.append(d)
        inserts[first].extend(dups)
        renamed.update({t: t + SUFFIX for t in tensors})

    new_nodes = []
    for k, n in enumerate(nodes):
        new_nodes.extend(inserts.get(k, ()))
        if k not in forward:
            n = _with_inputs(n, renamed)
        new_nodes.append(n)
    model = onnx.ModelProto()
    model.CopyFrom(train)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    if any(n.name.endswith("/gate") for n in new_nodes):
        model.graph.initializer.extend([onnx.numpy_helper.from_array(np.array([-1], np.int64), _FLAT),
                                        onnx.numpy_helper.from_array(np.array(0, np.int64), _ZERO)])
    return model


def _with_inputs(node: onnx.NodeProto, renamed: dict[str, str]) -> onnx.NodeProto:
    if not any(t in renamed for t in node.input):
        return node
    n = onnx.NodeProto()
    n.CopyFrom(node)
    n.input[:] = [renamed.get(t, t) for t in n.input]
    return n


def recomputed_nodes(model: onnx.ModelProto) -> int:
    """How many nodes of ``model`` are recomputations."""
    return sum(n.name.endswith(SUFFIX) for n in model.graph.node)
