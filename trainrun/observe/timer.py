"""Wall time per phase of the step: data, forward_backward, allreduce, norm, optimizer, log, ..."""

from __future__ import annotations

import os
import time


class PhaseTimer:
    """``mark(phase)`` charges the time since the previous mark to ``phase``.

    While recording (:meth:`record_spans`, the profiler's window) each mark
    also keeps its (phase, start, end) span on the perf_counter clock."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self.last_mark = time.perf_counter()     # where the next phase starts
        self._spans: list | None = None

    def restart(self) -> None:
        """Forget the totals; the next phase starts now."""
        self.total.clear()
        self.last_mark = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.total[phase] = self.total.get(phase, 0.0) + now - self.last_mark
        if self._spans is not None:
            self._spans.append((phase, self.last_mark, now))
        self.last_mark = now

    def record_spans(self) -> None:
        self._spans = []

    def take_spans(self) -> list[tuple[str, float, float]]:
        """The spans recorded since :meth:`record_spans`; recording stops."""
        spans, self._spans = self._spans or [], None
        return spans

    def shares(self) -> dict[str, float]:
        s = sum(self.total.values()) or 1.0
        return {k: v / s for k, v in self.total.items()}


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start time against the boot clock, to
    the kernel's tick), counting the interpreter's start and every import; None where that is not known."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")     # field 22: starttime, in ticks after boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
