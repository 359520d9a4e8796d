"""trainrun/observe/task_metrics.py against scikit-learn and scipy, split over pretend ranks."""

import numpy as np
import pytest
from scipy import stats
from sklearn.metrics import accuracy_score, f1_score

from trainrun.observe.task_metrics import TaskMetrics, average_ranks, spearman


def _split_over_ranks(metrics_of_rank, batches, ranks):
    """Each rank adds every ranks-th batch; their stats summed and pairs gathered, as an allreduce would."""
    per_rank = [metrics_of_rank() for _ in range(ranks)]
    for i, (logits, labels) in enumerate(batches):
        per_rank[i % ranks].add(logits, labels)
    summed = np.sum([m.stats() for m in per_rank], axis=0)
    return per_rank[0].result(summed, [m.pairs() for m in per_rank])


@pytest.mark.parametrize("ranks", [1, 3])
def test_classification_matches_sklearn(ranks):
    rng = np.random.default_rng(0)
    k = 5
    batches = []
    for _ in range(7):
        labels = rng.integers(0, k - 1, 13)               # class 4 never a label, sometimes predicted
        logits = rng.normal(size=(13, k)) + 2.0 * np.eye(k)[labels] * (rng.random(13) < 0.6)[:, None]
        batches.append((logits.astype(np.float32), labels))
    got = _split_over_ranks(lambda: TaskMetrics(k), batches, ranks)
    y = np.concatenate([b[1] for b in batches])
    p = np.concatenate([b[0].argmax(-1) for b in batches])
    assert got["accuracy"] == pytest.approx(accuracy_score(y, p), abs=1e-12)
    assert got["f1"] == pytest.approx(f1_score(y, p, average="macro"), abs=1e-12)
    assert 0.3 < got["accuracy"] < 0.95


def test_token_classification_leaves_out_ignored_labels():
    rng = np.random.default_rng(1)
    k = 3
    logits = rng.normal(size=(4, 10, k))
    labels = rng.integers(0, k, (4, 10))
    labels[:, 0] = labels[:, 7:] = -100                    # [CLS], padding, later sub-tokens
    m = TaskMetrics(k)
    m.add(logits, labels)
    keep = labels != -100
    y, p = labels[keep], logits.argmax(-1)[keep]
    assert m.result()["accuracy"] == pytest.approx(accuracy_score(y, p), abs=1e-12)
    assert m.result()["f1"] == pytest.approx(f1_score(y, p, average="macro"), abs=1e-12)
    with pytest.raises(ValueError, match="outside"):
        m.add(logits[:1], np.full((1, 10), 3))


@pytest.mark.parametrize("ranks", [1, 2])
def test_regression_matches_scipy_with_ties(ranks):
    rng = np.random.default_rng(2)
    batches = []
    for _ in range(5):
        labels = rng.integers(0, 6, 11) / 1.0                      # STS-B-like scores 0..5: many ties
        preds = (labels + rng.normal(scale=1.5, size=11)).round(1)  # rounded: ties among predictions too
        batches.append((preds[:, None].astype(np.float32), labels.astype(np.float32)))
    got = _split_over_ranks(lambda: TaskMetrics(1), batches, ranks)
    x = np.concatenate([b[0][:, 0] for b in batches]).astype(np.float64)
    y = np.concatenate([b[1] for b in batches]).astype(np.float64)
    assert got["pearson"] == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-9)
    assert got["spearman"] == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)
    assert len(np.unique(x)) < len(x) and 0.3 < got["spearman"] < 0.99


def test_average_ranks_and_undefined_cases():
    a = np.array([3.0, 1.0, 3.0, 2.0, 3.0, -1.0])
    assert average_ranks(a).tolist() == stats.rankdata(a).tolist() == [5.0, 2.0, 5.0, 3.0, 5.0, 1.0]
    assert np.isnan(spearman([1, 1, 1], [1, 2, 3]))                   # a constant series
    assert np.isnan(TaskMetrics(1).result()["pearson"])
    assert np.isnan(TaskMetrics(3).result()["accuracy"])
    m = TaskMetrics(2)
    m.add(np.array([[0.0, 1.0], [2.0, 0.0]]), np.array([-100, -100]))
    assert np.isnan(m.result()["f1"])
