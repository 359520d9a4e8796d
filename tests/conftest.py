"""Shared test helpers: paths to the venv's tools and a subprocess runner with a timeout."""

import glob
import importlib.util
import inspect
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `python -m pytest` puts the checkout's root first on sys.path, where kernels/ and data_tools/ would import as
# top-level packages: installed, they are trainrun.kernels and trainrun.data_tools. transformers >= 5.25
# requires Hugging Face's `kernels` distribution and imports it by that name, which the checkout's kernels/
# then shadowed (ImportError: cannot import name 'CUDAProperties' from 'kernels'). Tests import trainrun as
# installed, so the root comes off the path before any test module is imported.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT]
BIN = os.path.dirname(sys.executable)
TRAINRUN = os.path.join(BIN, "trainrun")
TRAINRUN_DATA = os.path.join(BIN, "trainrun-data")
MPIRUN = os.path.join(BIN, "mpirun")


def ort_training_missing() -> str | None:
    """Why onnxruntime-training's own gradient builder cannot run here (stock onnxruntime is installed:
    make test, make test-py313; the training extra is make test-training's), or None."""
    from trainrun.graphs.gradients import ort_builder_missing
    missing = ort_builder_missing()
    return f"needs onnxruntime-training's gradient builder: {missing}" if missing else None


def torch_missing() -> str | None:
    """Why the test extra's torch and transformers cannot be used here (make test-py313), or None."""
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    return f"needs {' and '.join(missing)} (the test extra), not installed here" if missing else None


def optional(module: str):
    """``module`` (torch, transformers), or None where the test extra did not install it: a test module that
    imports it this way marks the tests using it ``torch``, so that the others run without it."""
    return None if importlib.util.find_spec(module) is None else importlib.import_module(module)


def pytest_collection_modifyitems(config, items):
    """Markers ort_training and torch: skip, with the reason, where what the test needs is not installed.
    ``make test-fast`` (TRAINRUN_FAST=1): only the tests that start no process (:func:`starts_process`).
    The graphs lane (TRAINRUN_LANE=graphs: make test-training, make test-py313, the suite again on another
    onnxruntime or Python): the tests that start no process and those marked ``graphs`` (what proves the graphs
    a builder writes and their numbers) or ``ort_training`` (onnxruntime-training's builder, which only the
    training leg has); the rest (the run's mechanics: stops, checkpoints, the CLI, the sync) runs the same
    graphs' sessions there as in make test and is proved there."""
    for item in items:
        for marker, missing in (("ort_training", ort_training_missing), ("torch", torch_missing)):
            if item.get_closest_marker(marker) is not None and (why := missing()):
                item.add_marker(pytest.mark.skip(reason=why))
    fast, graphs = os.environ.get("TRAINRUN_FAST") == "1", os.environ.get("TRAINRUN_LANE") == "graphs"
    if fast or graphs:
        slow = [item for item in items if starts_process(item)
                and (fast or not any(item.get_closest_marker(m) for m in ("graphs", "ort_training")))]
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item not in slow]


# a call that starts a process: subprocess, os.fork/exec*, multiprocessing (the helpers here, run and mpirun,
# are found through the module functions a test names: see _calls_process)
_PROCESS_CALL = re.compile(r"\bsubprocess\.|\bos\.(fork|exec\w*|spawn\w*|system)\b|\bmultiprocessing\b|\bPopen\b")


def _calls_process(fn, seen: set) -> bool:
    """Whether ``fn``'s source, or a function of its module that it names (transitively), starts a process."""
    if fn in seen or not callable(fn):
        return False
    seen.add(fn)
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    if _PROCESS_CALL.search(source):
        return True
    scope = getattr(inspect.getmodule(fn), "__dict__", {})
    if "from conftest import" in source:       # the helpers here, imported inside the test
        scope = {**globals(), **scope}
    return any(inspect.isfunction(scope.get(name)) and _calls_process(scope[name], seen)
               for name in set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", source)))


def starts_process(item) -> bool:
    """Whether a collected test starts a process (its function, a fixture of its closure or a helper either
    calls); marker ``process`` says so where the source does not show it."""
    if item.get_closest_marker("process") is not None:
        return True
    seen: set = set()
    fns = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in (info.name2fixturedefs.items() if info else ()):
        if name != "_fast_lane_starts_no_process":
            fns += [d.func for d in defs]
    return any(_calls_process(getattr(f, "__wrapped__", f), seen) for f in fns if f is not None)


@pytest.fixture(autouse=True)
def _fast_lane_starts_no_process(monkeypatch):
    """Under ``make test-fast`` a test that starts a process anyway fails, naming it (mark it ``process``)."""
    if os.environ.get("TRAINRUN_FAST") == "1":
        def refuse(self, *args, **kwargs):
            raise AssertionError("make test-fast runs only tests that start no process: this one does "
                                 "(mark it @pytest.mark.process)")
        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


def run(cmd, timeout=300, check=None, env=None, cwd=None):
    """Run a command; return CompletedProcess with text output. check=rc asserts the exit code."""
    full_env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    full_env.update(env or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    if check is not None:
        assert proc.returncode == check, (
            f"{cmd} exited {proc.returncode}, expected {check}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.fixture
def tiny_gpt2():
    """A GPT-2 shape small enough for fast numerics tests."""
    return {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 64, "vocab_size": 300}


def hf_gpt2(shape: dict, weights: dict):
    """transformers' GPT2LMHeadModel (gelu_new, no dropout) holding ``weights`` (numpy, our names)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"],
                     n_positions=shape["n_positions"], vocab_size=shape["vocab_size"],
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new",
                     bos_token_id=0, eos_token_id=0, layer_norm_epsilon=shape.get("layer_norm_epsilon", 1e-5))
    model = GPT2LMHeadModel(cfg)
    result = model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys, result
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # tied
    return model


def loss_graph_outputs(cfg, weights: dict, batch: dict) -> dict:
    """{output: value} of ``cfg``'s forward graph with its loss (logits kept), every one of ``weights`` loaded
    into its initializer, run by an onnxruntime session on ``batch``."""
    import onnxruntime as ort
    from onnx import numpy_helper
    from trainrun.graphs.forward import forward_from_config
    from trainrun.graphs.losses import with_loss
    model = with_loss(forward_from_config(cfg), -100, keep_logits=True)
    loaded = set()
    for init in model.graph.initializer:
        if init.name in weights:
            init.CopyFrom(numpy_helper.from_array(weights[init.name], init.name))
            loaded.add(init.name)
    assert loaded == set(weights), set(weights) - loaded
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, batch)))


def assert_matches_torch(eng, loss, hf, batch, vocab, rel):
    """The engine's loss and gradient buffer (of ``batch``, just run) against ``hf``'s: the loss to 1e-5,
    each gradient's largest error to ``rel`` times its largest magnitude."""
    import numpy as np
    import torch
    logits = hf(torch.from_numpy(batch["input_ids"])).logits
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.from_numpy(batch["labels"]).reshape(-1),
                                                 ignore_index=-100)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    named = dict(hf.named_parameters())
    for name, grad in eng.layout.unflatten(eng.grads).items():
        ref = named[name].grad.numpy()
        err = np.abs(grad - ref).max() / np.abs(ref).max()
        assert err < rel, (name, err)


def adamw_windows(run_dir, cfg, train: dict, window: int, make_model, loss_of, lr_at) -> dict:
    """A trainrun AdamW run (checkpoints every ``window`` steps, max_grad_norm 1) replayed by
    torch.optim.AdamW on ``make_model(params)``, restarting from trainrun's state at each window
    (see test_parity.py for why); ``loss_of(model)`` is the loss of the next global batch, ``lr_at(t)``
    the reference schedule. Returns the worst relative differences: first_loss / first_grad_norm (first
    step of a window), loss / grad_norm (the others) and update (the parameter change over a window)."""
    import fnmatch

    import numpy as np
    import torch
    from safetensors.numpy import load_file
    o = cfg.optimizer
    run_dir = str(run_dir)

    def state_at(step):
        """trainrun's parameters and AdamW moments after ``step`` updates (0: the initial weights)."""
        if step == 0:
            params = load_file(os.path.join(run_dir, "graphs", "weights.safetensors"))
            return params, {n: np.zeros_like(p) for n, p in params.items()}, {n: np.zeros_like(p) for n, p in params.items()}
        ckpt = os.path.join(run_dir, "checkpoints", str(step))
        assert os.path.exists(os.path.join(ckpt, "COMMITTED"))
        opt = load_file(os.path.join(ckpt, "optimizer.safetensors"))
        params = load_file(os.path.join(ckpt, "model.safetensors"))
        return params, {n: opt[f"exp_avg/{n}"] for n in params}, {n: opt[f"exp_avg_sq/{n}"] for n in params}

    worst = {"first_loss": 0.0, "first_grad_norm": 0.0, "loss": 0.0, "grad_norm": 0.0, "update": 0.0}
    for start in range(0, max(train), window):
        params, exp_avg, exp_avg_sq = state_at(start)
        model = make_model(params).train()
        named = {n: p for n, p in model.named_parameters() if n in params}
        assert set(named) == set(params)
        no_decay = [n for n in named if any(fnmatch.fnmatchcase(n, q) for q in o.no_decay)]
        groups = [{"params": [p for n, p in named.items() if n not in no_decay], "weight_decay": o.weight_decay},
                  {"params": [named[n] for n in no_decay], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        for n, p in named.items():
            opt.state[p] = {"step": torch.tensor(float(start)), "exp_avg": torch.from_numpy(exp_avg[n].copy()),
                            "exp_avg_sq": torch.from_numpy(exp_avg_sq[n].copy())}
        for t in range(start + 1, start + window + 1):
            rate = lr_at(t)
            assert abs(train[t]["lr"] - rate) <= 1e-6 * rate, (t, train[t]["lr"], rate)
            for group in opt.param_groups:
                group["lr"] = rate
            loss = loss_of(model)
            opt.zero_grad()
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(list(named.values()), 1.0))
            opt.step()
            dl = abs(train[t]["loss"] - loss.item()) / loss.item()
            dg = abs(train[t]["grad_norm"] - grad_norm) / grad_norm
            first = "first_" if t == start + 1 else ""
            worst[first + "loss"] = max(worst[first + "loss"], dl)
            worst[first + "grad_norm"] = max(worst[first + "grad_norm"], dg)
        ours = state_at(start + window)[0]
        ref_change = np.concatenate([(p.detach().numpy() - params[n]).ravel() for n, p in named.items()])
        our_change = np.concatenate([(ours[n] - params[n]).ravel() for n in named])
        worst["update"] = max(worst["update"], np.linalg.norm(our_change - ref_change) / np.linalg.norm(ref_change))
    print("worst relative differences:", {k: f"{v:.2g}" for k, v in worst.items()})
    return worst


class SplitMix64:
    """A tiny seeded generator written out here (splitmix64), so that test data is the same bytes
    on every machine, CPython and NumPy version (``random`` and NumPy promise no such thing)."""

    MASK = (1 << 64) - 1

    def __init__(self, seed: int):
        self.state = seed & self.MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & self.MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def pick(self, seq):
        return seq[self.below(len(seq))]


_WORDS = ("data item value count index name path file line text token batch step rank size shape "
          "buffer state result config option key node graph model layer weight grad loss mean total "
          "start end offset length chunk block record entry field header reader writer cache queue "
          "parser stream source target module handler request response message error status limit").split()
_VERBS = "get set read write load save make build parse check update reset open close find apply".split()
_PROSE = ("Return the {a} of the {b}.", "Read one {a} from {b} and keep it.", "The {a} holds every {b}.",
          "Build the {a} for this {b}; raise when it is missing.", "A {a} per {b}, in order.",
          "Naïve {a} of the {b} (café, «{a}», ½ of it).", "Compute {a} → {b} once, then cache it.")


def _source_file(rng: SplitMix64, n_defs: int) -> str:
    """One Python-like module: imports, constants, functions and classes of a fixed little grammar."""
    w, v = (lambda: rng.pick(_WORDS)), (lambda: rng.pick(_VERBS))
    lines = [f'"""{rng.pick(_PROSE).format(a=w(), b=w())}"""', "", f"import {w()}", f"from {w()} import {w()}, {w()}",
             "", f"{w().upper()}_{w().upper()} = {rng.below(1000)}", ""]
    for _ in range(n_defs):
        indent = ""
        if rng.below(3) == 0:
            lines += ["", f"class {w().title()}{w().title()}:", f'    """{rng.pick(_PROSE).format(a=w(), b=w())}"""', ""]
            indent = "    "
        args = ", ".join(["self"] * (indent != "") + [w() for _ in range(rng.below(3) + 1)])
        lines += [f"{indent}def {v()}_{w()}({args}):",
                  f'{indent}    """{rng.pick(_PROSE).format(a=w(), b=w())}"""']
        for _ in range(rng.below(6) + 2):
            kind = rng.below(6)
            a, b, c = w(), w(), w()
            if kind == 0:
                lines += [f"{indent}    if {a} is None or {b} > {rng.below(100)}:", f"{indent}        {a} = {b}.{v()}_{c}()"]
            elif kind == 1:
                lines += [f"{indent}    for {a} in range(len({b})):", f"{indent}        {c}.append({b}[{a}] + {rng.below(10)})"]
            elif kind == 2:
                lines += [f"{indent}    # {rng.pick(_PROSE).format(a=a, b=b).lower()}"]
            elif kind == 3:
                lines += [f'{indent}    {a} = {{"{b}": {c}, "{w()}": {rng.below(256)}}}']
            elif kind == 4:
                lines += [f"{indent}    try:", f"{indent}        {a} = {v()}_{b}({c}, {w()}={rng.below(2) == 1})",
                          f"{indent}    except {rng.pick(['KeyError', 'ValueError', 'OSError'])}:",
                          f"{indent}        raise {w().title()}Error(f\"bad {b}: {{{c}!r}}\") from None"]
            else:
                lines += [f"{indent}    {a} = {b} * {rng.below(64)} + {c} // {rng.below(7) + 1}"]
        lines += [f"{indent}    return {w()}", ""]
    return "\n".join(lines) + "\n"


def synthetic_text_dir(dest, max_bytes=600_000, seed=0):
    """Write deterministic Python-like source files (``mod_NNN.py``, about 2-12 kB each, ``max_bytes``
    in all) into ``dest``: made by :class:`SplitMix64` from the word lists above, so the same bytes on
    any machine and any Python, unlike the running Python's standard library."""
    rng = SplitMix64(seed)
    os.makedirs(dest, exist_ok=True)
    total, i = 0, 0
    while total < max_bytes:
        text = _source_file(rng, rng.below(12) + 4).encode("utf-8")
        with open(os.path.join(dest, f"mod_{i:03d}.py"), "wb") as fh:
            fh.write(text)
        total, i = total + len(text), i + 1
    return dest


@pytest.fixture(scope="session")
def byte_dataset(tmp_path_factory):
    """A real token dataset (raw bytes of :func:`synthetic_text_dir`'s source) made by `trainrun-data`."""
    root = tmp_path_factory.mktemp("bytes_data")
    text = synthetic_text_dir(str(root / "text"))
    out = str(root / "data")
    run([TRAINRUN_DATA, "tokens", "--input", text, "--output", out, "--bytes", "--eval-fraction", "0.1"], check=0)
    return out


@pytest.fixture(scope="session")
def bpe_dataset(tmp_path_factory):
    """A token dataset with a byte-level BPE of 384 (DIR/tokenizer.json, end of document <|endoftext|>)."""
    root = tmp_path_factory.mktemp("bpe_data")
    text = synthetic_text_dir(str(root / "text"), max_bytes=200_000, seed=1)
    out = str(root / "data")
    run([TRAINRUN_DATA, "tokens", "--input", text, "--output", out, "--train-bpe", "384", "--eval-fraction", "0.1",
         "--no-progress"], check=0)
    return out


def write_config(path, data_dir, **sections):
    """A tiny GPT-2 run config over ``data_dir``; ``sections`` override whole keys (dotted names allowed)."""
    import yaml
    cfg = {
        "run": {"name": "t", "output_dir": str(os.path.join(os.path.dirname(str(path)), "run")), "seed": 5},
        "model": {"builtin": "gpt2", "gpt2": {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 32,
                                              "vocab_size": 512}},
        "data": {"train": os.path.join(data_dir, "train"), "eval": os.path.join(data_dir, "eval"), "seq_len": 32},
        "train": {"micro_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 20, "eval_every": 0,
                  "eval_steps": 2, "log_every": 1},
        "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1, "max_grad_norm": 1.0},
        "lr_schedule": {"name": "cosine", "warmup_steps": 5, "min_lr": 1e-4},
        "checkpoint": {"every": 0, "keep_last": 3},
        "tensorboard": {"enabled": False},
        # one intra-op thread per rank whatever the machine's core count (engine.threads 0 would pick
        # cores // local ranks): at more threads onnxruntime's CPU GatherGrad adds the embedding
        # gradient's rows in thread-arrival order, so runs are not bitwise reproducible
        "engine": {"threads": 1},
    }
    for key, value in sections.items():
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    with open(path, "w") as fh:
        yaml.safe_dump(cfg, fh)
    return str(path)


def read_metrics(run_dir):
    import json
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    train = {r["step"]: r for r in rows if "loss" in r}
    evals = {r["step"]: r for r in rows if "eval_loss" in r}
    return train, evals


def mpirun(n, *args, timeout=300, check=0, env=None):
    return run([MPIRUN, "-np", str(n), TRAINRUN, *args], timeout=timeout, check=check, env=env)


PROBE = os.path.join(ROOT, "tests", "rank_probe.py")


def mpirun_probe(n, *args, timeout=300, check=0, env=None, gather_piece=None):
    """:func:`mpirun` through tests/rank_probe.py: each rank prints its peak RSS at exit
    (``PEAK_RSS_KB <rank> <KiB>``); ``gather_piece``: ZeRO-1's checkpoints gather the optimizer state in
    pieces of that many elements."""
    env = dict(env or {}, **({"TRAINRUN_PROBE_GATHER_PIECE": str(gather_piece)} if gather_piece else {}))
    return run([MPIRUN, "-np", str(n), sys.executable, PROBE, *args], timeout=timeout, check=check, env=env)


def rank_pids(marker):
    """PIDs of the trainrun processes whose command line mentions ``marker``, by MPI rank."""
    pids = {}
    for env_path in glob.glob("/proc/[0-9]*/environ"):
        pid = int(env_path.split("/")[2])
        try:
            env = open(env_path, "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and "trainrun" in cmd:
            for item in env:
                if item.startswith(b"PMI_RANK="):
                    pids[int(item.split(b"=")[1])] = pid
    return pids
