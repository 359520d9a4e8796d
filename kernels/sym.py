"""A tiny symbolic builder for ONNX graphs, so that tensor math reads like math.

::

    b = GraphBuilder("demo")
    m = b.input("m", FLOAT, [n])
    g = b.input("g", FLOAT, [n])
    b.output(0.9 * m + 0.1 * g, "m_out", [n])      # emits Mul, Mul, Add
    model = b.model()

Only standard ONNX operators (default domain) are emitted.

Two kinds of value, told apart by ``Sym.scalar``:

* **Scalars** (shape ``[]``): learning rate, step, bias corrections, norms. They
  cost nothing worth counting. Arithmetic between scalars promotes to the wider
  type, so one float64 operand keeps e.g. ``1 - 0.999 ** t`` accurate.
* **Tensors** (the flat buffers): every node over a tensor is a full pass over
  memory, so scaling is lazy. A tensor Sym stands for ``coef * base``; ``c * x``
  and ``x / c`` with a scalar ``c`` only fold ``c`` into ``coef``. The one Mul
  that applies ``coef`` is emitted when the value is needed (by ``+``, ``-``,
  ``sqrt``, an output), and ``x * y`` / ``x / y`` of two tensors carry both
  coefficients along. So ``lr * (c * (m / d))`` costs one Div and one Mul.
  A scalar that meets a tensor is cast to the tensor's type.

:func:`inplace_conflicts` checks that a graph may run with an output bound to
the same buffer as an input.
"""

from __future__ import annotations

from numbers import Real

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT, DOUBLE, INT64, BOOL = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64, TensorProto.BOOL
_NUMPY = {FLOAT: np.float32, DOUBLE: np.float64, INT64: np.int64, BOOL: np.bool_}
_WIDTH = {BOOL: 0, INT64: 1, FLOAT: 2, DOUBLE: 3}  # scalar promotion order


class GraphBuilder:
    """Collects nodes, constants, inputs and outputs; :meth:`model` makes the ModelProto."""

    def __init__(self, name: str):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._consts: dict = {}       # (dtype, shape, bytes) -> Sym
        self._casts: dict = {}        # (name, dtype) -> Sym
        self._produced: set[str] = set()
        self._exported: dict[str, str] = {}  # node output -> graph output name
        self._count = 0

    def _fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def input(self, name: str, dtype: int, shape=()) -> "Sym":
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return Sym(self, name, dtype, scalar=len(shape) == 0)

    def const(self, value, dtype: int) -> "Sym":
        """A constant (initializer); equal constants are shared."""
        arr = np.asarray(value, dtype=_NUMPY[dtype])
        key = (dtype, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self._fresh("const")
            self.initializers.append(numpy_helper.from_array(arr, name))
            self._consts[key] = Sym(self, name, dtype, scalar=arr.ndim == 0)
        return self._consts[key]

    def op(self, op_type: str, *args: "Sym", dtype=None, scalar=None, **attrs) -> "Sym":
        """Emit one single-output node. Its type and kind default to those of the first argument."""
        out = self._fresh(op_type.lower())
        self.nodes.append(helper.make_node(op_type, [a.ref() for a in args], [out], name=out, **attrs))
        self._produced.add(out)
        return Sym(self, out, args[0].dtype if dtype is None else dtype,
                   args[0].scalar if scalar is None else scalar)

    def output(self, x: "Sym", name: str, shape) -> None:
        """Make ``x`` the graph output ``name``: the node computing it writes ``name`` directly."""
        ref = x.ref()
        if ref not in self._produced or ref in self._exported:  # an input, a constant, or exported twice
            ref = self.op("Identity", x).ref()
        self._exported[ref] = name
        self.outputs.append(helper.make_tensor_value_info(name, x.dtype, list(shape)))

    def model(self, opset: int = 17, ir_version: int = 9) -> onnx.ModelProto:
        rename = self._exported
        nodes = []
        for node in self.nodes:
            n = onnx.NodeProto()
            n.CopyFrom(node)
            n.input[:] = [rename.get(i, i) for i in node.input]
            n.output[:] = [rename.get(o, o) for o in node.output]
            nodes.append(n)
        graph = helper.make_graph(nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                                  producer_name="trainrun")
        model.ir_version = ir_version
        onnx.checker.check_model(model, full_check=True)
        return model


def _is_tensor(x) -> bool:
    return isinstance(x, Sym) and not x.scalar


class Sym:
    """A value of the graph being built: ``coef * base`` (coef is None for plain values)."""

    __array_ufunc__ = None  # numpy numbers on the left defer to Sym's reflected operators

    def __init__(self, builder: GraphBuilder, name: str, dtype: int, scalar: bool, coef=None):
        if isinstance(coef, Real) and coef == 1:
            coef = None
        self.b, self.name, self.dtype, self.scalar, self.coef = builder, name, dtype, scalar, coef
        self._ref = name if coef is None else None

    def _base(self) -> "Sym":
        return Sym(self.b, self.name, self.dtype, self.scalar)

    def split(self):
        """``(coef, base)`` with ``self == coef * base``; coef is 1.0 when nothing is pending."""
        return (1.0 if self.coef is None else self.coef), self._base()

    def ref(self) -> str:
        """The name of a node output holding this value (emits the pending scaling once)."""
        if self._ref is None:
            self._ref = self.b.op("Mul", self._base(), self._like(self.coef)).name
        return self._ref

    def _like(self, x) -> "Sym":
        """A scalar (number or Sym) as a Sym of this value's type."""
        if isinstance(x, Sym):
            return x.cast(self.dtype)
        return self.b.const(x, self.dtype)

    def cast(self, dtype: int) -> "Sym":
        if dtype == self.dtype:
            return self
        key = (self.ref(), dtype)
        if key not in self.b._casts:
            self.b._casts[key] = self.b.op("Cast", self, to=dtype, dtype=dtype)
        return self.b._casts[key]

    # -- arithmetic
    def __mul__(self, other):
        return _mul(self, other)

    __rmul__ = __mul__

    def __truediv__(self, other):
        return _div(self, other)

    def __rtruediv__(self, other):
        return _div(other, self)

    def __add__(self, other):
        return _elementwise("Add", self, other)

    def __radd__(self, other):
        return _elementwise("Add", other, self)

    def __sub__(self, other):
        return _elementwise("Sub", self, other)

    def __rsub__(self, other):
        return _elementwise("Sub", other, self)

    def __neg__(self):
        return self * -1.0 if not self.scalar else self.b.op("Neg", self)

    def __pow__(self, other):
        return _elementwise("Pow", self, other)

    def __rpow__(self, other):
        return _elementwise("Pow", other, self)

    def __gt__(self, other):
        return _elementwise("Greater", self, other, dtype=BOOL)

    def __and__(self, other):
        return self.b.op("And", self, other)

    def reshape(self, shape) -> "Sym":
        """A Reshape (a view in onnxruntime: no pass); the pending scale carries over."""
        b = self.b
        view = b.op("Reshape", self._base(), b.const(list(shape), INT64))
        return Sym(b, view.name, self.dtype, False, self.coef)

    def __getitem__(self, s: slice) -> "Sym":
        """``x[a:b]`` of a 1-D tensor (a copy: Slice); the pending scale carries over."""
        b = self.b
        part = b.op("Slice", self._base(), b.const([s.start], INT64), b.const([s.stop], INT64))
        return Sym(b, part.name, self.dtype, False, self.coef)


def _times(c1, c2):
    """Product of two coefficients (None means 1)."""
    if c1 is None:
        return c2
    if c2 is None:
        return c1
    return c1 * c2


def _reciprocal(c):
    return None if c is None else 1.0 / c


def _scalar_pair(a, b):
    """Two scalars (numbers or scalar Syms) as Syms of their common (wider) type."""
    syms = [x for x in (a, b) if isinstance(x, Sym)]
    dtype = max((x.dtype for x in syms), key=_WIDTH.__getitem__)
    like = syms[0]
    return [x.cast(dtype) if isinstance(x, Sym) else like.b.const(x, dtype) for x in (a, b)]


def _mul(a: Sym, b):
    if _is_tensor(a) and _is_tensor(b):
        return Sym(a.b, a.b.op("Mul", a._base(), b._base()).name, a.dtype, False, _times(a.coef, b.coef))
    if _is_tensor(a) or _is_tensor(b):
        t, s = (a, b) if _is_tensor(a) else (b, a)
        return Sym(t.b, t.name, t.dtype, False, _times(t.coef, s))
    if isinstance(b, Real) and b == 1:
        return a
    x, y = _scalar_pair(a, b)
    return x.b.op("Mul", x, y)


def _div(a, b):
    if _is_tensor(a) and _is_tensor(b):
        q = a.b.op("Div", a._base(), b._base())
        return Sym(a.b, q.name, a.dtype, False, _times(a.coef, _reciprocal(b.coef)))
    if _is_tensor(a):
        return _mul(a, _reciprocal(b))
    if _is_tensor(b):
        return b.b.op("Div", b._like(a), b)
    x, y = _scalar_pair(a, b)
    return x.b.op("Div", x, y)


def _elementwise(op_type: str, a, b, dtype=None):
    """A binary op without lazy tricks: tensors are materialised, scalars cast to the tensor type."""
    if _is_tensor(a) or _is_tensor(b):
        t = a if _is_tensor(a) else b
        x, y = (v if _is_tensor(v) else t._like(v) for v in (a, b))
        return t.b.op(op_type, x, y, dtype=dtype)
    x, y = _scalar_pair(a, b)
    return x.b.op(op_type, x, y, dtype=dtype)


# -- functions

def sqrt(x: Sym) -> Sym:
    return x.b.op("Sqrt", x)


def where(cond: Sym, a, b) -> Sym:
    """Scalar select: ``a`` where ``cond`` else ``b``."""
    x, y = _scalar_pair(a, b)
    return cond.b.op("Where", cond, x, y)


def clip(x: Sym, lo: float, hi: float) -> Sym:
    return x.b.op("Clip", x, x._like(lo), x._like(hi))


def sum_squares(x: Sym) -> Sym:
    """Sum of squares of a tensor, as a scalar of the tensor's type times coef**2."""
    s = x.b.op("ReduceSumSquare", x._base(), keepdims=0, scalar=True)
    return s if x.coef is None else s * (x.coef * x.coef)


def concat(parts: list[Sym]) -> Sym:
    """1-D concatenation (one pass writing the result)."""
    if len(parts) == 1:
        return parts[0]
    return parts[0].b.op("Concat", *parts, axis=0)


def fill(value, shape, like: Sym) -> Sym:
    """A tensor of the given shape filled with a scalar, of ``like``'s type."""
    b = like.b
    return b.op("Expand", like._like(value), b.const(list(shape), INT64), scalar=False)


# -- in-place safety

_VIEW_OPS = {"Reshape", "Identity", "Flatten", "Squeeze", "Unsqueeze"}


def inplace_conflicts(model: onnx.ModelProto, aliases: dict[str, str]) -> list[str]:
    """Problems with binding output ``aliases[x]`` to the same buffer as input ``x``.

    The binding is safe when every node that reads ``x`` is the node that writes
    the aliased output or one of its ancestors: then every topological order
    reads the old ``x`` before anything overwrites it. Views of ``x`` (outputs
    of Reshape, Identity, ...; onnxruntime may share their memory) count as
    ``x``. Returns one message per offending node (empty list: safe).
    """
    nodes = list(model.graph.node)
    producer = {out: i for i, n in enumerate(nodes) for out in n.output}
    problems = []
    for x, y in aliases.items():
        views = {x}
        for n in nodes:  # nodes are in topological order
            if n.op_type in _VIEW_OPS and n.input[0] in views:
                views.add(n.output[0])
        if y not in producer:
            problems.append(f"output {y!r} (aliased to {x!r}) is not written by any node")
            continue
        ancestors, todo = set(), [producer[y]]
        while todo:
            i = todo.pop()
            if i not in ancestors:
                ancestors.add(i)
                todo.extend(producer[name] for name in nodes[i].input if name in producer)
        for i, n in enumerate(nodes):
            if views.intersection(n.input) and i not in ancestors:
                problems.append(f"node {n.name or i} ({n.op_type}) reads {x!r} but does not precede "
                                f"the node writing {y!r}")
    return problems
