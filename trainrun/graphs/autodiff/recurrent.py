"""LSTM, GRU and RNN, differentiated by writing them out before the walk: with the sequence length known
when the graph is built, each node becomes per-timestep standard ops (the inputs' projections of every
step in one MatMul, then per step the recurrent MatMul, Split into gates, Sigmoid / Tanh / Relu, Mul, Add)
whose own rules give backpropagation through time. The rewritten forward computes what the op computes
(ONNX's equations, gates i o f c for LSTM, z r h for GRU); its outputs keep their names. Its nodes are few per
step, as each costs onnxruntime a dispatch that outweighs a small cell's arithmetic: the steps' slices of the
projections are rows of one [T * B, gates * H] matrix and the outputs one [T * B, H] (no Squeeze in nor
Unsqueeze out per step, nor their gradients; the states stay [B, H], so no product's gradient reshapes), and
an LSTM without peepholes takes its three gates' activation in one node over 3 x hidden. Every direction
(forward, reverse, bidirectional), layout 0 and 1, bias, initial_h / initial_c, LSTM's peepholes, GRU's
linear_before_reset 0 and 1, the activations Sigmoid, Tanh and Relu. Refused by name: a sequence length
unknown when the graph is built, sequence_lens other than all full, clip, LSTM's input_forget, other
activations.

An LSTM that onnxruntime's kernel computes (layout 0, float32, no peepholes, the default activations: what
torch exports) is not written out: it stays one node, forward by the kernel, and :func:`_lstm` differentiates
it (8 nodes a step in all, against ~38 written out: torch's fused oneDNN cell's speed at batch 32, 32 steps).
Every other case (float64, layout 1, peepholes, other activations) is written out."""

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .core import EXPANSIONS, Step, gradient

ACTIVATIONS = {"sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "Relu"}
DEFAULTS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def _input(s: Step, i: int):
    return s.x[i] if len(s.x) > i and s.x[i] else None


class _Cell:
    """One node's settings, checked: what the rewrite needs of it."""

    def __init__(self, s: Step):
        op = s.node.op_type
        if s.attr("clip") is not None:
            raise s.unsupported("clip is set (the rewrite covers unclipped cells)")
        if op == "LSTM" and s.attr("input_forget", 0):
            raise s.unsupported("input_forget is 1")
        self.layout = s.attr("layout", 0)
        direction = _text(s.attr("direction", "forward"))
        self.directions = ["forward", "reverse"] if direction == "bidirectional" else [direction]
        xdims = s.emit.dims.get(s.x[0])
        steps = xdims[self.layout] if xdims is not None and len(xdims) == 3 else None
        if steps is None:
            raise s.unsupported("the sequence length is not known when the graph is built (the rewrite into "
                                "per-timestep ops needs it: engine.static_shapes)")
        self.steps = steps
        lens = _input(s, 4)
        if lens is not None:
            if lens not in s.emit.values or (s.emit.values[lens] != steps).any():
                raise s.unsupported("sequence_lens is given and not known to be the full length of every sequence")
        per = len(DEFAULTS[op])
        names = [_text(a) for a in s.attr("activations", [])] or DEFAULTS[op] * len(self.directions)
        if len(names) != per * len(self.directions):
            raise s.unsupported(f"{len(names)} activations for {len(self.directions)} direction(s)")
        unknown = [a for a in names if a.lower() not in ACTIVATIONS]
        if unknown:
            raise s.unsupported(f"activation {unknown[0]} (Sigmoid, Tanh and Relu are covered)")
        self.activations = [[ACTIVATIONS[a.lower()] for a in names[d * per:(d + 1) * per]]
                            for d in range(len(self.directions))]
        rdims = s.emit.dims.get(s.x[2])
        self.hidden = s.attr("hidden_size") or (rdims[-1] if rdims and rdims[-1] else None)
        if not self.hidden:
            raise s.unsupported("hidden_size is neither set nor known from R's dims")


def _split(s: Step, name: str, count: int, axis: int):
    """``name`` in ``count`` equal parts along ``axis`` (opset 18 on: num_outputs says how many)."""
    return s.op("Split", [name], outputs=count, axis=axis, **({"num_outputs": count} if s.emit.opset >= 18 else {}))


def _per_direction(s: Step, name, count: int, layout_first: bool):
    """Input ``name`` ([D, ...]; [B, D, ...] where ``layout_first`` is False, i.e. layout 1's initial
    states) as one tensor per direction, the direction axis dropped."""
    if name is None:
        return [None] * count
    axis = 0 if layout_first else 1
    parts = [name] if count == 1 else _split(s, name, count, axis)
    return [s.op("Squeeze", [p, s.const([axis])]) for p in parts]


def _zeros(s: Step, x: str, hidden: int) -> str:
    """[B, hidden] zeros of the node's input type (``x``: its input, [T, B, I])."""
    batch = s.op("Shape", [x], start=1, end=2)
    zero = numpy_helper.from_array(np.zeros(1, helper.tensor_dtype_to_np_dtype(s.emit.elem_type(s.x[0], s.x[1]))))
    return s.op("ConstantOfShape", [s.op("Concat", [batch, s.const([hidden])], axis=0)], value=zero)


def _rows(s: Step, name: str, steps: int):
    """[T * B, .] ``name`` as T tensors of [B, .]."""
    return [name] if steps == 1 else _split(s, name, steps, 0)


def _fused(s: Step, cell: _Cell) -> bool:
    """Whether the node stays one node, differentiated by :func:`_lstm`: an LSTM of layout 0 (onnxruntime's
    kernel has no layout 1), float32 (its CPU kernel's only type), no peepholes, the default activations."""
    return (s.node.op_type == "LSTM" and cell.layout == 0 and _input(s, 7) is None
            and s.emit.elem_type(s.x[0], s.x[1]) == onnx.TensorProto.FLOAT
            and cell.activations == [DEFAULTS["LSTM"]] * len(cell.directions))


def _rewrite(s: Step):
    op = s.node.op_type
    cell = _Cell(s)
    if _fused(s, cell):
        s.emit.nodes.append(s.node)
        return
    hidden, gates, count = cell.hidden, GATES[op], len(cell.directions)
    x = s.x[0] if cell.layout == 0 else s.op("Transpose", [s.x[0]], perm=[1, 0, 2])     # [T, B, I]
    ws, rs = _per_direction(s, s.x[1], count, True), _per_direction(s, s.x[2], count, True)
    bs = _per_direction(s, _input(s, 3), count, True)
    h0s = _per_direction(s, _input(s, 5), count, cell.layout == 0)
    c0s = _per_direction(s, _input(s, 6), count, cell.layout == 0) if op == "LSTM" else [None] * count
    ps = _per_direction(s, _input(s, 7), count, True) if op == "LSTM" else [None] * count
    zeros = None
    ys, hs, cs = [], [], []
    for d, direction in enumerate(cell.directions):
        if h0s[d] is None or (op == "LSTM" and c0s[d] is None):
            zeros = zeros or _zeros(s, x, hidden)
        h = h0s[d] if h0s[d] is not None else zeros
        c = c0s[d] if c0s[d] is not None else zeros
        projected = s.op("MatMul", [x, s.op("Transpose", [ws[d]], perm=[1, 0])])      # [T, B, gates * H]
        rt = s.op("Transpose", [rs[d]], perm=[1, 0])                                   # [H, gates * H]
        wb = rb = None
        if bs[d] is not None:
            wb, rb = _split(s, bs[d], 2, 0)
            projected = s.op("Add", [projected, wb if op == "GRU" else s.op("Add", [wb, rb])])
        projected = s.op("Reshape", [projected, s.const([-1, gates * hidden])])       # [T * B, gates * H]
        steps = _rows(s, projected, cell.steps)                                         # [B, gates * H] each
        f, g, act = (cell.activations[d] + [None, None])[:3]
        if op == "GRU":
            rt_zr, rt_h = s.op("Split", [rt, s.const([2 * hidden, hidden])], outputs=2, axis=1)      # [H, .]
            rb_zr, rb_h = (None, None) if rb is None else s.op("Split", [rb, s.const([2 * hidden, hidden])],
                                                               outputs=2, axis=0)
        peep = _split(s, ps[d], 3, 0) if ps[d] is not None else None
        out = [None] * cell.steps
        for t in (range(cell.steps) if direction == "forward" else reversed(range(cell.steps))):
            if op == "RNN":
                h = s.op(f, [s.op("Add", [steps[t], s.op("MatMul", [h, rt])])])
            elif op == "LSTM" and peep is None:        # i, o and f's activation in one node
                ifo, cc = s.op("Split", [s.op("Add", [steps[t], s.op("MatMul", [h, rt])]),
                                         s.const([3 * hidden, hidden])], outputs=2, axis=1)
                i, o, fg = _split(s, s.op(f, [ifo]), 3, 1)
                c = s.op("Add", [s.op("Mul", [fg, c]), s.op("Mul", [i, s.op(g, [cc])])])
                h = s.op("Mul", [o, s.op(act, [c])])
            elif op == "LSTM":
                i, o, fg, cc = _split(s, s.op("Add", [steps[t], s.op("MatMul", [h, rt])]), 4, 1)
                if peep is not None:
                    i, fg = s.op("Add", [i, s.op("Mul", [peep[0], c])]), s.op("Add", [fg, s.op("Mul", [peep[2], c])])
                c = s.op("Add", [s.op("Mul", [s.op(f, [fg]), c]), s.op("Mul", [s.op(f, [i]), s.op(g, [cc])])])
                if peep is not None:
                    o = s.op("Add", [o, s.op("Mul", [peep[1], c])])
                h = s.op("Mul", [s.op(f, [o]), s.op(act, [c])])
            else:
                x_zr, x_h = s.op("Split", [steps[t], s.const([2 * hidden, hidden])], outputs=2, axis=1)
                zr = s.op("Add", [x_zr, s.op("MatMul", [h, rt_zr])])
                z, r = _split(s, s.op(f, [zr if rb_zr is None else s.op("Add", [zr, rb_zr])]), 2, 1)
                if s.attr("linear_before_reset", 0):
                    rec = s.op("MatMul", [h, rt_h])
                    rec = s.op("Mul", [r, rec if rb_h is None else s.op("Add", [rec, rb_h])])
                else:
                    rec = s.op("MatMul", [s.op("Mul", [r, h]), rt_h])
                    rec = rec if rb_h is None else s.op("Add", [rec, rb_h])
                candidate = s.op(g, [s.op("Add", [x_h, rec])])
                h = s.op("Add", [candidate, s.op("Mul", [z, s.op("Sub", [h, candidate])])])
            out[t] = h
        y = out[0] if cell.steps == 1 else s.op("Concat", out, axis=0)                  # [T * B, H]
        y = s.op("Reshape", [y, s.const([cell.steps, -1, hidden])])                     # [T, B, H]
        ys.append(y if cell.layout == 0 else s.op("Transpose", [y], perm=[1, 0, 2]))
        hs.append(h)
        cs.append(c)
    # Y [T, D, B, H] (layout 1: [B, T, D, H]), Y_h and Y_c [D, B, H] ([B, D, H])
    if cell.layout == 0:
        results = [(ys, 1), (hs, 0), (cs, 0)]
    else:
        results = [(ys, 2), (hs, 1), (cs, 1)]
    for k, (parts, axis) in enumerate(results[:len(s.y)]):
        if not s.y[k]:
            continue
        joined = s.op("Concat", [s.op("Unsqueeze", [p, s.const([axis])]) for p in parts], axis=axis)
        s.emit.nodes.append(helper.make_node("Identity", [joined], [s.y[k]], name=s.emit.name(f"{s.base}/{s.y[k]}")))


for _op in GATES:
    EXPANSIONS[_op] = _rewrite



@gradient("LSTM")
def _lstm(s: Step):
    """An LSTM left whole by :func:`_rewrite` (:func:`_fused`: its forward is onnxruntime's kernel, one node).
    Its outputs Y (every h_t) give the gates of all steps at once: one product of X and one of the previous
    states [h0; h_0 .. h_T-2] (reversed for reverse), their activations over every step in one node each; the
    cell states c_t are the one recurrence left forward (a Mul and an Add a step). Backward, per step: dh_t
    = dY_t + dgates_t+1 R (one Gemm), dc_t = dh_t o_t tanh'(c_t) + dc_t+1 f_t+1, dgates_t = [dc, dh, dc, dc]
    times the gates' derivatives (computed for every step at once): six nodes a step. dX, dW, dR and dB are
    one product (or sum) each over every step."""
    cell = _Cell(s)
    if not _fused(s, cell):             # written out before the walk (_rewrite): not met here
        raise s.unsupported("the node was to be written out in per-timestep ops")
    hidden, steps, count = cell.hidden, cell.steps, len(cell.directions)
    x = s.x[0]
    y = s.emit.output(s.node, 0)                                                    # [T, D, B, H]
    x2 = s.op("Flatten", [x], axis=2)                                              # [T * B, I]
    ws, rs = _per_direction(s, s.x[1], count, True), _per_direction(s, s.x[2], count, True)
    bs = _per_direction(s, _input(s, 3), count, True)
    h0s = _per_direction(s, _input(s, 5), count, True)
    c0s = _per_direction(s, _input(s, 6), count, True)
    yds = _per_direction(s, y, count, False)                                        # [T, B, H] each
    dy, dyh, dyc = (list(s.dy) + [None] * 3)[:3]
    dys = _per_direction(s, dy, count, False)
    dyhs, dycs = _per_direction(s, dyh, count, True), _per_direction(s, dyc, count, True)
    zeros = None
    dx, dw, dr, db, dh0, dc0 = [], [], [], [], [], []
    for d, direction in enumerate(cell.directions):
        if h0s[d] is None or c0s[d] is None:
            zeros = zeros or _zeros(s, x, hidden)
        h0 = h0s[d] if h0s[d] is not None else zeros
        c = c0s[d] if c0s[d] is not None else zeros
        # the state each step reads, [T * B, H]: h_-1 = h0, then h_0 .. h_T-2 (reverse: h_1 .. h_T-1, then h0)
        first = s.op("Unsqueeze", [h0, s.const([0])])
        if steps == 1:
            hprev = first
        elif direction == "forward":
            hprev = s.op("Concat", [first, s.op("Slice", [yds[d], s.const([0]), s.const([steps - 1]),
                                                          s.const([0])])], axis=0)
        else:
            hprev = s.op("Concat", [s.op("Slice", [yds[d], s.const([1]), s.const([steps]), s.const([0])]), first],
                         axis=0)
        hprev = s.op("Flatten", [hprev], axis=2)
        bias = None
        if bs[d] is not None:
            wb, rb = _split(s, bs[d], 2, 0)
            bias = s.op("Add", [wb, rb])
        gates = s.op("Gemm", [x2, ws[d]] + ([bias] if bias else []), transB=1)
        gates = s.op("Gemm", [hprev, rs[d], gates], transB=1)                      # [T * B, 4H]: i o f c
        ifo, cc = s.op("Split", [gates, s.const([3 * hidden, hidden])], outputs=2, axis=1)
        ifo, cc = s.op("Sigmoid", [ifo]), s.op("Tanh", [cc])
        i, o, f = _split(s, ifo, 3, 1)
        fs, us = _rows(s, f, steps), _rows(s, s.op("Mul", [i, cc]), steps)
        order = list(range(steps)) if direction == "forward" else list(reversed(range(steps)))
        cs, cprev = [None] * steps, [None] * steps
        for t in order:
            cprev[t] = c
            c = s.op("Add", [s.op("Mul", [fs[t], c]), us[t]])
            cs[t] = c
        join = (lambda parts: parts[0] if steps == 1 else s.op("Concat", parts, axis=0))
        tc = s.op("Tanh", [join(cs)])                                                # [T * B, H]
        one = s.const(1.0, like=x)
        # the derivatives of the gates' pre-activations by dc (i, f, c) and by dh (o), every step
        dact = s.op("Mul", [ifo, s.op("Sub", [one, ifo])])
        m_ifo = s.op("Mul", [dact, s.op("Concat", [cc, tc, join(cprev)], axis=1)])
        m_c = s.op("Mul", [i, s.op("Sub", [one, s.op("Mul", [cc, cc])])])
        ms = _rows(s, s.op("Concat", [m_ifo, m_c], axis=1), steps)
        ks = _rows(s, s.op("Mul", [o, s.op("Sub", [one, s.op("Mul", [tc, tc])])]), steps)    # o_t tanh'(c_t)
        dyt = _rows(s, s.op("Flatten", [dys[d]], axis=2), steps) if dys[d] is not None else [None] * steps
        dgs = [None] * steps
        dg, carry = None, dycs[d]
        for n, t in enumerate(reversed(order)):
            dh = dyt[t]
            if n == 0 and dyhs[d] is not None:
                dh = dyhs[d] if dh is None else s.op("Add", [dh, dyhs[d]])
            if dg is not None:
                dh = s.op("Gemm", [dg, rs[d]] + ([dh] if dh is not None else []))
            if dh is None:                  # the loss reads Y_c alone: no dh at the last step
                dh = s.emit.zeros_like(carry, s.base)
            dc = s.op("Mul", [dh, ks[t]])
            dc = dc if carry is None else s.op("Add", [dc, carry])
            dg = dgs[t] = s.op("Mul", [s.op("Concat", [dc, dh, dc, dc], axis=1), ms[t]])
            carry = s.op("Mul", [dc, fs[t]])
        dgates = join(dgs)                                                          # [T * B, 4H]
        if s.wants(0):
            dx.append(s.op("MatMul", [dgates, ws[d]]))
        if s.wants(1):
            dw.append(s.op("Gemm", [dgates, x2], transA=1))
        if s.wants(2):
            dr.append(s.op("Gemm", [dgates, hprev], transA=1))
        if s.wants(3):
            summed = s.reduce("ReduceSum", dgates, [0], keepdims=0)
            db.append(s.op("Concat", [summed, summed], axis=0))
        if s.wants(5):
            dh0.append(s.op("MatMul", [dg, rs[d]]))
        if s.wants(6):
            dc0.append(carry)

    def stacked(parts):
        parts = [s.op("Unsqueeze", [p, s.const([0])]) for p in parts]
        return parts[0] if count == 1 else s.op("Concat", parts, axis=0)
    grads = [None] * len(s.x)
    if dx:
        grads[0] = s.op("Reshape", [dx[0] if count == 1 else s.op("Add", dx), s.op("Shape", [x])])
    for j, parts in ((1, dw), (2, dr), (3, db), (5, dh0), (6, dc0)):
        if parts:
            grads[j] = stacked(parts)
    return grads
