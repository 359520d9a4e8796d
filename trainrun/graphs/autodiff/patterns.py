"""Subgraphs differentiated as one, where the chain of their nodes' own gradients makes more passes over
a large tensor than a formula for the whole.

The tanh-GELU written with a Sigmoid (the built-in GPT-2's MLP activation, [tokens, 4 width]):
act = y * s, s = Sigmoid(z), z = y * poly, poly = a + b * y2, y2 = y * y. Node by node its gradient
takes a dozen passes (a Mul's gradient per product, Sigmoid's, a Sum of y's four contributions);
as one, d act / d y = s + y s (1 - s) (a + 3 b y^2), and with y (1 - s) = y - act (the forward's act):
dy = dact * s * (1 + (y - act) * (a + 3 b y2)), seven passes with y2, s and act read from the forward.
Only where y2, b y2, poly, z and s feed nothing else.

Attention's Softmax read by one product, O = Softmax(S) @ V along S's last axis (every built-in and exported
transformer): node by node dS = P (dP - sum(dP P)), the sum over a [.., T, T] product of dP and P; as one,
sum_j dP_ij P_ij = sum_j (sum_d dO_id V_jd) P_ij = sum_d dO_id O_id, a sum over [.., T, head] (FlashAttention's
identity): one pass over the [T, T] scores less, the same value up to float32 reordering.

The erf GELU written out, k y (1 + erf(c y)) (BERT's: u = y c, e = Erf(u), h = (e + 1) k, act = y h; torch's
export: act = (y (e + 1)) k, u = y / sqrt 2): node by node about ten passes (each Mul's two gradients, Erf's
exp(-u^2) in four, a Sum of y's two contributions); as one, d act / d y = k (1 + e) + (2 k / sqrt pi) u
exp(-u^2), with u and (where the forward has it) h = k (1 + e) read from the forward and the constant in the
exponent, exp(ln(2 k / sqrt pi) - u^2): dy = dact * (h + u * Exp(ln(2 k / sqrt pi) - u * u)), six passes (seven
in torch's form, whose k (1 + e) the forward never writes: dact k (e + 1 + u Exp(ln(2 / sqrt pi) - u u))).
Only where u, e, e + 1 and the product between feed nothing else.

SiLU written as act = x * Sigmoid(x) (torch's nn.SiLU exported; EfficientNet's every activation): node by
node dx = dy s + (dy x) s (1 - s), six passes; as one, dx = dy s (1 + x - act), four. Only where s feeds
nothing else."""

import math

from .core import PATTERNS, RULES, Step


def _other(node, name):
    """The input of a two-input ``node`` that is not ``name`` (None if neither or both are)."""
    a, b = node.input
    return b if a == name and b != name else a if b == name and a != name else None


def _gelu(nodes, consumers, emit):
    producer = emit.producer
    found = []

    def made(name, op):
        n = producer.get(name)
        return n if n is not None and n.op_type == op and n.domain in ("", "ai.onnx") and len(n.input) == (
            1 if op == "Sigmoid" else 2) else None

    def scalar(name):
        v = emit.values.get(name)
        return float(v) if v is not None and v.size == 1 else None
    for act in nodes:
        if act.op_type != "Mul" or act.domain not in ("", "ai.onnx") or len(act.input) != 2:
            continue
        for s in act.input:
            sig, y = made(s, "Sigmoid"), _other(act, s)
            zmul = sig and made(sig.input[0], "Mul")
            poly = zmul and y and _other(zmul, y)
            add = poly and made(poly, "Add")
            if not add:
                continue
            a = next((scalar(i) for i in add.input if scalar(i) is not None), None)
            t = a is not None and _other(add, next(i for i in add.input if scalar(i) is not None))
            tmul = t and made(t, "Mul")
            if not tmul:
                continue
            b = next((scalar(i) for i in tmul.input if scalar(i) is not None), None)
            y2 = b is not None and _other(tmul, next(i for i in tmul.input if scalar(i) is not None))
            sq = y2 and made(y2, "Mul")
            if not sq or list(sq.input) != [y, y]:
                continue
            inner = [sq, tmul, add, zmul, sig]
            outputs = {o for n in inner for o in n.output}
            if any(len(consumers.get(o, [])) != 1 for o in outputs) or outputs & emit.graph_outputs:
                continue
            found.append((act, inner, _gelu_rule(y, y2, s, a, b)))
            break
    return found


def _gelu_rule(y, y2, s, a, b):
    def rule(step: Step):
        act = step.y[0]
        slope = step.op("Add", [step.op("Mul", [y2, step.const(3 * b, like=y)]), step.const(a, like=y)])
        inner = step.op("Add", [step.op("Mul", [step.op("Sub", [y, act]), slope]), step.const(1.0, like=y)])
        return {y: step.op("Mul", [step.dy[0], step.op("Mul", [inner, s])])}
    return rule


PATTERNS.append(_gelu)


def _erf_gelu(nodes, consumers, emit):
    producer, found = emit.producer, []

    def plain(n, op):
        return n is not None and n.op_type == op and n.domain in ("", "ai.onnx") and len(n.input) == 2

    def scalar(name):
        v = emit.values.get(name)
        return float(v.reshape(-1)[0]) if v is not None and v.size == 1 and v.ndim == 0 else None

    def only(name):
        """The one node that reads ``name`` (None if several, or it is a graph output)."""
        readers = consumers.get(name, [])
        return readers[0] if len(readers) == 1 and name not in emit.graph_outputs else None

    def times_scalar(n):
        """(the other input, the scalar) of a Mul of a tensor by a scalar constant, else (None, None)."""
        if not plain(n, "Mul"):
            return None, None
        k = next((scalar(i) for i in n.input if scalar(i) is not None), None)
        return (None, None) if k is None else (_other(n, next(i for i in n.input if scalar(i) is not None)), k)
    for erf in nodes:
        if erf.op_type != "Erf" or erf.domain not in ("", "ai.onnx"):
            continue
        u = erf.input[0]
        scale = producer.get(u)
        y, c = times_scalar(scale)
        if y is None and plain(scale, "Div") and scalar(scale.input[1]):
            y, c = scale.input[0], 1.0 / scalar(scale.input[1])
        add = only(erf.output[0])
        if y is None or not c or only(u) is not erf or not plain(add, "Add") \
                or sorted(scalar(i) is not None and scalar(i) == 1.0 for i in add.input) != [False, True]:
            continue
        p = add.output[0]
        mid = only(p)
        x, k = times_scalar(mid)
        if x == p:                                  # h = (e + 1) k, act = y h
            act = only(mid.output[0])
            if plain(act, "Mul") and _other(act, mid.output[0]) == y and k > 0:
                found.append((act, [scale, erf, add, mid], _erf_gelu_rule(y, u, mid.output[0], 2 * k, None)))
        elif plain(mid, "Mul") and _other(mid, p) == y:     # q = y (e + 1), act = q k
            act = only(mid.output[0])
            _, k = times_scalar(act)
            if k is not None:
                found.append((act, [scale, erf, add, mid], _erf_gelu_rule(y, u, p, 2.0, k)))
    return found


def _erf_gelu_rule(y, u, local, lead, k):
    """dy = dact (local + u Exp(ln(lead / sqrt pi) - u^2)), times ``k`` unless None."""
    def rule(step: Step):
        bell = step.op("Exp", [step.op("Sub", [step.const(math.log(lead / math.sqrt(math.pi)), like=y),
                                               step.op("Mul", [u, u])])])
        dy = step.op("Mul", [step.dy[0], step.op("Add", [local, step.op("Mul", [u, bell])])])
        return {y: dy if k is None else step.op("Mul", [dy, step.const(k, like=y)])}
    return rule


PATTERNS.append(_erf_gelu)


def _silu(nodes, consumers, emit):
    found = []
    for act in nodes:
        if act.op_type != "Mul" or act.domain not in ("", "ai.onnx") or len(act.input) != 2:
            continue
        for s in act.input:
            sig = emit.producer.get(s)
            x = _other(act, s)
            if sig is None or sig.op_type != "Sigmoid" or sig.domain not in ("", "ai.onnx") or x is None \
                    or sig.input[0] != x or len(consumers.get(s, [])) != 1 or s in emit.graph_outputs:
                continue
            found.append((act, [sig], _silu_rule(x, s)))
            break
    return found


def _silu_rule(x, s):
    def rule(step: Step):
        slope = step.op("Add", [step.op("Sub", [x, step.y[0]]), step.const(1.0, like=x)])
        return {x: step.op("Mul", [step.op("Mul", [step.dy[0], s]), slope])}
    return rule


PATTERNS.append(_silu)


def _attention(nodes, consumers, emit):
    """Softmax along the last axis whose output P is read only by a MatMul, as its left operand, P of the
    product's batch dims (not broadcast against V's: the identity holds per row of O)."""
    found = []
    if emit.opset < 13:         # Softmax over the flattened trailing axes before opset 13
        return found
    for mm in nodes:
        if mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx") or mm.input[0] == mm.input[1]:
            continue
        sm = emit.producer.get(mm.input[0])
        if sm is None or sm.op_type != "Softmax" or sm.domain not in ("", "ai.onnx") \
                or len(consumers.get(mm.input[0], [])) != 1 or mm.input[0] in emit.graph_outputs:
            continue
        p_dims, v_dims, o_dims = (emit.dims.get(t) for t in (mm.input[0], mm.input[1], mm.output[0]))
        axis = next((a.i for a in sm.attribute if a.name == "axis"), -1)
        if p_dims is None or v_dims is None or o_dims is None or len(p_dims) < max(2, len(v_dims)) \
                or axis % len(p_dims) != len(p_dims) - 1 or p_dims[:-1] != o_dims[:-1]:
            continue
        found.append((mm, [sm], _attention_rule(sm.input[0], mm.input[0], mm.input[1])))
    return found


def _attention_rule(scores, p, v):
    def rule(step: Step):
        d_p, d_v = RULES["MatMul"](step)
        out = {} if d_v is None else {v: d_v}
        if d_p is not None:
            dot = step.op("ReduceSum", [step.op("Mul", [step.dy[0], step.y[0]]), step.const([-1])], keepdims=1)
            out[scores] = step.op("Mul", [p, step.op("Sub", [d_p, dot])])
        return out
    return rule


PATTERNS.append(_attention)
