"""trainrun's own reverse-mode gradient builder: the gradient graph in standard ONNX ops, so that it runs
on stock onnxruntime (``graphs.builder: trainrun``, :func:`trainrun.graphs.gradients.build_train_graph`).

* :mod:`.core`           the backward walk, the rule registry, the emitter of new nodes
* :mod:`.elementwise`    arithmetic, activations (Relu ... HardSwish Mish PRelu), trigonometry, Where Cast Clip
                         Sum Min Max Dropout
* :mod:`.matrix`         MatMul Gemm
* :mod:`.einsum`         Einsum
* :mod:`.shape`          Reshape Transpose Unsqueeze Squeeze Flatten Concat Slice Split Expand Pad Tile Trilu
                         CumSum DepthToSpace SpaceToDepth
* :mod:`.reductions`     ReduceSum ReduceMean ReduceL1 ReduceL2 ReduceSumSquare ReduceLogSumExp ReduceProd
                         Softmax LogSoftmax
* :mod:`.normalisation`  LayerNormalization InstanceNormalization GroupNormalization RMSNormalization
* :mod:`.indexing`       Gather (an embedding table's rows)
* :mod:`.selection`      Gather along other axes, GatherElements, GatherND, ReduceMax ReduceMin, TopK,
                         ScatterElements ScatterND
* :mod:`.losses`         SoftmaxCrossEntropyLoss NegativeLogLikelihoodLoss
* :mod:`.patterns`       subgraphs differentiated as one (the tanh-GELU written with a Sigmoid, the erf
                         GELU written out, SiLU, attention's Softmax and the product that reads it)
* :mod:`.conv`           Conv ConvTranspose MaxPool AveragePool LpPool GlobalAveragePool GlobalMaxPool
                         GlobalLpPool (1-, 2- and 3-D windows) BatchNormalization (training and inference forms)
* :mod:`.resize`         Resize
* :mod:`.recurrent`      LSTM GRU RNN, written out in per-timestep ops before the walk (:data:`.core.EXPANSIONS`);
                         an LSTM onnxruntime's kernel computes left whole, with its own rule
* :mod:`.static`         the tensors' dims: shape inference, again after folding known integer arithmetic

:func:`covered_ops` lists them all (docs/models.md's table: :func:`ops_markdown`).
Integer and boolean tensors, and the outputs of :data:`.core.NO_GRADIENT`'s ops (Shape, Size, comparisons,
ArgMax, ...), carry no gradient. An op or case without a rule is a :class:`NoGradient` naming the node.
"""

from . import (conv, einsum, elementwise, indexing, losses, matrix, normalisation,  # noqa: F401 - registers rules
               patterns, recurrent, reductions, resize, selection, shape)
from .core import EXPANSIONS, NO_GRADIENT, RULES, NoGradient, blocked_by, differentiate, gradient, unreached

__all__ = ["NoGradient", "blocked_by", "covered_ops", "differentiate", "gradient", "ops_markdown", "unreached"]


def covered_ops() -> dict[str, list[str]]:
    """The op types with a gradient rule (or written out in ops that have one: :data:`.core.EXPANSIONS`),
    sorted, by the module that holds each."""
    out: dict[str, list[str]] = {}
    table = {**RULES, **EXPANSIONS}
    for op in sorted(table):
        out.setdefault(table[op].__module__.rsplit(".", 1)[-1], []).append(op)
    return dict(sorted(out.items()))


def ops_markdown() -> str:
    """The table of docs/models.md's "Ops with gradient rules" (``make docs`` writes it, tests/test_docs.py
    checks it)."""
    rows = [f"| `{module}` | {', '.join(ops)} |" for module, ops in covered_ops().items()]
    rows.append(f"| no gradient (the walk stops there) | {', '.join(sorted(NO_GRADIENT))} |")
    return "\n".join(["| module of rules | op types |", "|---|---|", *rows]) + "\n"
