"""trainrun.kernels.host.HostOptimizer (fused Numba loops) against the optimizer graph and NumPy.

Every case runs the same 3 steps from identical starts through the ONNX graph of
trainrun.step.optim (a real onnxruntime CPU session, plain ``sess.run``) and through
HostOptimizer with a small LAMB chunk, on tensors whose sizes straddle the chunk.

Tolerances: SGD (Mul/Add/Sub only) and the Adam moments of AdamW / LAMB (which
do not depend on the params) agree bit for bit. Everything downstream of a
square root agrees to rtol 1e-6 / atol 1e-7 (steps of lr <= 0.05): onnxruntime's
float32 Sqrt is Eigen's fast rsqrt + Newton step (about 1/3 of results 1 ulp off
the correctly rounded np.sqrt), and LAMB's norms are summed in another order.
"""

import math

import numpy as np
import pytest
import onnxruntime as ort

from test_optim import initial_params, random_grads, reference_run, to_flat
from trainrun.config import OptimizerConfig, ParamGroupConfig
from trainrun.kernels import host
from trainrun.step.optim import build_optimizer_graph, state_names

CHUNK = 1000
# Sizes not multiples of the chunk, two tensors larger than it, runs of same-decay tensors that
# cross chunk and tensor boundaries, a scalar; the default no_decay patterns exempt the ln_ and
# bias tensors (biases start at 0: LAMB's ||p|| = 0 rule at step 1).
LAYOUT = [
    ("wte", (37, 41)),
    ("wpe", (13, 19)),
    ("h.0.ln_1.weight", (41,)),
    ("h.0.ln_1.bias", (41,)),
    ("h.0.attn.weight", (41, 53)),
    ("h.0.attn.bias", (53,)),
    ("h.0.mlp.weight", (29, 31)),
    ("head.weight", (7, 143)),
    ("gain", ()),
]
SIZES = [math.prod(s) for _, s in LAYOUT]
NAMES = [n for n, _ in LAYOUT]
SCHEDULE = [0.05, 0.03, 0.02]
RTOL, ATOL = 1e-6, 1e-7

CASES = {
    "sgd": dict(name="sgd"),
    "sgd_l2": dict(name="sgd", weight_decay=0.1),
    "sgd_momentum": dict(name="sgd", momentum=0.9),
    "sgd_momentum_l2": dict(name="sgd", momentum=0.9, weight_decay=0.1),
    "sgd_nesterov": dict(name="sgd", momentum=0.8, nesterov=True),
    "sgd_nesterov_l2": dict(name="sgd", momentum=0.8, nesterov=True, weight_decay=0.1),
    "adam": dict(name="adam", eps=1e-2),
    "adam_torch_l2": dict(name="adam", weight_decay=0.05, eps=1e-2),
    "adam_ort_l2": dict(name="adam", weight_decay=0.05, eps=1e-2, eps_mode="ort"),
    "adam_l2_no_bias_correction": dict(name="adam", weight_decay=0.05, bias_correction=False),
    "adam_ort_no_bias_correction": dict(name="adam", weight_decay=0.05, eps=1e-2, eps_mode="ort",
                                        bias_correction=False),
    "adamw_torch": dict(name="adamw", weight_decay=0.1, eps=1e-2),
    "adamw_ort": dict(name="adamw", weight_decay=0.1, eps=1e-2, eps_mode="ort"),
    "adamw_torch_no_bias_correction": dict(name="adamw", weight_decay=0.1, bias_correction=False),
    "adamw_ort_no_bias_correction": dict(name="adamw", weight_decay=0.1, eps_mode="ort", bias_correction=False),
    "adamw_no_decay": dict(name="adamw", betas=[0.8, 0.99]),
    "adamw_custom_no_decay": dict(name="adamw", weight_decay=0.2, betas=[0.85, 0.95], no_decay=["wte", "h.*.bias"]),
    "lamb": dict(name="lamb", weight_decay=0.01, eps=1e-6),
    "lamb_no_bias_correction": dict(name="lamb", weight_decay=0.01, bias_correction=False),
    "lamb_no_decay": dict(name="lamb", betas=[0.8, 0.99]),
    "lamb_no_decay_no_bias_correction": dict(name="lamb", bias_correction=False),
}
EXACT_STATES = {"adamw", "lamb"}  # m, v do not see the params: plain Mul/Add, bit-identical


def run_graph(cfg, params, grads, schedule, grad_scale, depths=None):
    """The optimizer graph, fed with plain sess.run; returns (params, {state: array})."""
    model = build_optimizer_graph(cfg, LAYOUT, depths)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    states = state_names(cfg)
    p, st = params.copy(), {s: np.zeros_like(params) for s in states}
    for t, (g, lr) in enumerate(zip(grads, schedule), start=1):
        out = sess.run(["params_out", *[f"{s}_out" for s in states]],
                       {"params": p, "grads": g, **st, "lr": np.array(lr, np.float32),
                        "step": np.array(t, np.int64), "grad_scale": np.array(grad_scale, np.float32)})
        p, st = out[0], dict(zip(states, out[1:]))
    return p, st


def run_host(cfg, params, grads, schedule, grad_scale, chunk=CHUNK, depths=None):
    opt = host.HostOptimizer(cfg, SIZES, NAMES, chunk=chunk, depths=depths)
    p, st = params.copy(), {s: np.zeros_like(params) for s in state_names(cfg)}
    for t, (g, lr) in enumerate(zip(grads, schedule), start=1):
        opt.step(p, g, st, lr, t, grad_scale)
    return p, st


def start(seed, scales=None, zero=()):
    rng = np.random.default_rng(seed)
    params = initial_params(rng, LAYOUT, scales)
    grads = random_grads(rng, len(SCHEDULE), LAYOUT, zero=zero)
    return params, grads


def assert_agree(cfg, params, grads, grad_scale, chunk=CHUNK, depths=None):
    flat, flat_grads = to_flat(params), [to_flat(g) for g in grads]
    want_p, want_st = run_graph(cfg, flat, flat_grads, SCHEDULE, grad_scale, depths)
    got_p, got_st = run_host(cfg, flat, flat_grads, SCHEDULE, grad_scale, chunk, depths)
    assert np.abs(want_p - flat).max() > 1e-2  # the steps moved the params
    assert set(got_st) == set(want_st) == set(state_names(cfg))
    if cfg.name == "sgd":
        np.testing.assert_array_equal(got_p, want_p)
    else:
        np.testing.assert_allclose(got_p, want_p, rtol=RTOL, atol=ATOL)
    for s in want_st:
        if cfg.name == "sgd" or cfg.name in EXACT_STATES:
            np.testing.assert_array_equal(got_st[s], want_st[s], err_msg=s)
        else:
            np.testing.assert_allclose(got_st[s], want_st[s], rtol=RTOL, atol=ATOL, err_msg=s)
    return got_p, got_st


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_optimizer_graph(case):
    cfg = OptimizerConfig(lr=7.0, **CASES[case])  # cfg.lr is never used: the scheduled lr is
    params, grads = start(0)
    assert len(set(host.HostOptimizer(cfg, SIZES, NAMES).weight_decay)) == (2 if cfg.weight_decay else 1)
    assert_agree(cfg, params, grads, grad_scale=0.7)


# groups over LAYOUT: the h.0 block at 0.7x the lr, wpe with its own decay, every bias decayed;
# layer decay 0.6 over depths (wte and wpe 2, h.0.* 1, head and gain 0)
GROUPS = [ParamGroupConfig(params="h.0.*", lr_scale=0.7),
          ParamGroupConfig(params="wpe", lr_scale=1.5, weight_decay=0.4),
          ParamGroupConfig(params="*bias", weight_decay=0.2)]
DEPTHS = {"wte": 2, "wpe": 2, **{n: 1 for n in NAMES if n.startswith("h.0.")}}


@pytest.mark.parametrize("case", ["sgd_l2", "sgd_nesterov_l2", "adam_torch_l2", "adam_ort_l2", "adamw_torch",
                                  "adamw_ort", "lamb", "lamb_no_bias_correction"])
def test_groups_and_layer_decay_match_the_optimizer_graph(case):
    """Per-tensor lr scales and decays (optimizer.groups, layer_decay): host loops and graph agree, to the
    same tolerances as without groups; the runs of tensors split where the scales differ."""
    cfg = OptimizerConfig(**CASES[case], groups=GROUPS, layer_decay=0.6)
    opt = host.HostOptimizer(cfg, SIZES, NAMES, depths=DEPTHS)
    if cfg.name != "lamb":
        assert len(opt.runs) >= 5
    params, grads = start(6)
    got_p, _ = assert_agree(cfg, params, grads, grad_scale=0.7, depths=DEPTHS)
    plain_p, _ = run_host(OptimizerConfig(**CASES[case]), to_flat(params), [to_flat(g) for g in grads], SCHEDULE, 0.7)
    assert np.abs(got_p - plain_p).max() > 1e-3


@pytest.mark.parametrize("grad_scale", [1.0, 0.03, 4.0])
@pytest.mark.parametrize("case", ["sgd_nesterov_l2", "adam_torch_l2", "adamw_ort", "lamb"])
def test_grad_scale(case, grad_scale):
    params, grads = start(1)
    assert_agree(OptimizerConfig(**CASES[case]), params, grads, grad_scale)


def test_lamb_trust_ratio_clipped_at_both_ends_and_zero_norms():
    """Tensors at very different scales push the raw trust ratio below ratio_min and above
    ratio_max; zero biases take r = lr at step 1, and a zero tensor with zero grads (both norms
    0) and a nonzero one with zero grads and no decay (||d|| = 0) take it at every step."""
    cfg = OptimizerConfig(name="lamb", weight_decay=0.05, ratio_min=0.05, ratio_max=2.0)
    scales = [30.0, 1.0, 1.0, 1.0, 0.001, 1.0, 3.0, 1.0, 1.0]
    zero = {"h.0.attn.bias", "h.0.ln_1.weight"}
    params, grads = start(2, scales, zero)
    _, _, ratios = reference_run(cfg, params, grads, SCHEDULE, grad_scale=0.5)  # float64, raw ratios
    finite = [r for r in ratios if r is not None]
    assert min(finite) < cfg.ratio_min and max(finite) > cfg.ratio_max
    assert ratios.count(None) >= 2 * len(SCHEDULE) + 1
    got_p, got_st = assert_agree(cfg, params, grads, grad_scale=0.5)
    assert np.isfinite(got_p).all()
    a = sum(SIZES[:5])
    bias = slice(a, a + SIZES[5])
    assert (got_p[bias] == 0).all() and (got_st["exp_avg"][bias] == 0).all()
    ln = slice(sum(SIZES[:2]), sum(SIZES[:3]))
    np.testing.assert_array_equal(got_p[ln], to_flat(params)[ln])  # d = 0: unchanged


@pytest.mark.parametrize("case", ["lamb", "lamb_no_decay"])
def test_chunk_size_does_not_change_the_result(case):
    """LAMB's first pass goes chunk by chunk: the moments keep their bits, the norms only sum in another order."""
    cfg = OptimizerConfig(**CASES[case])
    params, grads = start(3)
    flat, flat_grads = to_flat(params), [to_flat(g) for g in grads]
    runs = [run_host(cfg, flat, flat_grads, SCHEDULE, 0.9, chunk) for chunk in (7, CHUNK, 1 << 16)]
    for p, st in runs[:2]:
        if cfg.name == "lamb":
            np.testing.assert_allclose(p, runs[2][0], rtol=RTOL, atol=ATOL)
        else:
            np.testing.assert_array_equal(p, runs[2][0])
        for s in st:
            np.testing.assert_array_equal(st[s], runs[2][1][s])


@pytest.mark.parametrize("case", ["sgd_momentum_l2", "adam_torch_l2", "adamw_ort", "lamb"])
def test_step_updates_the_given_arrays_in_place(case):
    cfg = OptimizerConfig(**CASES[case])
    params, grads = start(4)
    p, g = to_flat(params), to_flat(grads[0])
    state = {s: np.full_like(p, 0.01) for s in state_names(cfg)}
    ids = {"params": id(p), "grads": id(g), **{s: id(a) for s, a in state.items()}}
    ptrs = {"params": p.ctypes.data, **{s: a.ctypes.data for s, a in state.items()}}
    before = {"params": p.copy(), **{s: a.copy() for s, a in state.items()}}
    g_before = g.copy()
    host.HostOptimizer(cfg, SIZES, NAMES).step(p, g, state, 0.01, 2, 0.5)
    after = {"params": p, **state}
    assert {"params": id(p), "grads": id(g), **{s: id(a) for s, a in state.items()}} == ids
    assert {k: a.ctypes.data for k, a in after.items()} == ptrs
    assert list(state) == state_names(cfg)
    for k, a in after.items():
        assert not np.array_equal(a, before[k]), k
    np.testing.assert_array_equal(g, g_before)  # grads are read only


def test_rejects_what_is_not_a_float32_numpy_buffer():
    cfg = OptimizerConfig(name="adamw")
    opt = host.HostOptimizer(cfg, SIZES, NAMES)
    n = sum(SIZES)
    good = lambda: np.zeros(n, np.float32)  # noqa: E731
    with pytest.raises(TypeError):
        opt.step([0.0] * n, good(), {"exp_avg": good(), "exp_avg_sq": good()}, 0.1, 1, 1.0)
    with pytest.raises(TypeError):
        opt.step(good(), memoryview(good()), {"exp_avg": good(), "exp_avg_sq": good()}, 0.1, 1, 1.0)
    with pytest.raises(TypeError):
        opt.step(good(), good(), {"exp_avg": good().astype(np.float64), "exp_avg_sq": good()}, 0.1, 1, 1.0)
    with pytest.raises(ValueError):
        opt.step(good()[:-1], good(), {"exp_avg": good(), "exp_avg_sq": good()}, 0.1, 1, 1.0)
    with pytest.raises(KeyError):
        opt.step(good(), good(), {"exp_avg": good()}, 0.1, 1, 1.0)
    with pytest.raises(ValueError):
        host.HostOptimizer(cfg, [3, 0], ["a", "b"])


@pytest.mark.parametrize("case", ["lamb", "lamb_no_decay_no_bias_correction", "adamw_torch", "sgd_momentum_l2",
                                  "lamb+groups", "adamw_torch+groups"])
def test_parts_of_the_buffer_update_as_the_whole(case):
    """ZeRO-1's shards: the flat buffer cut into 3 parts inside tensors (and one part inside a single
    tensor), one HostOptimizer per part over the tensor pieces it holds, run in 3 threads whose LAMB
    norm_sums add up every part's per-tensor sums (as trainrun.sync.update does over ranks): the graph's update
    of the whole buffer, to the same tolerances."""
    import threading
    name, _, grouped = case.partition("+")
    cfg = OptimizerConfig(**CASES[name], **(dict(groups=GROUPS, layer_decay=0.6) if grouped else {}))
    depths = DEPTHS if grouped else None
    params, grads = start(3)
    flat, flat_grads = to_flat(params), [to_flat(g) for g in grads]
    want_p, want_st = run_graph(cfg, flat, flat_grads, SCHEDULE, 0.7, depths)
    bounds = np.cumsum([0] + SIZES)
    cuts = [0, 1600, 1700, bounds[-1]]        # wpe is 1517:1764: cut twice, the middle part inside it
    assert any(a < c < b for a, b in zip(bounds, bounds[1:]) for c in cuts[1:-1])
    p, st = flat.copy(), {s: np.zeros_like(flat) for s in state_names(cfg)}
    sums = np.zeros((len(SIZES), 2))
    barrier, lock = threading.Barrier(3), threading.Lock()
    errors = []

    def part(lo, hi):
        pieces = [(i, min(b, hi) - max(a, lo)) for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if a < hi and b > lo]
        ids = [i for i, _ in pieces]

        def norm_sums(mine):
            with lock:
                sums[ids] += mine
            barrier.wait()
            total = sums[ids].copy()
            barrier.wait()
            if lo == 0:
                sums[...] = 0.0
            barrier.wait()
            return total

        opt = host.HostOptimizer(cfg, [n for _, n in pieces], [NAMES[i] for i in ids], chunk=CHUNK,
                                 norm_sums=norm_sums if cfg.name == "lamb" else None, depths=depths)
        try:
            for t, (g, lr) in enumerate(zip(flat_grads, SCHEDULE), start=1):
                opt.step(p[lo:hi], g[lo:hi].copy(), {s: v[lo:hi] for s, v in st.items()}, lr, t, 0.7)
        except BaseException as exc:    # noqa: BLE001
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=part, args=(a, b)) for a, b in zip(cuts, cuts[1:])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert np.abs(want_p - flat).max() > 1e-2
    np.testing.assert_allclose(p, want_p, rtol=RTOL, atol=ATOL)
    for s in want_st:
        np.testing.assert_allclose(st[s], want_st[s], rtol=RTOL, atol=ATOL, err_msg=s)


def numpy_adam(cfg, p, g, m, v, lr, t, gs):
    """One Adam/AdamW step in NumPy float32 ufuncs, op by op in the graph's order (np.sqrt is correctly
    rounded, as the vectorised loop's sqrt is): the reference for the fused loop's exact bits."""
    f = np.float32
    b1, b2 = cfg.betas
    bc1, root_bc2 = 1 - b1 ** t, math.sqrt(1 - b2 ** t)
    e = cfg.eps * root_bc2 if cfg.eps_mode == "torch" else cfg.eps
    lr, gs = float(f(lr)), float(f(gs))
    wd = cfg.weight_decay
    if cfg.name == "adam" and wd:
        g = g + p * f(wd / gs)
    m = m * f(b1) + g * f(gs * (1 - b1))
    v = v * f(b2) + (g * g) * f(gs * (1 - b2) * gs)
    d = m / (np.sqrt(v) + f(e)) * f(root_bc2 / bc1 * lr)
    if cfg.name == "adamw" and cfg.eps_mode == "torch":
        p = p * f(1 - lr * wd) - d
    elif cfg.name == "adamw":
        p = (p - d) * f(1 - lr * wd)
    else:
        p = p - d
    return p, m, v


@pytest.mark.parametrize("case", ["adam_torch_l2", "adam_ort_l2", "adamw_torch", "adamw_ort"])
def test_fused_adam_equals_numpy_op_by_op(case):
    """Bit for bit: a loop that fused a multiply and an add into one FMA, or reassociated, would round
    differently somewhere in 100k elements (the graph test's rtol would not see it)."""
    cfg = OptimizerConfig(**CASES[case])
    rng = np.random.default_rng(5)
    n = 100_003
    p, g = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    m, v = rng.standard_normal(n, dtype=np.float32) * 0.1, rng.random(n, dtype=np.float32)
    want = numpy_adam(cfg, p, g, m, v, 0.03, 7, 0.7)
    state = {"exp_avg": m.copy(), "exp_avg_sq": v.copy()}
    got_p = p.copy()
    host.HostOptimizer(cfg, [n], ["w"]).step(got_p, g, state, 0.03, 7, 0.7)
    for got, ref in zip((got_p, state["exp_avg"], state["exp_avg_sq"]), want):
        np.testing.assert_array_equal(got, ref)
