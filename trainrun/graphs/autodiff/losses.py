"""Gradients of SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss in standard ops: d loss / d log p is
``-c * onehot(label)`` with ``c`` each element's upstream gradient times its class weight (0 where the label
is ``ignore_index``), divided for ``mean`` by the sum of the weights of the labels not ignored; through
LogSoftmax that is ``c * (softmax - onehot)``. The labels get no gradient; a weights input that needs one
is refused."""

from .core import Step, gradient


def _dlogp(s: Step, scores: str):
    """d loss / d log p from the loss output's gradient (None if the loss output does not reach the loss)."""
    if len(s.x) > 2 and s.x[2] and s.wants(2):
        raise s.unsupported("the weights input needs a gradient")
    if s.dy[0] is None:
        return None
    labels = s.x[1]
    ignore = s.attr("ignore_index")
    valid = None
    if ignore is not None:
        valid = s.op("Not", [s.op("Equal", [labels, s.const(ignore)])])
        labels = s.op("Where", [valid, labels, s.const(0)])
    weight = s.op("CastLike", [valid, scores]) if valid is not None else None
    if len(s.x) > 2 and s.x[2]:
        picked = s.op("Gather", [s.x[2], labels], axis=0)
        weight = picked if weight is None else s.op("Mul", [weight, picked])
    reduction = s.attr("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    coeff = s.dy[0]
    if weight is not None:
        coeff = s.op("Mul", [coeff, weight])
    if reduction == "mean":
        count = (s.op("ReduceSum", [weight], keepdims=0) if weight is not None
                 else s.op("CastLike", [s.op("Size", [labels]), scores]))
        coeff = s.op("Div", [coeff, count])
    if reduction != "none":
        coeff = s.op("Expand", [coeff, s.op("Shape", [labels])])
    # onehot along axis 1: the labels against the class numbers, [C, 1, ...] broadcast over [N, 1, d...]
    depth = s.op("Squeeze", [s.op("Shape", [scores], start=1, end=2), s.const([0])])
    classes = s.op("Reshape", [s.op("Range", [s.const(0), depth, s.const(1)]),
                               s.const([-1] + [1] * (s.emit.rank(scores, s.node) - 2))])
    onehot = s.op("CastLike", [s.op("Equal", [s.op("Unsqueeze", [labels, s.const([1])]), classes]), scores])
    return s.op("Neg", [s.op("Mul", [s.op("Unsqueeze", [coeff, s.const([1])]), onehot])])


def _reduction(s: Step) -> str:
    reduction = s.attr("reduction", b"mean")
    return reduction.decode() if isinstance(reduction, bytes) else reduction


def _by_exp(s: Step, scores: str) -> str:
    """The loss's gradient (mean or sum, no class weights, only the loss output read) as
    Exp(log_prob) * r, then -r added at each label by an in-place ScatterElements: r = dY (/ the labels not
    ignored, for mean), 0 on an ignored label's row. Three passes over the scores, where the onehot form
    writes and reads several [N, C] tensors; log_prob is the forward node's own output (added where it
    leaves it out)."""
    labels, coeff = s.x[1], s.dy[0]
    ignore = s.attr("ignore_index")
    valid = None
    if ignore is not None:
        valid = s.op("Not", [s.op("Equal", [labels, s.op("CastLike", [s.const(ignore), labels])])])
        labels = s.op("Where", [valid, labels, s.op("CastLike", [s.const(0), labels])])
        weight = s.op("CastLike", [valid, scores])
        coeff = s.op("Mul", [coeff, weight])
        if _reduction(s) == "mean":
            coeff = s.op("Div", [coeff, s.op("ReduceSum", [weight], keepdims=0)])
    elif _reduction(s) == "mean":
        coeff = s.op("Div", [coeff, s.op("CastLike", [s.op("Size", [labels]), scores])])
    per_row = s.op("Unsqueeze", [s.op("Expand", [coeff, s.op("Shape", [labels])]), s.const([1])])
    scaled = s.op("Mul", [s.op("Exp", [s.emit.output(s.node, 1)]), per_row])
    return s.op("ScatterElements", [scaled, s.op("Unsqueeze", [labels, s.const([1])]), s.op("Neg", [per_row])],
                axis=1, reduction="add")


@gradient("SoftmaxCrossEntropyLoss")
def _softmax_cross_entropy(s: Step):
    scores = s.x[0]
    out = [None] * len(s.x)
    if not s.wants(0):
        return out
    if not (len(s.dy) > 1 and s.dy[1] is not None) and not (len(s.x) > 2 and s.x[2]) and s.dy[0] is not None \
            and _reduction(s) != "none":
        out[0] = _by_exp(s, scores)
        return out
    terms = [t for t in (_dlogp(s, scores), s.dy[1] if len(s.dy) > 1 else None) if t is not None]
    dlogp = terms[0] if len(terms) == 1 else s.op("Add", terms)
    logp = s.emit.output(s.node, 1)
    total = s.op("ReduceSum", [dlogp, s.const([1])], keepdims=1)
    out[0] = s.op("Sub", [dlogp, s.op("Mul", [s.op("Exp", [logp]), total])])
    return out


@gradient("NegativeLogLikelihoodLoss")
def _nll(s: Step):
    out = [None] * len(s.x)
    if s.wants(0):
        out[0] = _dlogp(s, s.x[0])
    return out
