"""The gradient of Gather along axis 0 (an embedding table): rows added up by ScatterND, so repeated
indices sum."""

from .core import Step, gradient
from .selection import gather_along


@gradient("Gather")
def _gather(s: Step):
    if s.attr("axis", 0) != 0:
        return gather_along(s)
    table, idx = s.x
    rows = s.op("Unsqueeze", [idx, s.const([-1])])
    return [s.op("ScatterND", [s.emit.zeros_like(table, s.base), rows, s.dy[0]], reduction="add"), None]
