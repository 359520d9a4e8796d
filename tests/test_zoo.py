"""A subset of the model zoo (scripts/zoo.py: models nobody here wrote, exported by torch, one SGD step through
the real CLI with trainrun's own builder, each parameter's gradient read back from the checkpoint against torch
autograd in float64, within 8x torch's own float32-vs-float64 difference on the same model and inputs; the
script's docstring defines the bound). One transformers decoder and one encoder classifier, a ResNet-like CNN
with BatchNorm, a MobileNetV3 block (HardSwish, HardSigmoid, depthwise conv), a TransformerEncoderLayer, an MLP
of ELU/SELU/Softplus/Mish, a CumSum/Einsum/Tile model (by both exporters: the legacy one writes its Tile with
two Ifs), a bidirectional LSTM and a text CNN, over both exporters. The whole zoo, with the cases that do not
train yet: ``python scripts/zoo.py`` (docs/zoo.md)."""

import importlib.util
import sys

import pytest

from conftest import ROOT, optional

torch = optional("torch")
if torch is None or optional("transformers") is None:
    pytest.skip("needs torch and transformers (the test extra), not installed here", allow_module_level=True)

sys.path.insert(0, f"{ROOT}/scripts")
import zoo  # noqa: E402  (the zoo's models, export, run and comparison)

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too

CASES = [("qwen2", "dynamo"), ("gpt2", "dynamo"), ("distilbert_cls", "legacy"), ("resnet_bn", "dynamo"),
         ("mobilenetv3_block", "dynamo"), ("transformer_encoder_layer", "dynamo"), ("mlp_activations", "legacy"),
         ("cumsum_einsum_tile", "dynamo"), ("cumsum_einsum_tile", "legacy"), ("lstm_bi", "legacy"),
         ("conv1d_text", "dynamo")]


@pytest.mark.torch
@pytest.mark.process
@pytest.mark.parametrize("name,exporter", CASES, ids=[f"{n}-{e}" for n, e in CASES])
def test_zoo_model_trains_with_torchs_gradients(tmp_path, name, exporter):
    if exporter == "dynamo" and importlib.util.find_spec("onnxscript") is None:
        pytest.skip("torch.onnx.export(dynamo=True) needs onnxscript (the test extra), not installed here")
    [outcome] = zoo.check(name, exporter, ("trainrun",), folder=tmp_path)
    assert outcome.status == "exact", (outcome.status, outcome.detail)
    assert outcome.err <= 1.0


def test_a_changed_gradient_is_found():
    """The comparison is not blind: a read-back gradient equal to torch's float32 one is exact; one element off by
    twice the bound differs, naming the tensor."""
    import numpy as np
    rng = np.random.default_rng(0)
    before = {"w": rng.normal(0, 1, (3, 4)).astype(np.float32)}
    g64 = {"w": rng.normal(0, 1e-2, (3, 4))}
    g32 = {"w": g64["w"].astype(np.float32).astype(np.float64)}
    after = (before["w"] - g64["w"].astype(np.float32)).astype(np.float32)
    assert zoo.compare({"w": after}, {"w": before["w"]}, before, g64, g32)[0] == "exact"
    scale = np.abs(g64["w"]).max()
    noise = np.abs(zoo.read_back(before["w"], g32["w"]) - g64["w"]).max()
    off = after.copy()
    off[1, 2] -= 2 * max(zoo.FACTOR * noise, zoo.FLOOR * scale)
    status, detail, worst = zoo.compare({"w": off}, {"w": before["w"]}, before, g64, g32)
    assert status == "differs" and detail.startswith("w: err") and worst > 1
