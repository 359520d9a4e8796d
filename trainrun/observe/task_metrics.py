"""Fine-tuning task metrics from logits and labels, in NumPy: accuracy, macro F1, Pearson, Spearman.

Each rank adds its batches into a :class:`TaskMetrics`; :meth:`TaskMetrics.stats` is a float64 vector
of sums (so the ranks' vectors add up to the whole eval set's: one allreduce), and Spearman's rank
correlation, which needs every prediction, takes the ranks' (prediction, label) pairs gathered.
:meth:`TaskMetrics.result` finishes from those:

* classification (``num_labels`` > 1; token classification too, per token, labels ``ignore_index``
  left out): predictions are the argmax of the logits; ``accuracy`` = correct / counted; ``f1`` =
  the macro F1, the mean over the classes that occur among labels or predictions of
  2 tp / (2 tp + fp + fn) (scikit-learn's ``f1_score(average="macro")``);
* regression (``num_labels`` 1): ``pearson`` from the sums of x, y, x², y², xy and the count (float64;
  exact enough for labels and predictions of moderate size, as regression targets are), ``spearman`` =
  Pearson's r of the ranks, ties given their average rank (scipy's ``spearmanr``).

A metric that is undefined (no counted label, a constant series) is NaN.
"""

from __future__ import annotations

import numpy as np


class TaskMetrics:
    def __init__(self, num_labels: int, ignore_index: int = -100):
        if num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {num_labels}")
        self.num_labels, self.ignore_index = num_labels, ignore_index
        self.regression = num_labels == 1
        self._stats = np.zeros(6 if self.regression else 1 + 3 * num_labels, np.float64)
        self._pairs: list[np.ndarray] = []

    def add(self, logits, labels) -> None:
        """One batch: ``logits`` [..., num_labels] (regression: [...] or [..., 1]), ``labels`` [...]."""
        logits, labels = np.asarray(logits), np.asarray(labels)
        if self.regression:
            x = logits.reshape(-1).astype(np.float64)
            y = labels.reshape(-1).astype(np.float64)
            if x.shape != y.shape:
                raise ValueError(f"{x.size} predictions for {y.size} labels")
            self._stats += [x.size, x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum()]
            self._pairs.append(np.stack([x, y]))
            return
        if logits.shape[-1] != self.num_labels or logits.shape[:-1] != labels.shape:
            raise ValueError(f"logits {list(logits.shape)} do not match labels {list(labels.shape)} "
                             f"and {self.num_labels} labels")
        keep = labels.reshape(-1) != self.ignore_index
        y = labels.reshape(-1)[keep].astype(np.int64)
        p = logits.reshape(-1, self.num_labels)[keep].argmax(-1)
        if y.size and (y.min() < 0 or y.max() >= self.num_labels):
            raise ValueError(f"labels outside [0, {self.num_labels}): {y.min()}..{y.max()}")
        k = self.num_labels
        hit = p == y
        self._stats[0] += y.size
        self._stats[1:1 + k] += np.bincount(y[hit], minlength=k)                   # tp
        self._stats[1 + k:1 + 2 * k] += np.bincount(p[~hit], minlength=k)          # fp
        self._stats[1 + 2 * k:] += np.bincount(y[~hit], minlength=k)               # fn

    def stats(self) -> np.ndarray:
        """The sums to add over ranks (a copy)."""
        return self._stats.copy()

    def pairs(self) -> np.ndarray:
        """[2, n] (predictions, labels) of a regression, for Spearman (gathered over ranks)."""
        return np.concatenate(self._pairs, axis=1) if self._pairs else np.zeros((2, 0))

    def result(self, stats: np.ndarray | None = None, pairs: list[np.ndarray] | None = None) -> dict[str, float]:
        """The metrics of the summed ``stats`` and all ranks' ``pairs`` (default: this rank's own):
        ``accuracy``, ``f1``; or ``pearson``, ``spearman``."""
        s = self._stats if stats is None else np.asarray(stats, np.float64)
        if self.regression:
            every = self.pairs() if pairs is None else np.concatenate([np.asarray(p) for p in pairs], axis=1)
            return {"pearson": pearson_from_sums(s), "spearman": spearman(every[0], every[1])}
        k = self.num_labels
        count, tp, fp, fn = s[0], s[1:1 + k], s[1 + k:1 + 2 * k], s[1 + 2 * k:]
        seen = tp + fp + fn > 0
        f1 = 2 * tp[seen] / (2 * tp[seen] + fp[seen] + fn[seen])
        return {"accuracy": float(tp.sum() / count) if count else float("nan"),
                "f1": float(f1.mean()) if seen.any() else float("nan")}


def pearson_from_sums(s) -> float:
    """Pearson's r from [n, Σx, Σy, Σx², Σy², Σxy]."""
    n, sx, sy, sxx, syy, sxy = (float(v) for v in s)
    if n < 2:
        return float("nan")
    cov = sxy - sx * sy / n
    vx, vy = sxx - sx * sx / n, syy - sy * sy / n
    if vx <= 0 or vy <= 0:
        return float("nan")
    return float(np.clip(cov / np.sqrt(vx * vy), -1.0, 1.0))


def average_ranks(a) -> np.ndarray:
    """Ranks 1..n of ``a``, ties given the mean of the ranks they span."""
    a = np.asarray(a, np.float64).reshape(-1)
    order = np.argsort(a, kind="stable")
    sorted_a = a[order]
    starts = np.flatnonzero(np.r_[True, sorted_a[1:] != sorted_a[:-1]])
    ends = np.r_[starts[1:], a.size]
    mean_rank = (starts + ends + 1) / 2.0          # ranks starts+1 .. ends, averaged
    ranks = np.empty(a.size, np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def spearman(x, y) -> float:
    """Spearman's rank correlation: Pearson's r of the average ranks."""
    x, y = np.asarray(x).reshape(-1), np.asarray(y).reshape(-1)
    if x.size < 2:
        return float("nan")
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()          # every value is here: centred, no cancellation
    vx, vy = (rx * rx).sum(), (ry * ry).sum()
    if vx <= 0 or vy <= 0:
        return float("nan")
    return float(np.clip((rx * ry).sum() / np.sqrt(vx * vy), -1.0, 1.0))
