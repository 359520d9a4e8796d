"""The gradient of Einsum, each operand's another Einsum: of dy with the other operands, to the operand's own
letters. Before that the equation is written out: an implicit output made explicit (the letters used once,
in alphabetical order, after the broadcast dims), and '...' replaced by letters of its own per dim (right-
aligned, as numpy broadcasts them; the ranks must be known). Then, for operand k:

* a letter of k that neither dy nor another operand has (summed over inside k alone) gets dy's sum broadcast
  back along it (Expand);
* a letter k has more than once (a diagonal, ``ii->i``) gets the gradient on that diagonal, zeros off it
  (times an identity);
* a dim of size 1 in k that the others broadcast (a known size 1 against a known larger one) is summed over and
  kept; where sizes are not known when the graph is built, the gradient is summed to k's shape at run time."""

import string

from .core import Step, gradient

LETTERS = string.ascii_letters


def _terms(s: Step):
    """(one list of letters per operand, the output's list) with '...' written out as letters."""
    equation = s.attr("equation")
    equation = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    inputs = lhs.split(",")
    if len(inputs) != len(s.x):
        raise s.unsupported(f"equation '{equation}' names {len(inputs)} operands, the node has {len(s.x)}")
    free = [c for c in LETTERS if c not in equation]
    spans = []
    for k, term in enumerate(inputs):
        if "..." in term:
            spans.append(s.emit.rank(s.x[k], s.node) - len(term.replace("...", "")))
    width = max(spans, default=0)
    if width > len(free):
        raise s.unsupported(f"'...' spans {width} dims, more than the letters left")
    broadcast = free[:width]

    def expand(term: str, span: int) -> list[str]:
        head, dots, tail = term.partition("...")
        return list(head) + (broadcast[width - span:] if dots else []) + list(tail)

    terms = [expand(t, spans.pop(0) if "..." in t else 0) for t in inputs]
    if arrow:
        out = expand(rhs, width)
    else:
        counts = {c: sum(t.count(c) for t in inputs) for c in set(lhs) - {",", "."}}
        out = broadcast + sorted(c for c, n in counts.items() if n == 1)
    return terms, out


@gradient("Einsum")
def _einsum(s: Step):
    terms, out = _terms(s)
    sizes = {}
    for name, term in list(zip(s.x, terms)) + [(s.y[0], out)]:
        dims = s.emit.dims.get(name)
        for c, d in zip(term, dims if dims is not None and len(dims) == len(term) else [None] * len(term)):
            if d is not None and d > 1:
                sizes[c] = max(sizes.get(c, 1), d)
    return [_operand(s, k, terms, out, sizes) if s.wants(k) else None for k in range(len(s.x))]


def _operand(s: Step, k: int, terms, out, sizes) -> str:
    term, x = terms[k], s.x[k]
    dims = s.emit.dims.get(x) or [None] * len(term)
    unique = list(dict.fromkeys(term))
    first = {c: term.index(c) for c in unique}
    elsewhere = set(out).union(*(t for j, t in enumerate(terms) if j != k))
    own = {c for c in unique if c not in elsewhere}
    spread = {c for c in unique if c not in own and dims[first[c]] == 1 and sizes.get(c, 1) > 1}
    kept = [c for c in unique if c not in own and c not in spread]
    others = [j for j in range(len(terms)) if j != k]
    equation = ",".join("".join(t) for t in [out] + [terms[j] for j in others]) + "->" + "".join(kept)
    g = s.op("Einsum", [s.dy[0]] + [s.x[j] for j in others], equation=equation)
    if own or spread:
        g = s.op("Unsqueeze", [g, s.const([unique.index(c) for c in unique if c in own or c in spread])])
    if own:
        shape = s.op("Shape", [x])
        g = s.op("Expand", [g, s.op("Concat", [s.op("Slice", [shape, s.const([first[c]]), s.const([first[c] + 1])])
                                               if c in own else s.const([1]) for c in unique], axis=0)])
    if len(unique) < len(term):
        g = _diagonal(s, g, term, first)
    elif any(d is None for d in dims):
        g = s.emit.sum_to(g, x, f"{s.base}/{x}")      # a broadcast dim not known when the graph is built
    return g


def _diagonal(s: Step, g: str, term, first) -> str:
    """``g`` (one axis per distinct letter, in order of first use) on the diagonals of ``term``'s repeated
    letters: a size-1 axis at each repeat, times an identity over (first use, repeat)."""
    repeats = [p for p, c in enumerate(term) if first[c] != p]
    g = s.op("Unsqueeze", [g, s.const(repeats)])
    for p in repeats:
        q = first[term[p]]
        size = s.op("Slice", [s.op("Shape", [g]), s.const([q]), s.const([q + 1])])
        eye = s.op("CastLike", [s.op("EyeLike", [s.op("ConstantOfShape", [s.op("Concat", [size, size], axis=0)])]), g])
        ones = [s.const([1] * n) for n in (q, p - q - 1, len(term) - p - 1)]
        mask = s.op("Reshape", [eye, s.op("Concat", [ones[0], size, ones[1], size, ones[2]], axis=0)])
        g = s.op("Mul", [g, mask])
    return g
