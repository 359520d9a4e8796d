"""The optimizer graph (trainrun.step.optim) against NumPy references and torch.optim.

Every graph runs in a real onnxruntime InferenceSession with IOBinding, each
``X`` / ``X_out`` pair bound to ONE OrtValue that shares memory with a flat
NumPy array, so the update happens in place exactly as the runner does it.
"""

import fnmatch
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from trainrun.config import OptimizerConfig, ParamGroupConfig
from trainrun.kernels.optimizers import tensor_settings
from trainrun.kernels.sym import inplace_conflicts
from trainrun.step.optim import build_optimizer_graph, inplace_aliases, state_names, weight_decays

# Names chosen so that the default no_decay patterns exclude some ("*bias", "*ln_*").
PARAMS = [
    ("h.0.attn.weight", (12, 16)),
    ("h.0.attn.bias", (16,)),
    ("h.0.ln_1.weight", (16,)),
    ("wte", (40, 8)),
    ("head.weight", (8, 5)),
    ("gain", ()),
]
# All sizes multiples of 8: per-tensor factors broadcast over rows of 8 (PARAMS, with its
# scalar, degenerates to rows of 1).
PARAMS8 = [
    ("h.0.attn.weight", (8, 24)),
    ("h.0.attn.bias", (24,)),
    ("h.0.ln_1.weight", (8,)),
    ("wte", (40, 8)),
    ("head.weight", (8, 16)),
]
LAYOUTS = {"mixed_sizes": PARAMS, "rows_of_8": PARAMS8}
LR_TRAP = 7.0  # cfg.lr: a graph that baked it in would fail every comparison


def layout_of(tensors):
    return [(name, np.shape(value)) for name, value in tensors.items()]


def initial_params(rng, layout=PARAMS, scales=None):
    """Float32 params; biases start at zero (LAMB's ||w|| = 0 case at step 1)."""
    out = {}
    for i, (name, shape) in enumerate(layout):
        scale = 1.0 if scales is None else scales[i]
        out[name] = (np.zeros(shape) if name.endswith("bias") else rng.normal(0, scale, shape)).astype(np.float32)
    return out


def to_flat(tensors):
    """The flat buffer: the tensors in (dict) order, each flattened row-major."""
    return np.concatenate([np.asarray(value, np.float32).ravel() for value in tensors.values()])


class InPlace:
    """Runs an optimizer graph with params/state updated in place in flat numpy arrays."""

    def __init__(self, model, params_flat, cfg):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        self.sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        n = params_flat.size
        self.buffers = {"params": params_flat, **{s: np.zeros(n, np.float32) for s in state_names(cfg)}}
        self.grads = np.zeros(n, np.float32)
        self.binding = self.sess.io_binding()
        for name, arr in self.buffers.items():
            value = ort.OrtValue.ortvalue_from_numpy(arr)  # shares arr's memory
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output(f"{name}_out", value)
        self.binding.bind_ortvalue_input("grads", ort.OrtValue.ortvalue_from_numpy(self.grads))

    def step(self, grads_flat, lr, t, grad_scale):
        self.grads[:] = grads_flat
        self.binding.bind_cpu_input("lr", np.array(lr, np.float32))
        self.binding.bind_cpu_input("step", np.array(t, np.int64))
        self.binding.bind_cpu_input("grad_scale", np.array(grad_scale, np.float32))
        self.sess.run_with_iobinding(self.binding)


# ----------------------------------------------------------------------------- NumPy reference
# Float64, one tensor at a time, straight from the published update rules.

def decay_of(cfg, name):
    return 0.0 if any(fnmatch.fnmatchcase(name, pat) for pat in cfg.no_decay) else cfg.weight_decay


def ref_sgd(cfg, p, g, st, lr, t, wd, log):
    g = g + wd * p
    if cfg.momentum:
        st["momentum"] = cfg.momentum * st["momentum"] + g
        g = g + cfg.momentum * st["momentum"] if cfg.nesterov else st["momentum"]
    return p - lr * g


def _adam_moments(cfg, g, st):
    b1, b2 = cfg.betas
    st["exp_avg"] = b1 * st["exp_avg"] + (1 - b1) * g
    st["exp_avg_sq"] = b2 * st["exp_avg_sq"] + (1 - b2) * g * g
    return st["exp_avg"], st["exp_avg_sq"]


def _bias_corrections(cfg, t):
    b1, b2 = cfg.betas
    return (1 - b1 ** t, 1 - b2 ** t) if cfg.bias_correction else (1.0, 1.0)


def _adam_step(cfg, m, v, lr, t):
    bc1, bc2 = _bias_corrections(cfg, t)
    if cfg.eps_mode == "torch":  # torch: lr * m_hat / (sqrt(v_hat) + eps)
        return lr * (m / bc1) / (np.sqrt(v / bc2) + cfg.eps)
    # ORT / HF: lr * sqrt(bc2) / bc1 * m / (sqrt(v) + eps)
    return lr * math.sqrt(bc2) / bc1 * m / (np.sqrt(v) + cfg.eps)


def ref_adam(cfg, p, g, st, lr, t, wd, log):
    m, v = _adam_moments(cfg, g + wd * p, st)
    return p - _adam_step(cfg, m, v, lr, t)


def ref_adamw(cfg, p, g, st, lr, t, wd, log):
    m, v = _adam_moments(cfg, g, st)
    if cfg.eps_mode == "torch":
        p = p * (1 - lr * wd)
        return p - _adam_step(cfg, m, v, lr, t)
    p = p - _adam_step(cfg, m, v, lr, t)
    return p - lr * wd * p


def ref_lamb(cfg, p, g, st, lr, t, wd, log):
    m, v = _adam_moments(cfg, g, st)
    bc1, bc2 = _bias_corrections(cfg, t)
    d = (m / bc1) / (np.sqrt(v / bc2) + cfg.eps) + wd * p
    w_norm, d_norm = np.linalg.norm(p), np.linalg.norm(d)
    if w_norm == 0 or d_norm == 0:
        log.append(None)
        r = lr
    else:
        log.append(w_norm / d_norm)
        r = lr * min(max(w_norm / d_norm, cfg.ratio_min), cfg.ratio_max)
    return p - r * d


REFERENCE = {"sgd": ref_sgd, "adam": ref_adam, "adamw": ref_adamw, "lamb": ref_lamb}


def reference_run(cfg, params, grads_per_step, schedule, grad_scale, groups=None):
    """Float64 reference over several steps; returns (params, state) as flat arrays and a log.
    ``groups``: name -> (lr scale, weight decay), written out by the caller (default: lr scale 1 and
    the no_decay rule)."""
    params = {k: v.astype(np.float64) for k, v in params.items()}
    state = {name: {s: np.zeros(np.shape(value)) for s in state_names(cfg)} for name, value in params.items()}
    log = []
    for t, (grads, lr) in enumerate(zip(grads_per_step, schedule), start=1):
        for name in params:
            g = grads[name].astype(np.float64) * grad_scale
            scale, wd = groups[name] if groups else (1.0, decay_of(cfg, name))
            params[name] = REFERENCE[cfg.name](cfg, params[name], g, state[name], lr * scale, t, wd, log)
    flat_state = {s: to_flat({n: state[n][s] for n in params}) for s in state_names(cfg)}
    return to_flat(params), flat_state, log


def random_grads(rng, steps, layout=PARAMS, zero=()):
    return [{name: (np.zeros(shape) if name in zero else rng.normal(0, 1, shape)).astype(np.float32)
             for name, shape in layout} for _ in range(steps)]


def graph_run(cfg, params, grads_per_step, schedule, grad_scale, depths=None):
    model = build_optimizer_graph(cfg, layout_of(params), depths)
    run = InPlace(model, to_flat(params), cfg)
    for t, (grads, lr) in enumerate(zip(grads_per_step, schedule), start=1):
        run.step(to_flat(grads), lr, t, grad_scale)
    return run.buffers


# ----------------------------------------------------------------------------- vs NumPy

CASES = {
    "sgd": dict(name="sgd"),
    "sgd_momentum": dict(name="sgd", momentum=0.9),
    "sgd_momentum_l2": dict(name="sgd", momentum=0.9, weight_decay=0.1),
    "sgd_nesterov_l2": dict(name="sgd", momentum=0.8, nesterov=True, weight_decay=0.1),
    "adam_l2": dict(name="adam", weight_decay=0.05, eps=1e-2),
    "adam_ort_eps_no_bias_correction": dict(name="adam", weight_decay=0.05, eps=1e-2, eps_mode="ort",
                                            bias_correction=False),
    "adamw_torch_eps": dict(name="adamw", weight_decay=0.1, eps=1e-2),
    "adamw_ort_eps": dict(name="adamw", weight_decay=0.1, eps=1e-2, eps_mode="ort"),
    "adamw_no_bias_correction": dict(name="adamw", weight_decay=0.1, bias_correction=False),
    "adamw_ort_no_bias_correction": dict(name="adamw", weight_decay=0.1, eps_mode="ort", bias_correction=False),
    "adamw_no_decay_at_all": dict(name="adamw", betas=[0.8, 0.99]),
    "adamw_custom_no_decay": dict(name="adamw", weight_decay=0.2, no_decay=["wte", "h.*.bias"]),
    "lamb": dict(name="lamb", weight_decay=0.01, eps=1e-6),
    "lamb_no_bias_correction": dict(name="lamb", weight_decay=0.01, bias_correction=False),
    "lamb_no_decay": dict(name="lamb", betas=[0.8, 0.99]),
    "lamb_no_decay_no_bias_correction": dict(name="lamb", bias_correction=False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_rule_matches_numpy_reference(case, layout):
    cfg = OptimizerConfig(lr=LR_TRAP, **CASES[case])
    rng = np.random.default_rng(0)
    params = initial_params(rng, LAYOUTS[layout])
    grads = random_grads(rng, 5, LAYOUTS[layout])
    schedule = [0.05, 0.03, 0.02, 0.04, 0.01]
    expected, expected_state, _ = reference_run(cfg, params, grads, schedule, grad_scale=0.7)
    got = graph_run(cfg, params, grads, schedule, grad_scale=0.7)
    assert np.abs(expected - to_flat(params)).max() > 1e-2  # the steps moved the params
    np.testing.assert_allclose(got["params"], expected, rtol=1e-6, atol=1e-6)
    for s, value in expected_state.items():
        np.testing.assert_allclose(got[s], value, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_eps_modes_differ_where_it_matters(name):
    """The eps-mode cases above are not vacuous: with eps 1e-2 the two placements disagree."""
    rng = np.random.default_rng(1)
    params, grads = initial_params(rng), random_grads(rng, 2)
    runs = [graph_run(OptimizerConfig(name=name, eps=1e-2, eps_mode=mode), params, grads, [0.05, 0.05], 1.0)
            for mode in ("torch", "ort")]
    assert np.abs(runs[0]["params"] - runs[1]["params"]).max() > 1e-3


def test_lamb_trust_ratio_clamps_and_zero_norm():
    """Tensors at very different scales push the raw trust ratio below ratio_min and above
    ratio_max; the zero-initialised bias takes the r = lr branch at step 1."""
    cfg = OptimizerConfig(name="lamb", lr=LR_TRAP, weight_decay=0.05, ratio_min=0.05, ratio_max=2.0)
    rng = np.random.default_rng(2)
    params = initial_params(rng, PARAMS, scales=[30.0, 1.0, 0.001, 1.0, 3.0, 1.0])
    grads = random_grads(rng, steps=4)
    schedule = [0.02, 0.02, 0.01, 0.01]
    expected, expected_state, ratios = reference_run(cfg, params, grads, schedule, grad_scale=0.5)
    finite = [r for r in ratios if r is not None]
    assert min(finite) < cfg.ratio_min and max(finite) > cfg.ratio_max and None in ratios
    got = graph_run(cfg, params, grads, schedule, grad_scale=0.5)
    np.testing.assert_allclose(got["params"], expected, rtol=1e-6, atol=1e-6)
    for s, value in expected_state.items():
        np.testing.assert_allclose(got[s], value, rtol=1e-6, atol=1e-6)


def test_lamb_zero_params_and_zero_grads_stay_zero():
    """Both norms 0 (p = 0, g = 0): r = lr, d = 0, the tensor stays 0 and no NaN leaks out."""
    cfg = OptimizerConfig(name="lamb", weight_decay=0.01)
    rng = np.random.default_rng(3)
    params = initial_params(rng)
    grads = random_grads(rng, 3, PARAMS, zero={"h.0.attn.bias"})
    got = graph_run(cfg, params, grads, [0.1] * 3, 1.0)
    assert np.isfinite(got["params"]).all()
    bias = slice(12 * 16, 12 * 16 + 16)
    assert (got["params"][bias] == 0).all() and (got["exp_avg"][bias] == 0).all()


def test_weight_decays_follow_no_decay_patterns():
    cfg = OptimizerConfig(weight_decay=0.1, no_decay=["*bias", "*ln_*", "gain"])
    assert weight_decays(cfg, [n for n, _ in PARAMS]) == [0.1, 0.0, 0.0, 0.1, 0.1, 0.0]
    assert weight_decays(OptimizerConfig(weight_decay=0.1, no_decay=[]), ["a.bias"]) == [0.1]
    # fnmatch is case-sensitive on every platform
    assert weight_decays(OptimizerConfig(weight_decay=0.1, no_decay=["*Norm*"]), ["ln.norm"]) == [0.1]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_decay_tensors_get_no_weight_decay(layout):
    """With zero gradients AdamW only decays: matched tensors stay bit-identical, the others shrink."""
    cfg = OptimizerConfig(name="adamw", weight_decay=0.1, no_decay=["*bias", "*ln_*", "gain"])
    rng = np.random.default_rng(4)
    params = initial_params(rng, LAYOUTS[layout])
    zero = random_grads(rng, 1, LAYOUTS[layout], zero=set(params))
    got = graph_run(cfg, params, zero, [0.5], 1.0)["params"]
    start = 0
    for name, value in params.items():
        before, after = value.ravel(), got[start:start + value.size]
        if decay_of(cfg, name):
            np.testing.assert_allclose(after, before * (1 - 0.5 * 0.1), rtol=1e-6)
        else:
            assert np.array_equal(after, before), name
        start += value.size


def full_size_ops(model, n):
    """Op types of the nodes writing n elements (views excluded): the passes over memory."""
    inferred = onnx.shape_inference.infer_shapes(model)
    sizes = {v.name: math.prod(d.dim_value for d in v.type.tensor_type.shape.dim)
             for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    return [node.op_type for node in model.graph.node
            if node.op_type not in ("Reshape", "Identity") and any(sizes.get(o) == n for o in node.output)]


@pytest.mark.parametrize("name, extra", [("adamw", 1), ("adam", 2), ("sgd", 2)])
def test_per_tensor_decay_costs_no_full_size_vector(name, extra):
    """Mixed decays (no_decay) are applied by broadcasting a per-row column over a view of the
    buffer: only the rule's own extra ops are full size, no N-element Expand/Concat."""
    n = sum(math.prod(s) for _, s in PARAMS8)
    plain = full_size_ops(build_optimizer_graph(OptimizerConfig(name=name), PARAMS8), n)
    mixed = full_size_ops(build_optimizer_graph(OptimizerConfig(name=name, weight_decay=0.1), PARAMS8), n)
    assert len(mixed) == len(plain) + extra and not {"Expand", "Concat"} & set(mixed)
    assert len(plain) == {"adamw": 12, "adam": 12, "sgd": 2}[name]


# ----------------------------------------------------------------------------- vs torch.optim

def _torch_case(kind):
    torch = pytest.importorskip("torch")
    common = dict(lr=LR_TRAP, weight_decay=0.1, no_decay=["*bias", "*ln_*"])
    if kind == "adamw":
        return torch.optim.AdamW, dict(betas=(0.9, 0.99), eps=1e-8), OptimizerConfig(
            name="adamw", betas=[0.9, 0.99], eps=1e-8, **common)
    if kind == "adam":
        return torch.optim.Adam, dict(betas=(0.85, 0.995), eps=1e-6), OptimizerConfig(
            name="adam", betas=[0.85, 0.995], eps=1e-6, **common)
    if kind == "sgd":
        return torch.optim.SGD, dict(momentum=0.9), OptimizerConfig(name="sgd", momentum=0.9, **common)
    return torch.optim.SGD, dict(momentum=0.9, nesterov=True), OptimizerConfig(
        name="sgd", momentum=0.9, nesterov=True, **common)


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd", "sgd_nesterov"])
def test_matches_torch_optim_over_20_steps(kind):
    torch = pytest.importorskip("torch")
    optim_cls, kwargs, cfg = _torch_case(kind)
    rng = np.random.default_rng(5)
    params = initial_params(rng)
    grads = random_grads(rng, 20)
    schedule = [0.01 * (1 + math.cos(i / 3)) + 1e-3 for i in range(20)]
    grad_scale = 0.8

    tensors = {name: torch.nn.Parameter(torch.from_numpy(params[name].copy())) for name, _ in PARAMS}
    groups = [{"params": [tensors[n] for n, _ in PARAMS if decay_of(cfg, n)], "weight_decay": cfg.weight_decay},
              {"params": [tensors[n] for n, _ in PARAMS if not decay_of(cfg, n)], "weight_decay": 0.0}]
    assert groups[0]["params"] and groups[1]["params"]
    opt = optim_cls(groups, lr=schedule[0], **kwargs)
    for step_grads, lr in zip(grads, schedule):
        for group in opt.param_groups:
            group["lr"] = lr
        for name, _ in PARAMS:
            tensors[name].grad = torch.from_numpy(np.asarray(step_grads[name] * np.float32(grad_scale)))
        opt.step()
    expected = to_flat({n: t.detach().numpy() for n, t in tensors.items()})

    got = graph_run(cfg, params, grads, schedule, grad_scale)
    assert np.abs(expected - to_flat(params)).max() > 1e-2
    np.testing.assert_allclose(got["params"], expected, rtol=1e-6, atol=1e-6)
    if kind.startswith("adam"):
        torch_m = to_flat({n: opt.state[t]["exp_avg"].numpy() for n, t in tensors.items()})
        np.testing.assert_allclose(got["exp_avg"], torch_m, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- parameter groups

# groups over PARAMS: h.0.* at half the lr (the first match decides: h.0.attn.bias is in it, not in the
# *bias group below, for its lr; its decay comes from the *bias group, the first that sets one), wte at
# twice the lr with its own decay, every bias decayed 0.3 (over no_decay's *bias), gain left alone;
# layer decay 0.5 over depths (wte 3, h.0.* 2, head 0): the lr scale is the group's times 0.5 ** depth
GROUPS = [ParamGroupConfig(params="h.0.*", lr_scale=0.5),
          ParamGroupConfig(params="wte", lr_scale=2.0, weight_decay=0.02),
          ParamGroupConfig(params="*bias", lr_scale=3.0, weight_decay=0.3)]
DEPTHS = {"wte": 3, "h.0.attn.weight": 2, "h.0.attn.bias": 2, "h.0.ln_1.weight": 2}
# name -> (lr scale, weight decay) as the rule above gives them, written out by hand
EXPECTED_GROUPS = {"h.0.attn.weight": (0.5 * 0.25, 0.1), "h.0.attn.bias": (0.5 * 0.25, 0.3),
                   "h.0.ln_1.weight": (0.5 * 0.25, 0.0), "wte": (2.0 * 0.125, 0.02), "head.weight": (1.0, 0.1),
                   "gain": (1.0, 0.0)}


def groups_cfg(**kw):
    return OptimizerConfig(lr=LR_TRAP, weight_decay=0.1, no_decay=["*bias", "*ln_*", "gain"], groups=GROUPS,
                           layer_decay=0.5, **kw)


def test_tensor_settings_first_match_per_key_then_no_decay_then_layer_decay():
    names = [n for n, _ in PARAMS]
    assert tensor_settings(groups_cfg(), names, DEPTHS) == [EXPECTED_GROUPS[n] for n in names]
    # without depths layer_decay has nothing to scale; without groups: the no_decay rule, scale 1
    assert tensor_settings(groups_cfg(), ["head.weight", "wte"]) == [(1.0, 0.1), (2.0, 0.02)]
    assert tensor_settings(OptimizerConfig(weight_decay=0.1), names) == [
        (1.0, 0.1), (1.0, 0.0), (1.0, 0.0), (1.0, 0.1), (1.0, 0.1), (1.0, 0.1)]


def test_layer_depths_come_from_the_model_family():
    """layer_decay's exponents for the built-in families' own parameter names: embeddings L + 1, block i
    L - i, the rest (final LayerNorm, pooler, heads) 0; none for a model.onnx."""
    from trainrun.config import ModelConfig
    from trainrun.models import bert, gpt2
    from trainrun.models.registry import layer_depths
    m = ModelConfig(builtin="gpt2")
    m.gpt2.n_layer = 3
    depths = layer_depths(m, list(gpt2.param_specs(m.gpt2)))
    assert {n: d for n, d in depths.items() if not n.startswith("transformer.h.")} == {
        "transformer.wte.weight": 4, "transformer.wpe.weight": 4, "transformer.ln_f.weight": 0,
        "transformer.ln_f.bias": 0}
    assert {d for n, d in depths.items() if n.startswith("transformer.h.0.")} == {3}
    assert {d for n, d in depths.items() if n.startswith("transformer.h.2.")} == {1}
    m = ModelConfig(builtin="bert")
    depths = layer_depths(m, list(bert.param_specs(m.bert)))       # 2 layers
    assert depths["bert.embeddings.LayerNorm.weight"] == depths["bert.embeddings.word_embeddings.weight"] == 3
    assert depths["bert.encoder.layer.0.attention.self.query.weight"] == 2
    assert depths["bert.encoder.layer.1.output.dense.bias"] == 1
    assert depths["bert.pooler.dense.weight"] == depths["cls.predictions.bias"] == 0
    assert layer_depths(ModelConfig(builtin=None), ["w"]) is None


@pytest.mark.parametrize("case", ["sgd_nesterov_l2", "adam_ort_eps_no_bias_correction", "adamw_torch_eps",
                                  "adamw_ort_eps", "lamb", "lamb_no_bias_correction"])
def test_groups_match_numpy_reference(case):
    """Every rule with per-tensor lr scales and decays (LAMB: the trust ratio's step scaled) against the
    float64 reference fed the hand-written table."""
    cfg = groups_cfg(**{k: v for k, v in CASES[case].items() if k != "weight_decay"})
    rng = np.random.default_rng(8)
    params, grads = initial_params(rng), random_grads(rng, 5)
    schedule = [0.05, 0.03, 0.02, 0.04, 0.01]
    expected, expected_state, _ = reference_run(cfg, params, grads, schedule, 0.7, EXPECTED_GROUPS)
    got = graph_run(cfg, params, grads, schedule, 0.7, DEPTHS)
    plain, _, _ = reference_run(cfg, params, grads, schedule, 0.7)
    assert np.abs(expected - plain).max() > 1e-3       # the groups changed the update
    np.testing.assert_allclose(got["params"], expected, rtol=1e-6, atol=1e-6)
    for s, value in expected_state.items():
        np.testing.assert_allclose(got[s], value, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd", "sgd_nesterov"])
def test_groups_match_torch_param_groups(kind):
    """torch.optim with one param group per tensor (lr = the scheduled lr times its scale, its weight
    decay), 10 steps: the optimizer graph with optimizer.groups and layer_decay, to 1e-6."""
    torch = pytest.importorskip("torch")
    optim_cls, kwargs, base = _torch_case(kind)
    cfg = groups_cfg(**{k: getattr(base, k) for k in ("name", "betas", "eps", "momentum", "nesterov")})
    rng = np.random.default_rng(9)
    params, grads = initial_params(rng), random_grads(rng, 10)
    schedule = [0.01 * (1 + math.cos(i / 3)) + 1e-3 for i in range(10)]
    tensors = {name: torch.nn.Parameter(torch.from_numpy(params[name].copy())) for name, _ in PARAMS}
    opt = optim_cls([{"params": [tensors[n]], "weight_decay": EXPECTED_GROUPS[n][1], "scale": EXPECTED_GROUPS[n][0]}
                     for n, _ in PARAMS], lr=schedule[0], **kwargs)
    for step_grads, lr in zip(grads, schedule):
        for group in opt.param_groups:
            group["lr"] = lr * group["scale"]
        for name, _ in PARAMS:
            tensors[name].grad = torch.from_numpy(np.asarray(step_grads[name] * np.float32(0.8)))
        opt.step()
    expected = to_flat({n: t.detach().numpy() for n, t in tensors.items()})
    got = graph_run(cfg, params, grads, schedule, 0.8, DEPTHS)
    np.testing.assert_allclose(got["params"], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "lamb"])
def test_groups_cost_no_extra_pass(name):
    """Per-tensor learning rates ride on the per-tensor column the decays already use: no full-size pass
    more than mixed decays alone, no N-element Expand/Concat; all scales 1 builds today's graph."""
    n = sum(math.prod(s) for _, s in PARAMS8)
    mixed = full_size_ops(build_optimizer_graph(OptimizerConfig(name=name, weight_decay=0.1), PARAMS8), n)
    cfg = OptimizerConfig(name=name, weight_decay=0.1, groups=[ParamGroupConfig(params="h.*", lr_scale=0.3)])
    grouped = full_size_ops(build_optimizer_graph(cfg, PARAMS8), n)
    assert len(grouped) == len(mixed) and not {"Expand", "Concat"} & set(grouped)
    ones = OptimizerConfig(name=name, weight_decay=0.1, groups=[ParamGroupConfig(params="h.*", lr_scale=1.0)])
    assert build_optimizer_graph(ones, PARAMS8) == build_optimizer_graph(OptimizerConfig(name=name, weight_decay=0.1),
                                                                          PARAMS8)


# ----------------------------------------------------------------------------- in place and graph shape

@pytest.mark.parametrize("level", ["ORT_DISABLE_ALL", "ORT_ENABLE_ALL"])
@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_inplace_binding_updates_the_numpy_arrays(name, level):
    cfg = OptimizerConfig(name=name, weight_decay=0.01)
    model = build_optimizer_graph(cfg, PARAMS8)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    rng = np.random.default_rng(6)
    params = to_flat(initial_params(rng, PARAMS8))
    grads = to_flat(random_grads(rng, 1, PARAMS8)[0])
    m = rng.normal(0, 0.1, params.size).astype(np.float32)
    v = rng.uniform(0, 0.1, params.size).astype(np.float32)
    scalars = {"lr": np.array(0.01, np.float32), "step": np.array(3, np.int64),
               "grad_scale": np.array(0.9, np.float32)}
    # expected: an ordinary run on copies, outputs in fresh arrays
    plain = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    want = plain.run(["params_out", "exp_avg_out", "exp_avg_sq_out"],
                     {"params": params.copy(), "grads": grads, "exp_avg": m.copy(), "exp_avg_sq": v.copy(),
                      **scalars})

    binding = plain.io_binding()
    arrays = {"params": params, "exp_avg": m, "exp_avg_sq": v}
    addresses = {k: a.ctypes.data for k, a in arrays.items()}
    for key, arr in arrays.items():
        value = ort.OrtValue.ortvalue_from_numpy(arr)
        assert value.data_ptr() == arr.ctypes.data  # shares memory, no copy
        binding.bind_ortvalue_input(key, value)
        binding.bind_ortvalue_output(f"{key}_out", value)
    binding.bind_cpu_input("grads", grads)
    for key, arr in scalars.items():
        binding.bind_cpu_input(key, arr)
    before = params.copy()
    plain.run_with_iobinding(binding)

    assert not np.array_equal(params, before)
    for (key, arr), expected in zip(arrays.items(), want):
        assert arr.ctypes.data == addresses[key]
        np.testing.assert_allclose(arr, expected, rtol=1e-6, atol=1e-7)
        out = binding.get_outputs()[list(arrays).index(key)]
        assert out.data_ptr() == addresses[key]


@pytest.mark.parametrize("case", list(CASES))
def test_graph_interface_and_inplace_safety(case):
    cfg = OptimizerConfig(**CASES[case])
    model = build_optimizer_graph(cfg, PARAMS)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 9
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert all(node.domain == "" for node in model.graph.node)
    n = sum(math.prod(s) for _, s in PARAMS)
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64

    def sig(values):
        return [(v.name, v.type.tensor_type.elem_type, [d.dim_value for d in v.type.tensor_type.shape.dim])
                for v in values]

    states = state_names(cfg)
    assert sig(model.graph.input) == ([("params", f32, [n]), ("grads", f32, [n])]
                                      + [(s, f32, [n]) for s in states]
                                      + [("lr", f32, []), ("step", i64, []), ("grad_scale", f32, [])])
    assert sig(model.graph.output) == [("params_out", f32, [n])] + [(f"{s}_out", f32, [n]) for s in states]
    assert inplace_conflicts(model, inplace_aliases(cfg)) == []


def test_inplace_check_flags_a_read_after_the_write():
    """A node reading params that is not an ancestor of params_out's writer may run after the
    in-place write, and is reported; the same graph without it is clean."""
    h = onnx.helper
    f32 = onnx.TensorProto.FLOAT
    nodes = [h.make_node("Sub", ["params", "grads"], ["params_out"], name="update"),
             h.make_node("Mul", ["params", "exp_avg"], ["exp_avg_out"], name="late_read")]
    io = [h.make_tensor_value_info(x, f32, [4]) for x in ("params", "grads", "exp_avg")]
    outs = [h.make_tensor_value_info(x, f32, [4]) for x in ("params_out", "exp_avg_out")]
    model = h.make_model(h.make_graph(nodes, "bad", io, outs))
    aliases = {"params": "params_out", "exp_avg": "exp_avg_out"}
    problems = inplace_conflicts(model, aliases)
    assert len(problems) == 1 and "late_read" in problems[0] and "'params'" in problems[0]
    # reading params_out (the new value) instead is fine
    model.graph.node[1].input[0] = "params_out"
    assert inplace_conflicts(model, aliases) == []


def test_inplace_check_sees_reads_through_views():
    """A Reshape of params shares its memory: reading the view late is reading params late."""
    h = onnx.helper
    f32 = onnx.TensorProto.FLOAT
    shape = h.make_tensor("shape", onnx.TensorProto.INT64, [2], [2, 2])
    nodes = [h.make_node("Reshape", ["params", "shape"], ["view"], name="view"),
             h.make_node("Sub", ["params", "grads"], ["params_out"], name="update"),
             h.make_node("ReduceSumSquare", ["view"], ["norm"], keepdims=0, name="late_norm")]
    io = [h.make_tensor_value_info(x, f32, [4]) for x in ("params", "grads")]
    outs = [h.make_tensor_value_info("params_out", f32, [4]), h.make_tensor_value_info("norm", f32, [])]
    model = h.make_model(h.make_graph(nodes, "bad", io, outs, [shape]))
    problems = inplace_conflicts(model, {"params": "params_out"})
    assert len(problems) == 2 and any("late_norm" in p for p in problems)


def test_state_names():
    assert state_names(OptimizerConfig(name="adamw")) == ["exp_avg", "exp_avg_sq"]
    assert state_names(OptimizerConfig(name="adam")) == ["exp_avg", "exp_avg_sq"]
    assert state_names(OptimizerConfig(name="lamb")) == ["exp_avg", "exp_avg_sq"]
    assert state_names(OptimizerConfig(name="sgd", momentum=0.9)) == ["momentum"]
    assert state_names(OptimizerConfig(name="sgd")) == []


def test_lr_is_an_input_not_a_constant():
    """Plain SGD: p_out = p - lr * grad_scale * g for whatever lr is fed (cfg.lr unused)."""
    cfg = OptimizerConfig(name="sgd", lr=LR_TRAP)
    rng = np.random.default_rng(7)
    params = initial_params(rng)
    grads = random_grads(rng, 1)
    for lr in (0.0, 0.25):
        got = graph_run(cfg, params, grads, [lr], 2.0)["params"]
        np.testing.assert_allclose(got, to_flat(params) - lr * 2.0 * to_flat(grads[0]), rtol=1e-6, atol=1e-7)


def test_rejects_empty_parameter_lists():
    with pytest.raises(ValueError):
        build_optimizer_graph(OptimizerConfig(), [])
    with pytest.raises(ValueError):
        build_optimizer_graph(OptimizerConfig(), [("w", (3, 0))])
