"""The run-time side of a prepared manifest: which dataset feature feeds each graph input, and the eval
results from the eval graph's summed outputs. Used by the runner and ``trainrun evaluate``."""

from __future__ import annotations

import math

from .errors import UsageError
from .graphs.names import METRIC_PREFIX, metric_names

def feeds(manifest: dict, data_inputs: dict, features=None) -> dict:
    """{graph input: dataset feature}: ``data_inputs`` (the config's data.inputs) where it names the
    input, else the feature of the input's own name; the loss's labels input falls back to the feature
    ``labels`` when ``features`` (the dataset's, if known) has none of its name."""
    labels = manifest.get("labels")
    inputs = list(manifest["inputs"]) + ([labels] if labels else [])
    unknown = [k for k in data_inputs if k not in inputs]
    if unknown:
        raise UsageError(f"data.inputs: {', '.join(repr(k) for k in unknown)} not a data input of the model "
                         f"(its data inputs: {', '.join(inputs)})")
    out = {i: data_inputs.get(i, i) for i in inputs}
    if labels and labels not in data_inputs and features is not None and labels not in features:
        out[labels] = "labels"
    return out


def eval_results(loss: float, sums: dict[str, float], perplexity: bool = True) -> dict[str, float]:
    """``loss``, ``perplexity`` (where asked for) and ``<name>`` = sum / count of every metric, from the
    mean eval loss and the ``metric/<name>/sum|count`` outputs summed over batches and ranks (NaN for a
    count of 0)."""
    result = {"loss": loss}
    if perplexity:      # of a label-smoothed loss: from the plain cross-entropy (the metric ce)
        result["perplexity"] = math.exp(min(loss, 80.0))
    for name in metric_names(list(sums)):
        c = sums[f"{METRIC_PREFIX}{name}/count"]
        result[name] = sums[f"{METRIC_PREFIX}{name}/sum"] / c if c else float("nan")
    if perplexity and "ce" in result:
        result["perplexity"] = math.exp(min(result["ce"], 80.0))
    return result
