"""The run-time side of a prepared manifest: which dataset feature feeds each graph input, and the eval
results from the eval graph's summed outputs. Used by the runner and ``trainrun evaluate``."""

from __future__ import annotations

import math

import numpy as np

from ..errors import UsageError
from ..graphs.names import METRIC_PREFIX, metric_names

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


ORT_TYPES = {"tensor(float)": np.dtype(np.float32), "tensor(double)": np.dtype(np.float64),
              "tensor(float16)": np.dtype(np.float16), "tensor(int64)": np.dtype(np.int64),
              "tensor(int32)": np.dtype(np.int32), "tensor(int8)": np.dtype(np.int8),
              "tensor(uint8)": np.dtype(np.uint8), "tensor(bool)": np.dtype(bool)}


def check_inputs(session, path: str, batch: dict, feeds: dict, hint: str = "") -> None:
    """Every data input of ``session``'s graph (``path``) that ``batch`` feeds (graph input -> array, fed
    by the dataset feature ``feeds[input]``) has its declared element type and dims, a fixed batch dim
    included: else a UsageError naming the feature, the input and both (``hint`` added to the first line)."""
    problems = []
    for i in session.get_inputs():
        if i.name not in batch:
            continue
        arr, feature = batch[i.name], feeds[i.name]
        want = ORT_TYPES.get(i.type)
        shape_ok = len(i.shape) == arr.ndim and all(not isinstance(d, int) or d == s
                                                    for d, s in zip(i.shape, arr.shape))
        if want != arr.dtype or not shape_ok:
            batch_note = "" if shape_ok or not (i.shape and isinstance(i.shape[0], int)
                                                and i.shape[0] != arr.shape[0]) else \
                f" (its batch dim is fixed to {i.shape[0]}, the micro-batch has {arr.shape[0]})"
            problems.append(f"feature '{feature}' ({arr.dtype}, per sample {list(arr.shape[1:])}) does not fit "
                            f"graph input '{i.name}' ({want or i.type}, per sample {list(i.shape[1:])}, "
                            f"batch dim {i.shape[0] if i.shape else '-'}){batch_note}")
    if problems:
        raise UsageError(f"{path}: the data does not fit the graph's inputs{hint}", problems)
