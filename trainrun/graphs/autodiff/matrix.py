"""Gradients of MatMul (batched, broadcast, 1-D operands) and Gemm.

A weight's gradient (a MatMul's right operand a matrix, its left one [..., M, K] with every dim known) is
X^T dY over the flattened rows, written as an explicit transpose of X and a plain MatMul: onnxruntime
folds a Transpose into a product as a transposed left operand (FusedMatMul or Gemm transA), which MLAS runs
by transposing it again, panel by panel, for every block of output columns, slower than the forward's
product of the same size (docs/design.md, "Levers at GPT-2 124M"). The transpose is a Reshape [M, 1, K],
Transpose [K, M, 1], Reshape [K, M]: a shape onnxruntime's MatmulTransposeFusion does not fold back."""

from .core import Step, gradient


def transposed(s: Step, x: str) -> str:
    """The [K, M] transpose of the matrix ``x`` ([M, K]), in a form onnxruntime does not fold into a
    product's transA."""
    x3 = s.op("Reshape", [x, s.const([0, 1, -1])])
    return s.op("Reshape", [s.op("Transpose", [x3], perm=[2, 0, 1]), s.const([0, -1])])


def _weight_gradient(s: Step, a: str, dy: str, rank: int, bdims) -> str:
    """X^T dY for MatMul(a [..., M, K], b [K, N]): the rows of every batch flattened, one product."""
    k, n = bdims
    x = a if rank == 2 else s.op("Reshape", [a, s.const([-1, k])])
    d = dy if rank == 2 else s.op("Reshape", [dy, s.const([-1, n])])
    return s.op("MatMul", [transposed(s, x), d])


def _swap_last(s: Step, x: str, rank: int) -> str:
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return s.op("Transpose", [x], perm=perm)


@gradient("MatMul")
def _matmul(s: Step):
    a, b = s.x
    ra, rb = s.emit.rank(a, s.node), s.emit.rank(b, s.node)
    dy = s.dy[0]
    # 1-D operands as matrices: a (k) as (1, k), b (k) as (k, 1); dy gets the dims they dropped
    a2 = s.op("Unsqueeze", [a, s.const([0])]) if ra == 1 else a
    b2 = s.op("Unsqueeze", [b, s.const([1])]) if rb == 1 else b
    if ra == 1:
        dy = s.op("Unsqueeze", [dy, s.const([-1 if rb == 1 else -2])])
    if rb == 1:
        dy = s.op("Unsqueeze", [dy, s.const([-1])])
    ydims = s.emit.static(s.y[0])
    adims, bdims = s.emit.static(a), s.emit.static(b)
    batch = None
    if ydims is not None and adims is not None and bdims is not None:
        batch = ydims[:len(ydims) - (ra > 1) - (rb > 1)]
    # dims or their symbols (a symbolic sequence length): da and db need no sum where they agree with a's, b's
    ysyms, asyms, bsyms = (s.emit.syms.get(t) for t in (s.y[0], a, b))
    known = ra >= 2 and rb >= 2 and ysyms is not None and asyms is not None and bsyms is not None
    batch_syms = ysyms[:len(ysyms) - 2] if known else None
    out = [None, None]
    if s.wants(0) and ra == 2 and rb == 2:
        # dY W^T as a Gemm with transB (the form engine.pad_products pads without materialising W^T)
        out[0] = s.op("Gemm", [dy, b], transB=1)
    elif s.wants(0):
        da = s.op("MatMul", [dy, _swap_last(s, b2, max(rb, 2))])
        dims = None if batch is None else batch + [1 if ra == 1 else adims[-2], adims[-1]]
        out[0] = s.sum_to(da, 0, dims, None if dims is not None or not known else batch_syms + asyms[-2:])
    if s.wants(1) and rb == 2 and ra >= 2 and bdims is not None:
        out[1] = _weight_gradient(s, a, dy, ra, bdims)
    elif s.wants(1):
        db = s.op("MatMul", [_swap_last(s, a2, max(ra, 2)), dy])
        if rb == 1:
            db = s.op("Squeeze", [db, s.const([-1])])
        dims = None if batch is None else batch + ([bdims[0]] if rb == 1 else bdims[-2:])
        out[1] = s.sum_to(db, 1, dims, None if dims is not None or not known else batch_syms + bsyms[-2:])
    return out


@gradient("Gemm")
def _gemm(s: Step):
    a, b = s.x[:2]
    ta, tb = s.attr("transA", 0), s.attr("transB", 0)
    alpha, beta = s.attr("alpha", 1.0), s.attr("beta", 1.0)
    dy = s.dy[0]
    out = [None] * len(s.x)
    if s.wants(0):
        out[0] = (s.op("Gemm", [b, dy], transA=tb, transB=1, alpha=alpha) if ta
                  else s.op("Gemm", [dy, b], transA=0, transB=1 - tb, alpha=alpha))
    if s.wants(1):
        # without transA (the module's docstring): dY^T A = T(dY) A when B is transposed, A^T dY = T(A) dY
        # when it is not (A^T = T(A); A already [K, M] with transA)
        first, second = (dy, a) if tb else (a, dy)
        lhs = first if (ta and not tb) else transposed(s, first)
        out[1] = s.op("Gemm", [lhs, second], transA=0, transB=ta if tb else 0, alpha=alpha) if alpha != 1.0 \
            else s.op("MatMul", [lhs, s.op("Transpose", [second], perm=[1, 0]) if tb and ta else second])
    if len(s.x) > 2 and s.x[2] and s.wants(2):
        out[2] = s.sum_to(s.op("Mul", [dy, s.const(beta, like=dy)]), 2)
    return out
