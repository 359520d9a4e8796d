"""The gradient of Gather. Along axis 0 of a 2-D table (an embedding), the looked-up rows' gradients are
a :class:`~.core.Rows` contribution: added with ScatterElements(add) into the table's other gradient
(a tied LM head's) where there is one, so no dense zero table is written and summed; repeated indices
sum. Along another axis (:func:`.selection.gather_along`), or rows of a table of another rank or of a
float16 / bfloat16 table: dy added into zeros by ScatterElements over the table's rows
(:func:`.selection.scatter_nd_add`; onnxruntime's ScatterND loses sums of repeated indices in parallel threads)."""

from .core import Rows, Step, gradient
from .selection import gather_along, half, scatter_nd_add


@gradient("Gather")
def _gather(s: Step):
    table, idx = s.x
    rank = s.emit.rank(table, s.node)
    if s.attr("axis", 0) % rank != 0:
        return gather_along(s)
    dims = s.emit.dims.get(table)
    if rank == 2 and dims and dims[1] is not None and not half(s, table):
        return [Rows(table, idx, s.dy[0], dims[1]), None]
    return [scatter_nd_add(s, table, s.op("Unsqueeze", [idx, s.const([-1])]), s.dy[0], k=1), None]
