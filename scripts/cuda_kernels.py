"""Derive a kernel table of trainrun/: the element types an onnxruntime build's CUDA provider has a kernel
for, per op. Run once per onnxruntime build (needs binutils' strings and c++filt), from the provider library
of its wheel (unzip it: no GPU and no install needed):

    python scripts/cuda_kernels.py .venv/lib/python3.11/site-packages/onnxruntime/capi/libonnxruntime_providers_cuda.so \
        "onnxruntime-training 1.19.2" > trainrun/step/cuda_kernels.tsv
    python scripts/cuda_kernels.py onnxruntime_gpu-1.26.0/onnxruntime/capi/libonnxruntime_providers_cuda.so \
        "onnxruntime-gpu 1.26.0" > trainrun/step/cuda_kernels_gpu.tsv

The provider library is stripped of symbols, but keeps the RTTI type names of its kernel classes
(``N11onnxruntime4cuda11SigmoidGradIfEE`` = ``onnxruntime::cuda::SigmoidGrad<float>``): a kernel
class templated on its element type is instantiated once per type it registers. A class whose first
template argument is not an element type, or that is not a template (it takes its types from its
type constraints: Reshape, Transpose, SoftmaxGrad, ...), gets ``*`` (not checked). The class name is
the op's name except where :data:`OPS` says otherwise. What this cannot see: the opset versions of a
kernel (a type registered for some versions only counts for all) and the op's domain.
"""

import re
import subprocess
import sys

TYPES = {"float": "float", "double": "double", "onnxruntime::MLFloat16": "float16",
         "onnxruntime::BFloat16": "bfloat16"}
FLOATS = set(TYPES.values())
# kernel class -> the ops it implements, where the names differ
OPS = {"LayerNorm": ["LayerNormalization", "SimplifiedLayerNormalization"],
       "Pow_7": ["Pow"], "Clip_6": ["Clip"], "Split_2_13": ["Split"], "Split_18": ["Split"],
       "Reshape_1": ["Reshape"], "OneHotOp": ["OneHot"], "IsFiniteOp": ["IsFinite"],
       "IsAllFiniteOp": ["IsAllFinite"], "BatchNorm": ["BatchNormalization"],
       "InstanceNorm": ["InstanceNormalization"], "IdentityOp": ["Identity"],
       "SkipLayerNorm": ["SkipLayerNormalization", "SkipSimplifiedLayerNormalization"],
       "EmbedLayerNorm": ["EmbedLayerNormalization"], "SoftmaxGrad": ["SoftmaxGrad", "SoftmaxGrad_13"], "Softmax": ["Softmax", "LogSoftmax"],
       "Pool/AveragePool": ["AveragePool", "GlobalAveragePool"],
       "Pool/MaxPool": ["MaxPool", "GlobalMaxPool"]}
NAME = re.compile(r"^N11onnxruntime(?:7contrib)?4cuda\d+\w+")


def split_args(args: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in args:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "<"
        depth -= ch == ">"
        cur += ch
    return out + [cur.strip()] if cur.strip() else out


def main(library: str, build: str) -> None:
    names = subprocess.run(["strings", "-n", "8", library], capture_output=True, text=True, check=True).stdout
    rtti = sorted({"_ZTS" + s for s in names.split() if NAME.match(s)})
    demangled = subprocess.run(["c++filt"], input="\n".join(rtti), capture_output=True, text=True,
                               check=True).stdout.splitlines()
    table: dict[str, set] = {}
    for line in demangled:
        name = line.removeprefix("typeinfo name for ")
        m = re.fullmatch(r"onnxruntime::(?:contrib::)?cuda::(\w+)(?:<(.*)>)?", name)
        if not m:
            continue
        cls, args = m.group(1), split_args(m.group(2) or "")
        if cls == "Pool" and len(args) > 1:
            cls += "/" + re.sub(r"<.*", "", args[1]).split("::")[-1]
        dtype = TYPES.get(args[0]) if args else None
        if args and dtype is None and args[0] not in TYPES and re.fullmatch(r"[\w: ]+", args[0]) \
                and args[0] in ("bool", "int", "long", "signed char", "unsigned char", "short", "unsigned short",
                                "unsigned int", "unsigned long", "onnxruntime::Float8E4M3FN",
                                "onnxruntime::Float8E5M2"):
            continue                      # an integer instantiation: the float types are what is checked
        for op in OPS.get(cls, [cls]):
            table.setdefault(op, set()).add(dtype or "*")
    print(f"# op\tfloat element types with a CUDA kernel in {build} (* = not checked); "
          "made by scripts/cuda_kernels.py")
    for op in sorted(table):
        types = table[op]
        print(f"{op}\t{'*' if '*' in types else ','.join(sorted(types))}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "onnxruntime-training 1.19.2")
