"""The CUDA path's checks that a CPU runs (``make test``): what trainrun says and refuses before any GPU
work. The GPU itself is tests/test_gpu.py's (``make test-gpu``)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, TRAINRUN, run, write_config


def test_device_cuda_with_an_onnxruntime_lacking_the_cuda_provider_is_a_config_error(tmp_path, byte_dataset):
    """On Python 3.12 PyPI has only the CPU build of onnxruntime-training 1.19.2: validation names
    the wheel and the Python in use and says what to do (exit 2). The onnxruntime imported here is a
    stand-in that lists the CPU provider only, as that build does."""
    import onnxruntime
    fake = tmp_path / "ort" / "onnxruntime"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '1.19.2'\n"
                                      "def get_available_providers():\n    return ['CPUExecutionProvider']\n")
    cfg = write_config(tmp_path / "c.yaml", byte_dataset)
    cmd = [TRAINRUN, "config", "validate", "--config", cfg, "--set", "device=cuda"]
    proc = run(cmd, check=2, env={"PYTHONPATH": str(tmp_path / "ort")})
    py = f"Python {sys.version_info[0]}.{sys.version_info[1]}"
    for part in ("device:", "CUDAExecutionProvider", py, "it has CPUExecutionProvider", str(fake),
                 "exists for Python 3.10 and 3.11 only", "PYTHON=python3.11"):
        assert part in proc.stderr, (part, proc.stderr)
    assert "Traceback" not in proc.stderr
    # the onnxruntime installed here: accepted exactly when its build has the CUDA provider
    has_cuda = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    proc = run(cmd, check=0 if has_cuda else 2)
    assert ("CUDAExecutionProvider" in proc.stderr) != has_cuda, proc.stderr


BUILDS = {11: ("onnxruntime_training-1.19.2", "Name: onnxruntime-training\nVersion: 1.19.2\n", "libcudart.so.11.0"),
          12: ("onnxruntime_gpu-1.26.0", "Name: onnxruntime-gpu\nVersion: 1.26.0\n"
               "Requires-Dist: nvidia-cuda-runtime-cu12~=12.0; extra == \"cuda\"\n", "libcudart.so.12")}


def _broken_libcudart(tmp_path, major):
    """A site directory with the metadata of onnxruntime's CUDA ``major`` build, whose
    nvidia-cuda-runtime-cu<major> library is not a shared object."""
    dist, metadata, soname = BUILDS[major]
    (tmp_path / "site" / f"{dist}.dist-info").mkdir(parents=True)
    (tmp_path / "site" / f"{dist}.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\n" + metadata)
    lib = tmp_path / "site" / "nvidia" / "cuda_runtime" / "lib"
    lib.mkdir(parents=True)
    (lib / soname).write_bytes(b"not an ELF file\n")
    return str(tmp_path / "site"), str(lib / soname)


@pytest.mark.parametrize("major", [11, 12])
def test_a_cuda_library_that_fails_to_load_is_reported_not_counted_as_no_gpu(tmp_path, major):
    """cuda_device_count() reported 0 GPUs (every GPU test skipped, make test-gpu green) when a CUDA
    library failed to load; setup() then returned its partial result on the next call. The libraries
    are those of the installed onnxruntime's CUDA build: CUDA 11 for onnxruntime-training, CUDA 12 for
    onnxruntime-gpu 1.26 (read from its metadata)."""
    site, path = _broken_libcudart(tmp_path, major)
    code = ("from trainrun import comm; from trainrun.step import cuda\n"
            "from trainrun.errors import TrainrunError\n"
            "print('stack', cuda.stack())\n"
            "for f in (comm.cuda_device_count, cuda.setup):\n"
            "    try:\n        print('returned', f())\n"
            "    except TrainrunError as e:\n        print('raised', e)\n")
    proc = run([sys.executable, "-c", code], check=0, env={"PYTHONPATH": site})
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and lines[0] == f"stack {major}", proc.stdout
    for line in lines[1:]:           # both calls, the second one included
        assert line.startswith(f"raised cannot load {path} (pip package nvidia-cuda-runtime-cu{major})"), proc.stdout


def test_cuda_setup_sets_the_jit_environment_itself():
    """CUDA_MODULE_LOADING=LAZY and a 4 GiB CUDA_CACHE_MAXSIZE come from cuda.setup() (make test-gpu no
    longer sets them, so the GPU suite runs with what trainrun sets); a value already set is kept."""
    code = "import os; from trainrun.step import cuda; cuda.setup(); print(os.environ['CUDA_MODULE_LOADING'], " \
           "os.environ['CUDA_CACHE_MAXSIZE'])"
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_MODULE_LOADING", "CUDA_CACHE_MAXSIZE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["LAZY", str(4 << 30)]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "CUDA_MODULE_LOADING": "EAGER"},
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["EAGER", str(4 << 30)]


def test_make_test_gpu_fails_rather_than_skips_without_a_gpu(tmp_path):
    """TRAINRUN_REQUIRE_GPU=1 (set by make test-gpu) turns "no GPU" from a skip of every GPU test
    into a failure. No GPU is visible here (CUDA_VISIBLE_DEVICES empty hides any there is)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m", "gpu",
           os.path.join(ROOT, "tests", "test_gpu.py")]
    env = {"CUDA_VISIBLE_DEVICES": ""}
    skipped = run(cmd, env=env, cwd=str(tmp_path))
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    required = run(cmd, env={**env, "TRAINRUN_REQUIRE_GPU": "1"}, cwd=str(tmp_path))
    assert required.returncode != 0
    assert "TRAINRUN_REQUIRE_GPU=1, but the GPU tests cannot run" in required.stdout + required.stderr


def test_a_session_that_falls_back_to_the_cpu_names_the_missing_provider_libraries(tmp_path):
    """check_session on a real session that runs on the CPU provider: the error lists the libraries
    the CUDA provider links that are not pip-installed (cuDNN among them), not cupy's NVRTC."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from trainrun.step import cuda
    from trainrun.errors import TrainrunError
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    with pytest.raises(TrainrunError) as info:
        cuda.check_session(session, path, "train")
    msg = str(info.value)
    loaded = cuda.setup()
    provider = {11: ["libcudart.so.11.0", "libcublasLt.so.11", "libcublas.so.11", "libcufft.so.10", "libcurand.so.10",
                     "libcudnn.so.8", "libcudnn_ops_infer.so.8"],
                12: ["libcudart.so.12", "libcublasLt.so.12", "libcublas.so.12", "libcufft.so.11", "libcurand.so.10",
                     "libcudnn.so.9", "libcudnn_graph.so.9"]}[cuda.stack()]
    for soname in provider:
        assert (soname in msg) == (soname not in loaded), (soname, msg)
    assert f"pip install 'trainrun[{cuda.EXTRAS[cuda.stack()]}]'" in msg, msg
    assert "nvrtc" not in msg and "nccl" not in msg, msg


def test_nccl_gather_refuses_rather_than_gathering_nothing():
    """NCCLCommunicator.gather returned without gathering when counts was None."""
    from trainrun.comm import NCCLCommunicator
    with pytest.raises(NotImplementedError, match="gather runs on the mpi backend only"):
        NCCLCommunicator.gather(None, np.zeros(2, np.float32), np.zeros(4, np.float32), None)


# ----------------------------------------------------------------------------- the graphs for the CUDA provider

def _cuda_config(tmp_path, model: str, precision: str) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import squeezenet_digits as SQ
    import onnx
    cfgs = {"gpt2": {"builtin": "gpt2", "gpt2": {"n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 16,
                                                 "vocab_size": 64}},
            "bert": {"builtin": "bert", "bert": {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
                                                 "num_attention_heads": 2, "intermediate_size": 64,
                                                 "max_position_embeddings": 16}},
            "squeezenet": {"builtin": None, "onnx": str(tmp_path / "squeezenet.onnx"),
                           "loss": {"type": "cross_entropy", "logits": "logits", "labels": "labels"}}}
    if model == "squeezenet" and not (tmp_path / "squeezenet.onnx").exists():
        onnx.save(SQ.build(width=0.25, image_size=16, batchnorm=True), str(tmp_path / "squeezenet.onnx"))
    return {"model": cfgs[model], "data": {"seq_len": 16}, "train": {"micro_batch_size": 2, "precision": precision},
            "device": "cuda", "run": {"output_dir": str(tmp_path / f"{model}-{precision}")}}


@pytest.mark.parametrize("model", ["gpt2", "bert", "squeezenet"])
@pytest.mark.ort_training
def test_cuda_graphs_have_a_kernel_for_every_op_and_keep_the_fp32_islands(tmp_path, model):
    """prepare for device: cuda in fp32, fp16 and bf16 passes the kernel check, and in the saved train
    graph (what onnxruntime's pre-training optimisation left), and for fp16 also in the graph a session
    makes of it, the fp32 ops and their gradients compute in float32: onnxruntime's PropagateCastOps had moved attention Softmax and SoftmaxGrad to fp16, and
    the bf16 GELU's SigmoidGrad has no bfloat16 kernel (the session could not be created)."""
    import onnx
    from trainrun import config as C
    from trainrun.step import cuda_kernels as K
    from trainrun.graphs.casts import FP32_OPS
    from trainrun.graphs.manifest import prepare
    islands = FP32_OPS | {K.GRADIENTS[op] for op in FP32_OPS if op in K.GRADIENTS}
    for precision in ("fp32", "fp16", "bf16"):
        out = prepare(C.from_dict(_cuda_config(tmp_path, model, precision)))
        typed = K.node_types(onnx.load(os.path.join(out, "train.onnx")))
        missing = [(n.name, n.op_type, t) for n, t in typed if not K.has_kernel(n.op_type, t)]
        assert not missing, (precision, missing)
        ops = {(n.op_type, t) for n, t in typed}
        low = {"fp32": "float", "fp16": "float16", "bf16": "bfloat16"}[precision]
        assert any(t == low for _, t in ops), (precision, ops)          # it does compute in that type
        if precision != "fp32":
            assert not [(op, t) for op, t in ops if op in islands and t != "float"], (precision, ops)
            if model != "squeezenet":
                assert ("Softmax", "float") in ops and ("SoftmaxGrad_13", "float") in ops, ops
        if precision == "fp16" and model != "squeezenet":
            # and after onnxruntime's session optimisation (the engine's level, all), run here on the CPU
            # provider (fp16 loads there; bf16 does not): the islands stay float32
            import onnxruntime as ort
            so = ort.SessionOptions()
            so.log_severity_level = 3
            so.optimized_model_filepath = str(tmp_path / f"{model}-optimized.onnx")
            ort.InferenceSession(os.path.join(out, "train.onnx"), so, providers=["CPUExecutionProvider"])
            final = {(n.op_type, t) for n, t in K.node_types(onnx.load(so.optimized_model_filepath))}
            assert ("Softmax", "float") in final and ("SoftmaxGrad_13", "float") in final, final
            assert not [(op, t) for op, t in final if op in islands and t != "float"], final
        if model == "gpt2" and precision == "bf16":
            assert ("SigmoidGrad", "float") in ops and ("SigmoidGrad", "bfloat16") not in ops, ops


@pytest.mark.ort_training
def test_prepare_for_cuda_refuses_an_op_without_a_kernel_for_its_type(tmp_path):
    """A user model computing a Sigmoid in bfloat16 itself: its gradient, SigmoidGrad, has no bfloat16
    kernel in the CUDA provider. prepare says so before writing graphs (exit 2), naming node, op and
    type; the same model on the CPU prepares (the check is the CUDA provider's)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Cast", ["h"], ["hb"], to=TensorProto.BFLOAT16, name="to_bf16"),
             helper.make_node("Sigmoid", ["hb"], ["sb"], name="gate"),
             helper.make_node("Cast", ["sb"], ["logits"], to=TensorProto.FLOAT, name="to_fp32")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 3])],
                          [numpy_helper.from_array(np.ones((4, 3), np.float32), "W")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "user.onnx"))
    import yaml
    cfg = {"model": {"builtin": None, "onnx": "user.onnx", "inputs": ["x"]}, "run": {"output_dir": "run"},
           "device": "cuda"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = run([TRAINRUN, "prepare", "--config", str(tmp_path / "c.yaml")], check=2)
    assert "user.onnx: device: cuda, but onnxruntime-training 1.19.2's CUDA provider has no kernel" in proc.stderr
    assert "(trainrun/step/cuda_kernels.tsv)" in proc.stderr
    assert "train graph: node " in proc.stderr and "(SigmoidGrad, bfloat16)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "graphs" / "train.onnx").exists()
    run([TRAINRUN, "prepare", "--config", str(tmp_path / "c.yaml"), "--set", "device=cpu"], check=0)


def test_the_gpu_environment_check_refuses_torch_beside_onnxruntime(tmp_path):
    """make test-gpu's guard (cuda.environment_problem): in this venv, where torch is installed,
    importing onnxruntime-training imports torch, and the guard says so; in the same packages without
    torch (every site-packages entry but torch's, python -S) onnxruntime imports without it and the
    guard passes (where the onnxruntime has the CUDA provider)."""
    import sysconfig

    import onnxruntime
    code = "from trainrun.step.cuda import environment_problem; print(environment_problem())"
    site = sysconfig.get_paths()["purelib"]
    with_torch = run([sys.executable, "-c", code], check=0).stdout
    has_cuda = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    if not has_cuda:
        assert with_torch.startswith("device: cuda needs onnxruntime's CUDAExecutionProvider"), with_torch
        return
    if os.path.isdir(os.path.join(site, "torch")):
        assert with_torch.startswith("importing onnxruntime imports torch"), with_torch
    farm = tmp_path / "site"
    farm.mkdir()
    for name in os.listdir(site):
        if not name.startswith("torch") and not name.endswith(".pth"):
            os.symlink(os.path.join(site, name), farm / name)
    env = {"PYTHONPATH": os.pathsep.join([ROOT, str(farm)])}
    without = run([sys.executable, "-S", "-c", "import sys; " + code.replace("print(", "print('torch' in sys.modules, ")],
                  check=0, env=env).stdout
    assert without.split() == ["False", "None"], without
