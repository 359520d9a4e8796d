"""CUDA set-up for ``device: cuda`` (imported on the CUDA path only; imports neither cupy nor onnxruntime).

Two CUDA stacks, chosen by the onnxruntime installed (:func:`stack`):

- CUDA 11.8 (the ``gpu`` extra, Python 3.10-3.11): onnxruntime-training 1.19.2's CUDA provider
  (``libonnxruntime_providers_cuda.so``) needs libcudart.so.11.0, libcublas(Lt).so.11, libcudnn.so.8,
  libcufft.so.10 and libcurand.so.10; its RUNPATH is /usr/local/cuda-11.8/lib only.
- CUDA 12 (the ``gpu-cu12`` extra, any Python from 3.11): stock onnxruntime-gpu (1.20 to 1.26, the
  last PyPI builds for CUDA 12; 1.27 and later are CUDA 13 builds) needs libcudart.so.12,
  libcublas(Lt).so.12 and libcurand.so.10 at load time and opens cuDNN 9 (libcudnn.so.9, which opens
  its sub-libraries) and libcufft.so.11 by soname when first used. ``onnxruntime.preload_dlls``
  (onnxruntime-gpu >= 1.21) does what :func:`setup` does, for onnxruntime's libraries only.

Either extra installs the libraries as pip wheels (``nvidia-*-cu11`` / ``nvidia-*-cu12``, under
site-packages/nvidia/<lib>/lib), where neither the provider nor cupy looks: onnxruntime then silently
falls back to the CPU provider. :func:`setup` loads each of them by absolute path with RTLD_GLOBAL
before the first CUDA session or cupy kernel, so the loader's later look-ups by soname find the copy
already in the process (glibc matches a loaded object by its soname). NVRTC (cupy compiles its
elementwise kernels with it) and NCCL (cupy's binding) come the same way.

onnxruntime-training 1.19.2's kernels are built for sm_60, 61, 70, 75, 80 and 86, SASS and PTX (read
from the fat binaries of the wheel's provider library: 183 of them, no sm_89/sm_90 code). A newer GPU
(an H100 is sm_90) runs them by JIT-compiling the PTX at first use: :func:`setup` sets
``CUDA_MODULE_LOADING=LAZY`` (compile a module when first used, not all at context creation) and a
4 GiB ``CUDA_CACHE_MAXSIZE`` (the driver's JIT cache, ~/.nv/ComputeCache, default 256 MiB, too small
to keep them), unless the environment already sets them. Both must be set before CUDA is initialised
in the process, so every CUDA path calls :func:`setup` first.
"""

from __future__ import annotations

import ctypes
import glob
import os

from ..errors import TrainrunError

# per CUDA major: (package directory under site-packages/nvidia, sonames in load order: dependencies
# first; a name with * is a pattern)
STACKS = {
    11: (
        ("cuda_runtime", ["libcudart.so.11.0"]),
        ("cuda_nvrtc", ["libnvrtc.so.11.2", "libnvrtc-builtins.so.11.8"]),
        ("cublas", ["libcublasLt.so.11", "libcublas.so.11"]),
        ("cufft", ["libcufft.so.10"]),
        ("curand", ["libcurand.so.10"]),
        # libcudnn.so.8 dlopens its sub-libraries by soname at first use: load them all now
        ("cudnn", ["libcudnn_ops_infer.so.8", "libcudnn_ops_train.so.8", "libcudnn_cnn_infer.so.8",
                   "libcudnn_cnn_train.so.8", "libcudnn_adv_infer.so.8", "libcudnn_adv_train.so.8",
                   "libcudnn.so.8"]),
        ("nccl", ["libnccl.so.2"]),
    ),
    12: (
        ("cuda_runtime", ["libcudart.so.12"]),
        ("cuda_nvrtc", ["libnvrtc.so.12", "libnvrtc-builtins.so.12*"]),
        ("cublas", ["libcublasLt.so.12", "libcublas.so.12"]),
        ("nvjitlink", ["libnvJitLink.so.12"]),
        ("cufft", ["libcufft.so.11"]),
        ("curand", ["libcurand.so.10"]),
        # cuDNN 9: libcudnn.so.9 is a shim that opens libcudnn_graph.so.9 and the engines by soname
        ("cudnn", ["libcudnn_graph.so.9", "libcudnn_engines_precompiled.so.9",
                   "libcudnn_engines_runtime_compiled.so.9", "libcudnn_engines_tensor_ir.so.9",
                   "libcudnn_heuristic.so.9", "libcudnn_ops.so.9", "libcudnn_cnn.so.9", "libcudnn_adv.so.9",
                   "libcudnn.so.9"]),
        ("nccl", ["libnccl.so.2"]),
    ),
}
# the extra that installs each stack
EXTRAS = {11: "gpu", 12: "gpu-cu12"}
# the packages of the libraries onnxruntime's CUDA provider links (NVRTC and NCCL are cupy's)
PROVIDER_NEEDS = ("cuda_runtime", "cublas", "cudnn", "cufft", "curand", "nvjitlink")
ENVIRONMENT = {"CUDA_MODULE_LOADING": "LAZY", "CUDA_CACHE_MAXSIZE": str(4 << 30)}

_loaded: dict[str, str] | None = None


def stack() -> int:
    """The CUDA major of the installed onnxruntime's CUDA build, from the distributions' metadata
    (onnxruntime is not imported): onnxruntime-gpu's, as its ``cuda`` extra names nvidia-cuda-runtime;
    11 with onnxruntime-training (PyPI's CUDA build of 1.19.2 is CUDA 11.8); otherwise (a CPU build) 12,
    the stack of the ``gpu-cu12`` extra that replaces it."""
    import importlib.metadata as md
    import re
    try:
        for req in md.requires("onnxruntime-gpu") or []:
            m = re.match(r"nvidia-cuda-runtime(?:-cu\d+)?\s*~=\s*(\d+)", req)
            if m:
                return int(m.group(1))
    except md.PackageNotFoundError:
        pass
    for dist in ("onnxruntime-training", "onnxruntime-training-cpu"):
        try:
            md.version(dist)
            return 11
        except md.PackageNotFoundError:
            pass
    return 12


def libraries() -> tuple:
    """:data:`STACKS` of :func:`stack` (empty for a CUDA major trainrun has no table of)."""
    return STACKS.get(stack(), ())


def nvidia_dirs() -> list[str]:
    """The ``nvidia`` namespace package's directories (the ``nvidia-*-cu11/12`` wheels), if installed."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec else []


def setup() -> dict[str, str]:
    """Set the CUDA environment and load the pip-installed CUDA libraries of :func:`stack` (idempotent).
    Returns soname -> the path loaded. A library that is not pip-installed is left to the system's
    search path (a CUDA toolkit in /usr/local/cuda or on LD_LIBRARY_PATH)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    loaded = {}
    roots = nvidia_dirs()
    major = stack()
    for package, sonames in libraries():
        for soname in sonames:
            hits = sorted(p for r in roots for p in glob.glob(os.path.join(r, package, "lib", soname)))
            if not hits:
                continue
            try:
                ctypes.CDLL(hits[0], mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                raise TrainrunError(f"cannot load {hits[0]} (pip package nvidia-{package.replace('_', '-')}-cu"
                                    f"{major}): {exc}") from None
            loaded[os.path.basename(hits[0]) if "*" in soname else soname] = hits[0]
    _loaded = loaded        # only once every library is in: a failed set-up fails again when called again
    return _loaded


def cuda_provider_problem() -> str | None:
    """Why this Python's onnxruntime cannot run ``device: cuda`` (its build lacks the CUDA provider),
    or None. PyPI has onnxruntime-training 1.19.2's CUDA build for CPython 3.10 and 3.11 only: on
    3.12 the package installed is the CPU-only build, whatever the extras."""
    import sys
    try:
        import onnxruntime
    except ImportError as exc:
        return f"onnxruntime cannot be imported: {exc}"
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        return None
    import importlib.metadata
    wheel = ", ".join(importlib.metadata.packages_distributions().get("onnxruntime", ["?"]))
    py = ".".join(map(str, sys.version_info[:2]))
    return (f"needs onnxruntime's CUDAExecutionProvider, which the onnxruntime in use lacks ({wheel} "
            f"{getattr(onnxruntime, '__version__', '?')} at {os.path.dirname(onnxruntime.__file__)}, "
            f"Python {py}; it has {', '.join(onnxruntime.get_available_providers())}). onnxruntime-training "
            f"1.19.2's CUDA build exists for Python 3.10 and 3.11 only: create the venv with one of those "
            f"(make test-gpu PYTHON=python3.11) and install the gpu extra there; on any Python from 3.11, stock "
            f"onnxruntime-gpu for CUDA 12 replaces the onnxruntime in use (make test-gpu GPU=gpu-cu12); or "
            f"use device: cpu")


def environment_problem() -> str | None:
    """Why this Python cannot run ``device: cuda`` (``make test-gpu`` refuses it), or None: its
    onnxruntime lacks the CUDA provider, or importing onnxruntime-training imports torch (it does
    wherever torch is installed), whose own CUDA libraries would then load before :func:`setup`'s."""
    import sys

    problem = cuda_provider_problem()
    if problem:
        return "device: cuda " + problem
    if "torch" in sys.modules:
        return (f"importing onnxruntime imports torch ({sys.modules['torch'].__file__}), which loads CUDA "
                f"libraries of its own: use a venv without torch (make test-gpu makes .venv-gpu)")
    return None


def check_session(session, path: str, name: str) -> None:
    """TrainrunError unless onnxruntime ``session`` (asked for CUDA) really runs on the CUDA provider.

    onnxruntime drops a provider it cannot load (missing CUDA/cuDNN libraries) with a warning and
    runs on the CPU; a GPU bind then fails later with an obscure copy error."""
    active = session.get_providers()
    if "CUDAExecutionProvider" not in active:
        loaded = setup()
        major = stack()
        missing = [so for package, sonames in libraries() if package in PROVIDER_NEEDS
                   for so in sonames if "*" not in so and so not in loaded]
        needs = {11: "the CUDA 11.8 libraries (cudart 11, cublas 11, cudnn 8, cufft 10, curand 10)",
                 12: "the CUDA 12 libraries (cudart 12, cublas 12, cudnn 9, cufft 11, curand 10)"}
        wanted = (f"It needs {needs[major]}: pip install 'trainrun[{EXTRAS[major]}]'" if major in needs else
                  f"Its onnxruntime is a CUDA {major} build, which trainrun has no library list for: install "
                  f"onnxruntime-gpu for CUDA 12 (the gpu-cu12 extra)")
        raise TrainrunError(
            f"{path}: device: cuda, but onnxruntime runs the {name} graph on {', '.join(active)}: its CUDA "
            f"provider could not be loaded. {wanted}"
            + (f" (not pip-installed here: {', '.join(missing)})" if missing else "")
            + "; set log_level: devinfo to see onnxruntime's reason")


def synchronize() -> None:
    """Wait for the work queued on cupy's current stream (uploads, ``load_weights``, cupy kernels).

    onnxruntime computes on its own CUDA stream, which nothing orders after cupy's: a session run
    must not start before cupy's writes to its bound buffers are done. (When a run returns,
    onnxruntime has synchronized its own stream, so cupy may read the results.)"""
    import cupy
    cupy.cuda.get_current_stream().synchronize()
