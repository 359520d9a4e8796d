"""pyproject.toml and scripts/requirements.py: what a (non-editable) install holds, which onnxruntime each
Python gets, and the requirement lists make test-training, make test-gpu and make test-py313 install."""

import os
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import requirements as R  # noqa: E402

with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _fh:
    PYPROJECT = tomllib.load(_fh)


def test_every_package_directory_is_installed():
    """A wheel (pip install ., not -e) holds only the packages [tool.setuptools] lists: every directory
    with an __init__.py under the mapped package directories must be there."""
    tool = PYPROJECT["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for package, directory in tool["package-dir"].items():
        top = os.path.join(ROOT, directory)
        for here, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            if "__init__.py" in files:
                rel = os.path.relpath(here, top)
                found.add(package if rel == "." else package + "." + rel.replace(os.sep, "."))
    missing = {p for p in found if not any(p == q for q in listed)}
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {sorted(missing)}"


def _pinned(reqs):
    return {Requirement(r).name: Requirement(r) for r in reqs}


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12", "3.13", "3.14"])
def test_requires_python_admits(python):
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(python + ".0")


def test_onnxruntime_per_python():
    """Every Python: stock onnxruntime (>= 1.20, the first with the ops trainrun's builder writes on its CPU and
    CUDA providers) and an onnx with wheels for every Python trainrun admits; never onnxruntime-training."""
    import packaging.markers as M
    for python in ("3.10", "3.11", "3.12", "3.13", "3.14"):
        env = dict(M.default_environment(), python_version=python, python_full_version=python + ".0")
        names = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
        chosen = {r.name: r for r in names if not r.marker or r.marker.evaluate(env)}
        assert [n for n in chosen if n.startswith("onnxruntime")] == ["onnxruntime"], python
        ort = chosen["onnxruntime"].specifier
        assert ort.contains("1.32.0") and ort.contains("1.20.0") and not ort.contains("1.19.2"), python
        onnx = chosen["onnx"].specifier
        assert onnx.contains("1.23.2") and not onnx.contains("1.17.0"), (python, onnx)


@pytest.mark.parametrize("python,want", [("3.10", "onnxruntime-training"), ("3.11", "onnxruntime-training"),
                                         ("3.12", "onnxruntime-training-cpu"), ("3.13", None)])
def test_the_training_extra_replaces_the_default_onnxruntime(python, want, monkeypatch):
    """make test-training's list (the training extra): onnxruntime-training 1.19.2 and the onnx it reads (IR 10
    at most: 1.17) in place of the default's stock onnxruntime and onnx, never beside them; PyPI has no
    onnxruntime-training for 3.13, where the extra brings nothing and the default stays."""
    import packaging.markers as M
    env = dict(M.default_environment(), python_version=python, python_full_version=python + ".0")
    monkeypatch.setattr(R, "default_environment", lambda: env)
    reqs = _pinned(R.requirements(["training", "test"]))
    ort = [n for n in reqs if n.startswith("onnxruntime")]
    if want is None:
        assert ort == ["onnxruntime"] and reqs["onnx"].specifier.contains("1.23.2")
    else:
        assert ort == [want] and reqs[want].specifier.contains("1.19.2")
        assert reqs["onnx"].specifier.contains("1.17.0") and not reqs["onnx"].specifier.contains("1.18.0")
    assert "torch" in reqs and "pytest" in reqs and "numba" in reqs
    assert all(not Requirement(r).marker for r in R.requirements(["training", "test"]))


def test_requirement_lists():
    """The default list (make test's, the same as pip install -e '.[test]'): stock onnxruntime with the test
    extra's torch; make test-py313's: the test extra without torch; an unknown extra is an error."""
    here = _pinned(R.requirements(["test"]))
    assert not [n for n in here if n.startswith("onnxruntime-training")]
    assert here["onnxruntime"].specifier.contains("1.32.0") and not here["onnxruntime"].specifier.contains("1.19.2")
    assert "torch" in here and "pytest" in here and "numba" in here and "onnxscript" in here
    bare = _pinned(R.requirements(["test"], without=["torch", "Transformers", "onnxscript"]))
    assert "torch" not in bare and "transformers" not in bare and "onnxscript" not in bare and "pyarrow" in bare
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "requirements.py"), "nosuch"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "pyproject.toml has no extra nosuch" in proc.stderr


def test_onnxscript_installs_beside_the_pinned_onnx():
    """torch's default exporter (dynamo=True) needs onnxscript: the test extra's bound admits the release
    installed here, whose own onnx requirement admits the onnx installed here (the default's, or the training
    extra's 1.17.0 in make test-training)."""
    from importlib import metadata
    test = _pinned(R.requirements(["test"]))
    assert "onnxscript" in test
    try:
        version, requires = metadata.version("onnxscript"), metadata.requires("onnxscript") or []
    except metadata.PackageNotFoundError:
        pytest.skip("onnxscript is not installed here (make test-py313 leaves it out with torch)")
    assert test["onnxscript"].specifier.contains(version), version
    onnx_req = [Requirement(r) for r in requires if Requirement(r).name == "onnx"]
    pinned = test["onnx"].specifier
    assert onnx_req and all(r.specifier.contains(metadata.version("onnx")) for r in onnx_req)
    assert all(r.specifier.contains("1.17.0") for r in onnx_req) and pinned.contains("1.23.2")


def test_the_onnxruntime_in_use_reads_what_trainrun_writes():
    """The graphs trainrun writes carry IR 9 whatever onnx writes by default (onnx >= 1.18: IR 11, which
    onnxruntime 1.19 refuses): a session of the installed onnxruntime opens one."""
    import numpy as np
    from onnx import TensorProto, helper
    from trainrun.graphs import onnx_edit
    from trainrun.models import onnx_builder
    from trainrun.step.sessions import import_onnxruntime
    ort = import_onnxruntime()
    g = onnx_builder.Graph()
    y = g.op("Relu", ["x"])
    model = g.model("relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                    [helper.make_tensor_value_info(y, TensorProto.FLOAT, [2])])
    edited = onnx_edit.fresh(model, list(model.graph.node), list(model.graph.input), list(model.graph.output), [])
    for m in (model, edited):
        assert m.ir_version == 9
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        assert sess.run(None, {"x": np.array([-1.0, 2.0], np.float32)})[0].tolist() == [0.0, 2.0]


def test_gpu_cu12_replaces_the_cpu_onnxruntime():
    """make test-gpu GPU=gpu-cu12: onnxruntime-gpu's CUDA 12 builds (1.20-1.26; 1.27 and later are CUDA 13)
    in place of every other build of the `onnxruntime` import package, with cupy and NCCL for CUDA 12;
    the gpu extra brings onnxruntime-training's CUDA 11.8 build in place of the default's (Python 3.10-3.11)."""
    reqs = _pinned(R.requirements(["gpu-cu12"]))
    assert [n for n in reqs if n.startswith("onnxruntime")] == ["onnxruntime-gpu"]
    spec = reqs["onnxruntime-gpu"].specifier
    assert spec.contains("1.26.0") and spec.contains("1.20.0") and not spec.contains("1.27.0")
    assert {"cupy-cuda12x", "nvidia-nccl-cu12", "nvidia-cudnn-cu12", "nvidia-cuda-runtime-cu12"} <= set(reqs)
    assert not [n for n in reqs if n.endswith("-cu11") or n == "cupy-cuda11x"]
    cu11 = _pinned(R.requirements(["gpu"]))
    if sys.version_info < (3, 12):
        assert [n for n in cu11 if n.startswith("onnxruntime")] == ["onnxruntime-training"]
        assert "cupy-cuda11x" in cu11 and cu11["onnx"].specifier.contains("1.17.0")


def test_test_modules_import_torch_optionally():
    """make test-py313 runs the suite without torch and transformers: no test module may import them at
    its top (a collection error there); it takes them with pytest.importorskip (every test needs them)
    or conftest's optional() with the torch marker on the tests that do."""
    import ast
    heavy = {"torch", "transformers", "peft"}
    offenders = []
    for name in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(ROOT, "tests", name), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in tree.body:
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{name}:{node.lineno} imports {m}" for m in mods if m.split(".")[0] in heavy]
    assert not offenders, offenders
