"""The gradient of Gather along axis 0 (an embedding table): rows added up by ScatterND, so repeated
indices sum."""

from .core import Step, gradient


@gradient("Gather")
def _gather(s: Step):
    if s.attr("axis", 0) != 0:
        raise s.unsupported("only axis 0 (rows of a table) is covered")
    table, idx = s.x
    rows = s.op("Unsqueeze", [idx, s.const([-1])])
    return [s.op("ScatterND", [s.emit.zeros_like(table, s.base), rows, s.dy[0]], reduction="add"), None]
