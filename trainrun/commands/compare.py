"""``trainrun compare RUN_A RUN_B``: where two runs' statistics part ways.

Both sides are read with :func:`trainrun.observe.stats.find_ranks` (a run directory,
its ``stats/`` directory, or one ``rank-<r>`` directory) and matched rank by
rank (rank 0 with rank 0, ...; ``--rank`` picks some; two single rank
directories are compared with each other whatever their ranks). For every
step both hold and every tensor (or scalar) both hold, each statistic is
compared: the relative difference of ``a`` and ``b`` is

    |a - b| / max(|a|, |b|, rms)

where ``rms = norm / sqrt(count)`` of the tensor (for min, max, mean and std:
a mean near zero is measured against the size of the tensor's values, not
against itself); for ``norm`` and scalars ``rms`` is left out. A statistic is
beyond tolerance when ``|a - b| > atol + rtol * max(|a|, |b|, rms)``; differing
NaN/Inf/element counts always are.

The report names the first step where anything is beyond tolerance and, in
that step, the first tensor in record order (scalars, then activations in
graph order, gradients, parameters), then the worst ones, then a per-step
summary. Exit status: 0 within tolerance, 1 diverged (as ``diff``), 2 usage.
"""

from __future__ import annotations

import fnmatch
import math
import os

from ..errors import UsageError
from ..observe.stats import COUNTS, STATS, find_ranks, read_rank


def _rms(rec: dict) -> float:
    n = rec["numel"] - rec["nan"] - rec["inf"]
    return rec["norm"] / math.sqrt(n) if n > 0 and rec.get("norm") is not None else 0.0


def tensor_diff(a: dict, b: dict, rtol: float, atol: float) -> tuple[float, str, bool]:
    """(worst relative difference, its statistic, beyond tolerance) of two tensor records."""
    for key in ("numel",) + COUNTS:
        if a.get(key) != b.get(key):
            return math.inf, key, True
    worst, worst_stat, beyond = 0.0, "", False
    rms = max(_rms(a), _rms(b))
    for stat in STATS:
        x, y = a.get(stat), b.get(stat)
        if x is None or y is None:
            if x is not y:
                return math.inf, stat, True
            continue
        scale = max(abs(x), abs(y), rms if stat != "norm" else 0.0)
        d = abs(x - y)
        rel = d / scale if scale > 0 else (0.0 if d == 0 else math.inf)
        if rel > worst:
            worst, worst_stat = rel, stat
        if d > atol + rtol * scale:
            beyond = True
    return worst, worst_stat, beyond


def scalar_diff(x: float, y: float, rtol: float, atol: float) -> tuple[float, str, bool]:
    if x == y:
        return 0.0, "value", False
    d = abs(x - y)
    if math.isnan(d):
        same = math.isnan(x) and math.isnan(y)
        return (0.0 if same else math.inf), "value", not same
    scale = max(abs(x), abs(y))
    rel = d / scale if scale > 0 else (0.0 if d == 0 else math.inf)
    return rel, "value", d > atol + rtol * scale


def _entries(rec: dict) -> dict[str, tuple[str, object]]:
    out = {f"scalar/{k}": ("scalar", v) for k, v in rec.get("scalars", {}).items()}
    out.update({k: ("tensor", v) for k, v in rec.get("tensors", {}).items()})
    return out


def _pairs(path_a: str, path_b: str, ranks: list[int] | None) -> list[tuple[int, str, int, str]]:
    ra, rb = find_ranks(path_a), find_ranks(path_b)
    if len(ra) == 1 and len(rb) == 1 and _is_rank_dir(path_a) and _is_rank_dir(path_b):
        (a, da), (b, db) = next(iter(ra.items())), next(iter(rb.items()))
        return [(a, da, b, db)]
    common = sorted(set(ra) & set(rb))
    if ranks:
        missing = [r for r in ranks if r not in common]
        if missing:
            raise UsageError(f"--rank {missing[0]}: not in both runs (ranks of A: {sorted(ra)}, B: {sorted(rb)})")
        common = sorted(ranks)
    if not common:
        raise UsageError(f"no rank in common (A: {sorted(ra)}, B: {sorted(rb)}); name two rank directories "
                         f"to compare across ranks")
    return [(r, ra[r], r, rb[r]) for r in common]


def _is_rank_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "stats.jsonl"))


def compare(path_a: str, path_b: str, rtol: float = 1e-4, atol: float = 0.0, ranks: list[int] | None = None,
            patterns: list[str] | None = None, max_rows: int = 40, top: int = 5) -> tuple[str, bool]:
    """The report, and whether the runs diverged beyond tolerance."""
    pairs = _pairs(path_a, path_b, ranks)
    per_step: dict[int, dict] = {}
    first = None          # (step, pair index, name, rel, stat, a, b)
    first_step_rows = []
    only_a, only_b, n_names = set(), set(), set()
    for pi, (rka, da, rkb, db) in enumerate(pairs):
        A, B = read_rank(da), read_rank(db)
        for step in sorted(set(A) & set(B)):
            ea, eb = _entries(A[step]), _entries(B[step])
            names = [n for n in ea if n in eb and (not patterns or any(fnmatch.fnmatchcase(n, p) for p in patterns))]
            only_a |= set(ea) - set(eb)
            only_b |= set(eb) - set(ea)
            n_names |= set(names)
            row = per_step.setdefault(step, {"compared": 0, "beyond": 0, "rel": 0.0, "worst": "-",
                                             "loss_a": None, "loss_b": None})
            la, lb = A[step].get("scalars", {}).get("loss"), B[step].get("scalars", {}).get("loss")
            if row["loss_a"] is None:
                row["loss_a"], row["loss_b"] = la, lb
            for name in names:
                (kind, a), (_, b) = ea[name], eb[name]
                if kind == "scalar":
                    rel, stat, beyond = scalar_diff(float(a), float(b), rtol, atol)
                else:
                    rel, stat, beyond = tensor_diff(a, b, rtol, atol)
                row["compared"] += 1
                if rel > row["rel"]:
                    row["rel"], row["worst"] = rel, f"{name} ({stat})" + (f" rank {rka}" if len(pairs) > 1 else "")
                if beyond:
                    row["beyond"] += 1
                    va = a if kind == "scalar" else a.get(stat)
                    vb = b if kind == "scalar" else b.get(stat)
                    item = (step, pi, name, rel, stat, va, vb)
                    if first is None or step < first[0]:
                        first = item
                        first_step_rows = [item]
                    elif step == first[0]:
                        first_step_rows.append(item)
    if not per_step:
        raise UsageError(f"{path_a} and {path_b} have no step in common")
    if not n_names:
        raise UsageError("no tensor in common" + (f" matching {', '.join(patterns)}" if patterns else ""))

    def where(pi):
        rka, _, rkb, _ = pairs[pi]
        return "" if len(pairs) == 1 else (f" rank {rka}" if rka == rkb else f" rank {rka} vs {rkb}")

    rank_text = ", ".join(f"{a} vs {b}" for a, _, b, _ in pairs)
    steps = sorted(per_step)
    lines = [f"A: {os.path.abspath(path_a)}", f"B: {os.path.abspath(path_b)}",
             f"rank(s) {rank_text}; {len(steps)} common step(s) ({steps[0]}..{steps[-1]}); "
             f"{len(n_names)} common tensors/scalars; rtol {rtol:g}, atol {atol:g}"]
    if only_a or only_b:
        lines.append(f"not compared: {len(only_a)} only in A, {len(only_b)} only in B"
                     + (f" (e.g. {sorted(only_a or only_b)[0]})" if only_a or only_b else ""))
    lines.append("")
    if first is None:
        lines.append("no divergence: every statistic within tolerance at every common step")
    else:
        step, pi, name, rel, stat, va, vb = first
        lines.append(f"first divergence: step {step}{where(pi)}, {name}: {stat} {_fmt(va)} vs {_fmt(vb)} "
                     f"(relative difference {rel:.3g})")
        merged: dict[tuple, list] = {}      # the same difference on several ranks: one line
        for _, pi2, n2, rel2, st2, a2, b2 in sorted(first_step_rows, key=lambda r: -r[3]):
            merged.setdefault((n2, st2, a2, b2, rel2), []).append(pairs[pi2][0])
        lines.append(f"  {len(first_step_rows)} beyond tolerance at step {step}; the largest:")
        worst = list(merged.items())[:top]
        w = max(len(key[0]) for key, _ in worst)
        for (n2, st2, a2, b2, rel2), rks in worst:
            on = "" if len(pairs) == 1 else f"  rank{'s' if len(rks) > 1 else ''} {','.join(map(str, rks))}"
            lines.append(f"    {n2:<{w}}  {st2:<5} {_fmt(a2):>12} vs {_fmt(b2):>12}  rel {rel2:.3g}{on}")
    lines.append("")
    lines.append("per step (largest relative difference over tensors and statistics):")
    lines.append(f"  {'step':>6} {'beyond':>7} {'of':>5}  {'max rel':>9}  {'loss A':>9} {'loss B':>9}  worst")
    for step in _rows(steps, first[0] if first else None, max_rows):
        if step is None:
            lines.append(f"  {'...':>6}")
            continue
        r = per_step[step]
        lines.append(f"  {step:>6} {r['beyond']:>7} {r['compared']:>5}  {r['rel']:>9.2e}  {_fmt(r['loss_a']):>9} "
                     f"{_fmt(r['loss_b']):>9}  {r['worst'] if r['rel'] > 0 else '-'}")
    return "\n".join(lines), first is not None


def _rows(steps: list[int], focus: int | None, max_rows: int) -> list[int | None]:
    """All steps, or (when there are more than ``max_rows``) at most ``max_rows`` rows, counting
    the None that marks each run of left-out steps: the steps around ``focus``, the last one,
    the first ones, then evenly spaced others, as many as fit."""
    if len(steps) <= max_rows:
        return steps
    n = len(steps)
    wanted = [n - 1]
    if focus is not None:
        i = steps.index(focus)
        wanted += range(max(0, i - 2), min(n, i + 3))
    wanted += range(min(3, n))
    wanted += range(0, n, max(1, n // max_rows))

    def rows(keep):
        out = []
        for i in sorted(keep):
            if out and i != prev + 1:
                out.append(None)
            out.append(steps[i])
            prev = i
        return out

    keep: set[int] = set()
    for i in wanted:
        if i not in keep and len(rows(keep | {i})) <= max_rows:
            keep.add(i)
    return rows(keep)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
