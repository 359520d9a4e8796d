"""The tensor names a prepared graph and the run time (engine, evaluate, export) agree on. Imports
nothing (not onnx): the run-time side reads them without loading graph surgery."""

LOSS = "loss"
RESET = "lazy_reset_grad"
GRAD_SUFFIX = "_grad"
BUFFER_SUFFIX = "_grad.accumulation.buffer"
ACC_OUT_SUFFIX = "_grad.accumulation.out"
# Eval metrics: a forward graph may output float32 scalars ``metric/<name>/sum`` and
# ``metric/<name>/count``; the eval graph keeps them, the runner sums each over eval batches and
# ranks and reports ``eval_<name> = sum / count`` (e.g. correct predictions / labelled positions).
METRIC_PREFIX = "metric/"
# the train graph's input holding a Dropout's mask (:mod:`trainrun.graphs.dropout_nodes`)
MASK_PREFIX = "dropout_mask/"
# fp16: the train graph's float32 scalar input the loss is multiplied by (:mod:`trainrun.step.precision`)
LOSS_SCALE = "loss_scale"


def metric_names(outputs: list[str]) -> list[str]:
    """``<name>`` of every complete ``metric/<name>/sum`` + ``metric/<name>/count`` pair."""
    names = [o[len(METRIC_PREFIX):-len("/sum")] for o in outputs if o.endswith("/sum")]
    return [n for n in names if f"{METRIC_PREFIX}{n}/count" in outputs]
