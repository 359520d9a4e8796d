"""configs/shakespeare-char.yaml (nanoGPT's CPU shakespeare_char recipe) through scripts/bench/charlm.py, the
bench that times it beside nanoGPT: a short real round on a text made here, trainrun beside the PyTorch
stand-in, both learning the same characters."""

import glob
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, synthetic_text_dir


@pytest.mark.torch
def test_the_recipe_and_its_bench_run_beside_the_stand_in(tmp_path):
    files = sorted(glob.glob(os.path.join(synthetic_text_dir(str(tmp_path / "text"), max_bytes=120_000), "*.py")))
    text = tmp_path / "input.txt"
    text.write_text("".join(open(f).read() for f in files))
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench", "charlm.py"), "--text", str(text),
                           "--iters", "60", "--rounds", "1", "--work", str(tmp_path / "work"),
                           "--stand-in", "nanogpt,gpt2"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "work" / "results.json").read_text())
    trainrun, = report["results"]["trainrun"]
    nanogpt, = report["results"]["stand-in: nanoGPT's model (charlm_torch.py --arch nanogpt)"]
    gpt2, = report["results"]["stand-in: transformers' GPT-2 (charlm_torch.py --arch gpt2)"]
    assert "configs/shakespeare-char.yaml" in trainrun["command"] and "train.max_steps=60" in trainrun["command"]
    assert "--arch nanogpt" in nanogpt["command"] and "--arch gpt2" in gpt2["command"]
    # all three learn the characters: from ln(vocab) (4.4 here) to below 3.5 in 60 steps; the two stand-ins
    # are different models (nanoGPT's has no biases and the exact GELU), so their losses differ
    assert max(trainrun["eval_loss"], nanogpt["eval_loss"], gpt2["eval_loss"]) < 3.5, report["results"]
    assert nanogpt["eval_loss"] != gpt2["eval_loss"]
    assert set(report["wall_ratios"]) == {"stand-in: nanoGPT's model (charlm_torch.py --arch nanogpt)",
                                          "stand-in: transformers' GPT-2 (charlm_torch.py --arch gpt2)"}
    run = tmp_path / "work" / "runs" / "trainrun-r0"
    assert (run / "model.onnx").exists() and os.listdir(run / "checkpoints")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["tokens"] == 60 * 12 * 64 and summary["startup_s"] > 0
    assert "wall / trainrun wall" in proc.stdout
    # the CPU named past a hypervisor's bare "AMD EPYC": cpuid's family and model (and AMD's core generation)
    cpuinfo = open("/proc/cpuinfo").read()
    if "cpu family" in cpuinfo:
        assert " family " in report["machine"]["cpu"] and " model " in report["machine"]["cpu"], report["machine"]
        if "AuthenticAMD" in cpuinfo and any(f"cpu family\t: {f}" in cpuinfo for f in (25, 26)):
            assert "Zen " in report["machine"]["cpu"], report["machine"]
