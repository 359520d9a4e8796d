"""trainrun's own reverse-mode gradient builder: the gradient graph in standard ONNX ops, so that it runs
on stock onnxruntime (``graphs.builder: trainrun``, :func:`trainrun.graphs.gradients.build_train_graph`).

* :mod:`.core`           the backward walk, the rule registry, the emitter of new nodes
* :mod:`.elementwise`    Add Sub Mul Div Neg Pow Sqrt Exp Log Tanh Sigmoid Relu Erf Where Cast Identity
* :mod:`.matrix`         MatMul Gemm
* :mod:`.shape`          Reshape Transpose Unsqueeze Squeeze Flatten Concat Slice Split
* :mod:`.reductions`     ReduceSum ReduceMean Softmax LogSoftmax
* :mod:`.normalisation`  LayerNormalization
* :mod:`.indexing`       Gather (an embedding table's rows)
* :mod:`.losses`         SoftmaxCrossEntropyLoss NegativeLogLikelihoodLoss
* :mod:`.conv`           Conv MaxPool AveragePool GlobalAveragePool BatchNormalization (2-D, inference form)
"""

from . import (conv, elementwise, indexing, losses, matrix, normalisation,  # noqa: F401 - registers the rules
               reductions, shape)
from .core import NoGradient, differentiate, gradient, unreached

__all__ = ["NoGradient", "differentiate", "gradient", "unreached"]
