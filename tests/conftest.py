"""Shared test helpers: paths to the venv's tools and a subprocess runner with a timeout."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
TRAINRUN = os.path.join(BIN, "trainrun")
TRAINRUN_DATA = os.path.join(BIN, "trainrun-data")
MPIRUN = os.path.join(BIN, "mpirun")


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
