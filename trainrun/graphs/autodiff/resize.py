"""The gradient of Resize. Every mode (nearest, linear, cubic; antialias, exclude_outside, each coordinate
transformation, tf_crop_and_resize's roi) is linear in x and separable: y = x times one matrix per resized
axis, M [n, m] (n x's dim, m y's), M[i, j] the weight of x's element i in y's element j. M is found by the op
itself: Resize of the identity [n, n] along its second axis, with the node's own attributes and this axis's
scale, size and roi (extrapolation_value 0: a point outside the roi reads none of x). Then dx = dy times M^T
along each resized axis (a MatMul with the axis moved last and back). Refused: keep_aspect_ratio_policy other
than stretch (one scale shared by the axes), and a roi, scales or sizes that needs a gradient."""

from .core import Step, gradient


def _given(s: Step, k: int):
    """Input ``k``'s name, or None where it is left out or a constant empty tensor."""
    if len(s.x) <= k or not s.x[k]:
        return None
    value = s.emit.values.get(s.x[k])
    return None if value is not None and value.size == 0 else s.x[k]


def _identity(s: Step, j: int, axis: int, scales, sizes) -> bool:
    """Whether the resize along ``axis`` (the ``j``-th of the resized axes) is known to be the identity."""
    values = s.emit.values
    if scales is not None and scales in values:
        return float(values[scales].reshape(-1)[j]) == 1.0
    dims = s.emit.dims.get(s.x[0])
    if sizes is not None and sizes in values and dims is not None:
        return dims[axis] == int(values[sizes].reshape(-1)[j])
    return False


@gradient("Resize")
def _resize(s: Step):
    if any(s.wants(k) for k in (1, 2, 3)):
        raise s.unsupported("its roi, scales or sizes depend on a parameter")
    x = s.x[0]
    attrs = dict(s.attrs)
    policy = attrs.pop("keep_aspect_ratio_policy", b"stretch")
    policy = policy.decode() if isinstance(policy, bytes) else policy
    roi, scales, sizes = (_given(s, k) for k in (1, 2, 3))
    if sizes is not None:
        scales = None
    elif scales is None:
        raise s.unsupported("neither scales nor sizes is given")
    if policy != "stretch" and sizes is not None:
        raise s.unsupported(f"keep_aspect_ratio_policy {policy} (stretch only)")
    transform = attrs.get("coordinate_transformation_mode", b"half_pixel")
    crop = (transform.decode() if isinstance(transform, bytes) else transform) == "tf_crop_and_resize"
    attrs["extrapolation_value"] = 0.0
    rank = s.emit.rank(x, s.node)
    axes = [a % rank for a in attrs.pop("axes", None) or range(rank)]
    g = s.dy[0]
    for j, a in enumerate(axes):
        if not crop and _identity(s, j, a, scales, sizes):
            continue
        n = s.op("Slice", [s.op("Shape", [x]), s.const([a]), s.const([a + 1])])
        eye = s.op("CastLike", [s.op("EyeLike", [s.op("ConstantOfShape", [s.op("Concat", [n, n], axis=0)])]), x])
        pick = s.const([j]), s.const([j + 1])
        inputs = [eye, "", "", ""]
        if crop and roi is not None:
            k = len(axes)
            inputs[1] = s.op("Concat", [s.const([0.0], like=roi), s.op("Slice", [roi, *pick]), s.const([1.0], like=roi),
                                        s.op("Slice", [roi, s.const([k + j]), s.const([k + j + 1])])], axis=0)
        if sizes is not None:
            inputs[3] = s.op("Concat", [n, s.op("Slice", [sizes, *pick])], axis=0)
        else:
            inputs[2] = s.op("Concat", [s.const([1.0], like=scales), s.op("Slice", [scales, *pick])], axis=0)
        while not inputs[-1]:
            inputs.pop()
        weights = s.op("Resize", inputs, **attrs)                   # [n, m]
        last = [b for b in range(rank) if b != a] + [a]
        moved = s.op("MatMul", [s.op("Transpose", [g], perm=last), s.op("Transpose", [weights], perm=[1, 0])])
        g = s.op("Transpose", [moved], perm=[last.index(b) for b in range(rank)])
    return [g] + [None] * (len(s.x) - 1)
