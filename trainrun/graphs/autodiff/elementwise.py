"""Gradients of elementwise ops; a broadcast input's gradient is summed back to its shape."""

import math

from .core import Step, gradient


def _each(step: Step, grads):
    """Each input's gradient (a callable, run only for inputs that want one) summed to its shape."""
    return [step.sum_to(make(), k) if step.wants(k) and make else None for k, make in enumerate(grads)]


@gradient("Add")
def _add(s: Step):
    return _each(s, [lambda: s.dy[0], lambda: s.dy[0]])


@gradient("Sub")
def _sub(s: Step):
    return _each(s, [lambda: s.dy[0], lambda: s.op("Neg", [s.dy[0]])])


@gradient("Mul")
def _mul(s: Step):
    a, b = s.x
    return _each(s, [lambda: s.op("Mul", [s.dy[0], b]), lambda: s.op("Mul", [s.dy[0], a])])


@gradient("Div")
def _div(s: Step):
    b, y = s.x[1], s.y[0]
    return _each(s, [lambda: s.op("Div", [s.dy[0], b]),
                     lambda: s.op("Neg", [s.op("Mul", [s.dy[0], s.op("Div", [y, b])])])])


@gradient("Pow")
def _pow(s: Step):
    if s.wants(1):
        raise s.unsupported("the exponent depends on a parameter")
    p = s.value(1)
    x = s.x[0]
    slope = s.op("Mul", [s.const(p, like=x), s.op("Pow", [x, s.const(p - 1, like=x)])])
    return _each(s, [lambda: s.op("Mul", [s.dy[0], slope]), None])


def _unary(op_type: str, local):
    """``op_type``'s gradient dy * local(step), local the derivative in terms of x and y."""
    gradient(op_type)(lambda s: [s.op("Mul", [s.dy[0], local(s)])])


_unary("Exp", lambda s: s.y[0])
_unary("Tanh", lambda s: s.op("Sub", [s.const(1.0, like=s.y[0]), s.op("Mul", [s.y[0], s.y[0]])]))
_unary("Sigmoid", lambda s: s.op("Mul", [s.y[0], s.op("Sub", [s.const(1.0, like=s.y[0]), s.y[0]])]))
_unary("Erf", lambda s: s.op("Mul", [s.const(2 / math.sqrt(math.pi), like=s.x[0]),
                                     s.op("Exp", [s.op("Neg", [s.op("Mul", [s.x[0], s.x[0]])])])]))


@gradient("Log")
def _log(s: Step):
    return [s.op("Div", [s.dy[0], s.x[0]])]


@gradient("Sqrt")
def _sqrt(s: Step):
    return [s.op("Div", [s.op("Mul", [s.dy[0], s.const(0.5, like=s.y[0])]), s.y[0]])]


@gradient("Neg")
def _neg(s: Step):
    return [s.op("Neg", [s.dy[0]])]


@gradient("Relu")
def _relu(s: Step):
    zero = s.const(0.0, like=s.x[0])
    return [s.op("Where", [s.op("Greater", [s.x[0], zero]), s.dy[0], zero])]


@gradient("Where")
def _where(s: Step):
    cond, zero = s.x[0], s.const(0.0, like=s.dy[0])
    return _each(s, [None, lambda: s.op("Where", [cond, s.dy[0], zero]),
                     lambda: s.op("Where", [cond, zero, s.dy[0]])])


@gradient("Cast")
def _cast(s: Step):
    return [s.op("CastLike", [s.dy[0], s.x[0]])]


@gradient("Identity")
def _identity(s: Step):
    return [s.dy[0]]
