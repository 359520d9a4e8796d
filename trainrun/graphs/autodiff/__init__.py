"""trainrun's own reverse-mode gradient builder: the gradient graph in standard ONNX ops, so that it runs
on stock onnxruntime (``graphs.builder: trainrun``, :func:`trainrun.graphs.gradients.build_train_graph`).

* :mod:`.core`           the backward walk, the rule registry, the emitter of new nodes
* :mod:`.elementwise`    Add Sub Mul Div Neg Pow Sqrt Exp Log Tanh Sigmoid Relu Erf Where Cast Identity Abs
                         Reciprocal Softplus LeakyRelu Gelu Clip Sum Min Max Dropout
* :mod:`.matrix`         MatMul Gemm
* :mod:`.shape`          Reshape Transpose Unsqueeze Squeeze Flatten Concat Slice Split Expand Pad
* :mod:`.reductions`     ReduceSum ReduceMean Softmax LogSoftmax
* :mod:`.normalisation`  LayerNormalization InstanceNormalization GroupNormalization RMSNormalization
* :mod:`.indexing`       Gather (an embedding table's rows)
* :mod:`.selection`      Gather along other axes, GatherElements, GatherND, ReduceMax ReduceMin
* :mod:`.losses`         SoftmaxCrossEntropyLoss NegativeLogLikelihoodLoss
* :mod:`.patterns`       subgraphs differentiated as one (the tanh-GELU written with a Sigmoid)
* :mod:`.conv`           Conv ConvTranspose MaxPool AveragePool LpPool GlobalAveragePool GlobalMaxPool
                         GlobalLpPool (1-, 2- and 3-D windows) BatchNormalization (training and inference forms)
* :mod:`.recurrent`      LSTM GRU RNN, written out in per-timestep ops before the walk (:data:`.core.EXPANSIONS`)
* :mod:`.static`         the tensors' dims: shape inference, again after folding known integer arithmetic

Integer and boolean tensors, and the outputs of :data:`.core.NO_GRADIENT`'s ops (Shape, Size, comparisons,
ArgMax, ...), carry no gradient. An op or case without a rule is a :class:`NoGradient` naming the node.
"""

from . import (conv, elementwise, indexing, losses, matrix, normalisation,  # noqa: F401 - registers the rules
               patterns, recurrent, reductions, selection, shape)
from .core import NoGradient, blocked_by, differentiate, gradient, unreached

__all__ = ["NoGradient", "blocked_by", "differentiate", "gradient", "unreached"]
