"""Gradients of elementwise ops; a broadcast input's gradient is summed back to its shape."""

import math

import numpy as np

from onnx import TensorProto

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
    e = np.asarray(p, np.float64) - 1
    # a whole exponent below 3 (an RMSNorm's square, GELU's cube) by products: onnxruntime's Pow is a
    # scalar loop, several times a Mul's time
    powers = {0: None, 1: x, 2: s.op("Mul", [x, x])} if e.size == 1 and float(e.flat[0]) in (0, 1, 2) else {}
    power = powers[int(e.flat[0])] if powers else s.op("Pow", [x, s.const(p - 1, like=x)])
    slope = s.const(p, like=x) if power is None else s.op("Mul", [s.const(p, like=x), power])
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
    """dy where the output is positive (as where the input is): read off the output, so the input is the
    forward's alone and onnxruntime fuses the Conv before a Relu with it. In float32 and float64 dy times
    the mask Ceil(Min(y, 1)), exactly 1 where y > 0 (a denormal too) and 0 where y = 0: three vectorised
    kernels, 1.3-2x faster on onnxruntime's CPU than its Greater and Where; in other types Where."""
    if s.emit.types.get(s.x[0]) in (TensorProto.FLOAT, TensorProto.DOUBLE):
        mask = s.op("Ceil", [s.op("Min", [s.y[0], s.const(1.0, like=s.x[0])])])
        return [s.op("Mul", [s.dy[0], mask])]
    zero = s.const(0.0, like=s.x[0])
    return [s.op("Where", [s.op("Greater", [s.y[0], zero]), s.dy[0], zero])]


@gradient("Where")
def _where(s: Step):
    cond, zero = s.x[0], s.const(0.0, like=s.dy[0])
    return _each(s, [None, lambda: s.op("Where", [cond, s.dy[0], zero]),
                     lambda: s.op("Where", [cond, zero, s.dy[0]])])


@gradient("Cast")
def _cast(s: Step):
    return [s.op("CastLike", [s.dy[0], s.x[0]])]


@gradient("CastLike")
def _cast_like(s: Step):
    """x cast to the type of the second input (torch's dynamo exporter writes it around a constant): the
    gradient to x cast back; the second input gives only its type."""
    return [s.op("CastLike", [s.dy[0], s.x[0]]), None]


@gradient("Identity")
def _identity(s: Step):
    return [s.dy[0]]


@gradient("Abs")
def _abs(s: Step):
    zero = s.const(0.0, like=s.x[0])        # 0 at 0, as torch
    sign = s.op("Sub", [s.op("CastLike", [s.op("Greater", [s.x[0], zero]), s.x[0]]),
                        s.op("CastLike", [s.op("Less", [s.x[0], zero]), s.x[0]])])
    return [s.op("Mul", [s.dy[0], sign])]


@gradient("Reciprocal")
def _reciprocal(s: Step):
    return [s.op("Neg", [s.op("Mul", [s.dy[0], s.op("Mul", [s.y[0], s.y[0]])])])]


_unary("Softplus", lambda s: s.op("Sigmoid", [s.x[0]]))


@gradient("LeakyRelu")
def _leaky_relu(s: Step):
    x, dy = s.x[0], s.dy[0]
    scaled = s.op("Mul", [dy, s.const(s.attr("alpha", 0.01), like=dy)])
    return [s.op("Where", [s.op("Greater", [x, s.const(0.0, like=x)]), dy, scaled])]


@gradient("Gelu")
def _gelu(s: Step):
    """none: Phi(x) + x phi(x) = 0.5 (1 + erf(u)) + u exp(ln(1 / sqrt pi) - u^2) with u = x / sqrt 2 (ten
    passes); tanh: 0.5 (1 + tanh(w)) = Sigmoid(2 w), so with z = x (a + b x^2), a = 2 sqrt(2 / pi),
    b = 0.044715 a, and s = Sigmoid(z): s (1 + (x - x s) (a + 3 b x^2)) (thirteen): the forms of
    :mod:`.patterns`, the forward's values recomputed."""
    x = s.x[0]
    approximate = s.attr("approximate", b"none")
    approximate = approximate.decode() if isinstance(approximate, bytes) else approximate

    def f(value):
        return s.const(value, like=x)
    if approximate == "tanh":
        a = 2 * math.sqrt(2 / math.pi)
        b = 0.044715 * a
        x2 = s.op("Mul", [x, x])
        sig = s.op("Sigmoid", [s.op("Mul", [x, s.op("Add", [s.op("Mul", [x2, f(b)]), f(a)])])])
        slope = s.op("Add", [s.op("Mul", [x2, f(3 * b)]), f(a)])
        inner = s.op("Add", [s.op("Mul", [s.op("Sub", [x, s.op("Mul", [x, sig])]), slope]), f(1.0)])
        local = s.op("Mul", [inner, sig])
    else:
        u = s.op("Mul", [x, f(1 / math.sqrt(2))])
        half = s.op("Mul", [s.op("Add", [s.op("Erf", [u]), f(1.0)]), f(0.5)])
        bell = s.op("Exp", [s.op("Sub", [f(math.log(1 / math.sqrt(math.pi))), s.op("Mul", [u, u])])])
        local = s.op("Add", [half, s.op("Mul", [u, bell])])
    return [s.op("Mul", [s.dy[0], local])]


@gradient("Clip")
def _clip(s: Step):
    """dy where min <= x <= max (torch's clamp), bounds as constants; a bound that needs a gradient is refused."""
    if s.wants(1) or s.wants(2):
        raise s.unsupported("a bound depends on a parameter")
    x, dy = s.x[0], s.dy[0]
    if len(s.x) == 1 and ("min" in s.attrs or "max" in s.attrs):
        raise s.unsupported("bounds as attributes (opset < 11)")
    inside = None
    for k, compare in ((1, "GreaterOrEqual"), (2, "LessOrEqual")):
        if len(s.x) > k and s.x[k]:
            test = s.op(compare, [x, s.x[k]])
            inside = test if inside is None else s.op("And", [inside, test])
    if inside is None:
        return [dy]
    return [s.op("Where", [inside, dy, s.const(0.0, like=dy)])] + [None] * (len(s.x) - 1)


@gradient("Sum")
def _sum(s: Step):
    return _each(s, [lambda: s.dy[0]] * len(s.x))


def _extremum(s: Step):
    """Min / Max: dy to each input equal to the result, split evenly between the inputs that tie."""
    y, dy = s.y[0], s.dy[0]
    hits = [s.op("CastLike", [s.op("Equal", [x, y]), dy]) for x in s.x]
    share = dy
    if len(s.x) > 1:
        count = s.op("Sum", hits)      # each of the result's shape
        share = s.op("Div", [dy, count])
    return _each(s, [(lambda h=h: s.op("Mul", [share, h])) for h in hits])


gradient("Min")(_extremum)
gradient("Max")(_extremum)


@gradient("Dropout")
def _dropout(s: Step):
    """Inference form (no training_mode, or ratio 0): dy; training form: dy * mask / (1 - ratio), the mask
    from the node's own output. (trainrun's train graphs feed masks as inputs: no Dropout remains there.)"""
    training = len(s.x) > 2 and s.x[2] and bool(s.value(2))
    ratio = float(s.value(1)) if len(s.x) > 1 and s.x[1] else 0.5
    out = [None] * len(s.x)
    if not training or ratio == 0.0:
        out[0] = s.dy[0]
        return out
    if len(s.y) < 2 or not s.y[1]:
        raise s.unsupported("training mode without its mask output (the mask is drawn at run time)")
    keep = s.op("CastLike", [s.y[1], s.dy[0]])
    out[0] = s.op("Mul", [s.op("Mul", [s.dy[0], keep]), s.const(1.0 / (1.0 - ratio), like=s.dy[0])])
    return out


def _where(s: Step, cond: str, a: str, b: str) -> str:
    return s.op("Where", [cond, a, b])


def _f(s: Step, value: float) -> str:
    """A float constant of x's type."""
    return s.const(value, like=s.x[0])


def _hard_sigmoid_local(s: Step, alpha: float, beta: float) -> tuple[str, str]:
    """(alpha x + beta, whether it is strictly inside (0, 1): where HardSigmoid has slope alpha)."""
    x = s.x[0]
    v = s.op("Add", [s.op("Mul", [x, _f(s, alpha)]), _f(s, beta)])
    inside = s.op("And", [s.op("Greater", [v, _f(s, 0.0)]), s.op("Less", [v, _f(s, 1.0)])])
    return v, inside


@gradient("HardSigmoid")
def _hard_sigmoid(s: Step):
    alpha = s.attr("alpha", 0.2)
    _, inside = _hard_sigmoid_local(s, alpha, s.attr("beta", 0.5))
    return [_where(s, inside, s.op("Mul", [s.dy[0], _f(s, alpha)]), _f(s, 0.0))]


@gradient("HardSwish")
def _hard_swish(s: Step):
    """x HardSigmoid(x) with alpha 1/6, beta 0.5: v + x / 6 inside, 0 below, 1 above (torch's hardswish)."""
    alpha = 1.0 / 6.0
    v, inside = _hard_sigmoid_local(s, alpha, 0.5)
    slope = _where(s, inside, s.op("Add", [v, s.op("Mul", [s.x[0], _f(s, alpha)])]),
                   s.op("CastLike", [s.op("GreaterOrEqual", [v, _f(s, 1.0)]), s.x[0]]))
    return [s.op("Mul", [s.dy[0], slope])]


def _exponential_below_zero(s: Step, scale: float, alpha: float):
    """Elu (scale 1) and Selu: slope scale above 0, y + scale alpha at or below (y = scale alpha (e^x - 1))."""
    positive = s.op("Greater", [s.x[0], _f(s, 0.0)])
    slope = _where(s, positive, _f(s, scale), s.op("Add", [s.y[0], _f(s, scale * alpha)]))
    return [s.op("Mul", [s.dy[0], slope])]


gradient("Elu")(lambda s: _exponential_below_zero(s, 1.0, s.attr("alpha", 1.0)))
gradient("Selu")(lambda s: _exponential_below_zero(s, s.attr("gamma", 1.05070102214813232421875),
                                                    s.attr("alpha", 1.67326319217681884765625)))


@gradient("Celu")
def _celu(s: Step):
    """max(0, x) + min(0, alpha (e^(x / alpha) - 1)): 1 above 0, e^(x / alpha) at or below."""
    x = s.x[0]
    below = s.op("Exp", [s.op("Div", [x, _f(s, s.attr("alpha", 1.0))])])
    return [s.op("Mul", [s.dy[0], _where(s, s.op("Greater", [x, _f(s, 0.0)]), _f(s, 1.0), below)])]


@gradient("ThresholdedRelu")
def _thresholded_relu(s: Step):
    return [_where(s, s.op("Greater", [s.x[0], _f(s, s.attr("alpha", 1.0))]), s.dy[0], _f(s, 0.0))]


@gradient("PRelu")
def _prelu(s: Step):
    """x below 0 times the slope (broadcast to x): dy slope there, dy elsewhere; the slope's gradient dy x below
    0, summed back to the slope's shape."""
    x, slope, dy = s.x[0], s.x[1], s.dy[0]
    negative = s.op("Less", [x, _f(s, 0.0)])
    return _each(s, [lambda: _where(s, negative, s.op("Mul", [dy, slope]), dy),
                     lambda: _where(s, negative, s.op("Mul", [dy, x]), _f(s, 0.0))])




@gradient("Mish")
def _mish(s: Step):
    """x tanh(softplus x): tanh(sp) + x sigmoid(x) (1 - tanh(sp)^2)."""
    x = s.x[0]
    t = s.op("Tanh", [s.op("Softplus", [x])])
    sech2 = s.op("Sub", [_f(s, 1.0), s.op("Mul", [t, t])])
    slope = s.op("Add", [t, s.op("Mul", [s.op("Mul", [x, s.op("Sigmoid", [x])]), sech2])])
    return [s.op("Mul", [s.dy[0], slope])]


def _square(s: Step, name: str) -> str:
    return s.op("Mul", [name, name])


def _cos(s: Step, x: str) -> str:
    """cos x as 1 - 2 sin^2(x / 2): onnxruntime's CPU kernel of Cos (and of most trigonometry) is float only."""
    return s.op("Sub", [_f(s, 1.0), s.op("Mul", [_f(s, 2.0), _square(s, s.op("Sin", [s.op("Mul", [x, _f(s, 0.5)])]))])])


def _inverse_sqrt(s: Step, a: float, b: float) -> str:
    """1 / sqrt(a + b x^2)."""
    return s.op("Reciprocal", [s.op("Sqrt", [s.op("Add", [_f(s, a), s.op("Mul", [_f(s, b), _square(s, s.x[0])])])])])


_unary("Softsign", lambda s: s.op("Reciprocal", [_square(s, s.op("Add", [_f(s, 1.0), s.op("Abs", [s.x[0]])]))]))
_unary("Sin", lambda s: _cos(s, s.x[0]))
_unary("Cos", lambda s: s.op("Neg", [s.op("Sin", [s.x[0]])]))
_unary("Tan", lambda s: s.op("Add", [_f(s, 1.0), _square(s, s.y[0])]))
_unary("Asin", lambda s: _inverse_sqrt(s, 1.0, -1.0))
_unary("Acos", lambda s: s.op("Neg", [_inverse_sqrt(s, 1.0, -1.0)]))
_unary("Atan", lambda s: s.op("Reciprocal", [s.op("Add", [_f(s, 1.0), _square(s, s.x[0])])]))
_unary("Sinh", lambda s: s.op("Cosh", [s.x[0]]))
_unary("Cosh", lambda s: s.op("Sinh", [s.x[0]]))
_unary("Asinh", lambda s: _inverse_sqrt(s, 1.0, 1.0))
_unary("Acosh", lambda s: _inverse_sqrt(s, -1.0, 1.0))
_unary("Atanh", lambda s: s.op("Reciprocal", [s.op("Sub", [_f(s, 1.0), _square(s, s.x[0])])]))
