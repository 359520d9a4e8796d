"""What a run does once its last checkpoint is committed (rank 0): model.onnx exported from it, unless a
stop signal abandons the export, and summary.json written with the closing line."""

from __future__ import annotations

import json
import os

from ..errors import collective
from ..commands.export import export_checkpoint
from ..observe.metrics import fmt_duration
from .rundir import COMMITTED
from .stopping import Abandon, StopSignals, Stopped


def model_is_current(model: str, ckpt: str) -> bool:
    """``model`` (model.onnx) exists and was written after ``ckpt`` was committed."""
    try:
        return os.stat(model).st_mtime_ns >= os.stat(os.path.join(ckpt, COMMITTED)).st_mtime_ns
    except FileNotFoundError:
        return False


def export_model(ckpt: str, out: str, signals: StopSignals, agreed: int, hint: str, log) -> Stopped | None:
    """<out>/model.onnx from ``ckpt``. A stop signal (one noted since the ``agreed`` stops, or one during
    the export) abandons it, leaving nothing half-written nor a model whose check did not finish: the
    :class:`Stopped` to raise (``hint``: how to finish the run), or None."""
    model = os.path.join(out, "model.onnx")
    try:
        with signals.abandoning():
            if signals.noted() > agreed:      # came since the last agreement
                raise Abandon(signals.latest)
            export_checkpoint(ckpt, model, echo=log)
    except Abandon as exc:
        if model_is_current(model, ckpt):      # written, its check against the eval graph cut short
            for path in (model, model + ".data"):
                if os.path.exists(path):
                    os.remove(path)
        return collective(Stopped(
            f"stopped by {exc.received} during the export of {model}: export abandoned, checkpoint {ckpt} "
            f"committed. {hint}", by=exc.received))
    return None


def write_summary(out: str, summary: dict, tokens: bool, log) -> None:
    """<out>/summary.json; the closing line where the session finished (``summary["stopped"]`` None):
    steps, throughput (in tokens where ``tokens``), the final losses and the share of each phase."""
    with open(os.path.join(out, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    if summary["stopped"] is not None:
        return
    s = summary
    shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(s["phase_shares"].items(), key=lambda kv: -kv[1]))
    final_eval = f", eval loss {s['final_eval_loss']:.4f}" if s["final_eval_loss"] is not None else ""
    final = f"; final loss {s['final_loss']:.4f}" if s["final_loss"] is not None else ""
    unit = "tokens" if tokens else "samples"
    log(f"done: {s['steps']} steps, {s[unit]:,} {unit} in {fmt_duration(s['time_s'])} "
        f"({s[unit + '_per_sec']:,.{0 if tokens else 1}f} {unit}/s){final}{final_eval}; "
        f"time: {shares}"
        + (f"; start-up {s['startup_s']:.1f} s, after the last step {s['end_s']:.1f} s"
           if s["startup_s"] is not None else ""))
