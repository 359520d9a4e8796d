"""The exported model is written tensor by tensor from the checkpoint file: the same bytes as onnx's
own save of the model with the weights as initializers, without a second copy of the weights."""

import os
import tracemalloc

import onnx
import pytest
from onnx import numpy_helper

from conftest import TRAINRUN, run, write_config

SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 256, "n_positions": 32, "vocab_size": 512}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, byte_dataset):
    d = tmp_path_factory.mktemp("stream")
    cfg = write_config(d / "c.yaml", byte_dataset, **{"train.max_steps": 2, "model.gpt2": SHAPE,
                                                      "engine.threads": 1})
    run([TRAINRUN, "train", "--config", cfg], check=0)
    return d / "run" / "checkpoints" / "2"


def reference_model(ckpt, external: bool, path):
    """onnx.save of forward.onnx with the checkpoint's tensors as initializers (what export wrote before
    it streamed): numpy arrays from safetensors, numpy_helper.from_array, onnx.save."""
    from safetensors.numpy import load_file
    from trainrun.graphs.manifest import load_manifest
    from trainrun.graphs.onnx_edit import IR_VERSION
    loaded = load_file(str(ckpt / "model.safetensors"))
    order = [p["name"] for p in load_manifest(str(ckpt.parent.parent / "graphs"))["params"]]
    assert sorted(order) == sorted(loaded)
    weights = {n: loaded[n] for n in order}             # the parameters in the order of the manifest
    model = onnx.load(str(ckpt.parent.parent / "graphs" / "forward.onnx"))
    kept = [i for i in model.graph.input if i.name not in weights]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    model.graph.initializer.extend(numpy_helper.from_array(w, n) for n, w in weights.items())
    model.ir_version = min(model.ir_version, IR_VERSION)
    if external:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=os.path.basename(path) + ".data")
    else:
        onnx.save(model, str(path))
    return weights


def test_streamed_export_is_byte_identical_to_onnx_save(ckpt, tmp_path):
    reference_model(ckpt, False, tmp_path / "ref.onnx")
    run([TRAINRUN, "export", str(ckpt), "--output", str(tmp_path / "m.onnx")], check=0)
    assert (tmp_path / "m.onnx").read_bytes() == (tmp_path / "ref.onnx").read_bytes()


def test_external_data_layout_is_onnx_own(ckpt, tmp_path, monkeypatch):
    from trainrun.commands import export
    monkeypatch.setattr(export, "_EXTERNAL_DATA_BYTES", 0)      # a model above protobuf's limit, in small
    export.export_checkpoint(str(ckpt), str(tmp_path / "m.onnx"), echo=lambda *_: None)
    weights = reference_model(ckpt, True, tmp_path / "ref.onnx")
    ours, ref = onnx.load(str(tmp_path / "m.onnx")), onnx.load(str(tmp_path / "ref.onnx"))
    for m in (ours, ref):      # the arrays, by name, wherever they were stored
        assert {t.name: numpy_helper.to_array(t).tobytes() for t in m.graph.initializer if t.name in weights} \
            == {n: w.tobytes() for n, w in weights.items()}
    out_ext = [t for t in onnx.load(str(tmp_path / "m.onnx"), load_external_data=False).graph.initializer
               if t.data_location == onnx.TensorProto.EXTERNAL]
    info = [{e.key: e.value for e in t.external_data} for t in out_ext]
    # every weight of 1 KB or more in m.onnx.data, one after the other (the graph's own constants stay inline)
    assert sorted(t.name for t in out_ext) == sorted(n for n, w in weights.items() if w.nbytes >= 1024)
    assert {i["location"] for i in info} == {"m.onnx.data"}
    end = 0
    for i in info:
        assert int(i["offset"]) == end
        end += int(i["length"])
    assert end == os.path.getsize(tmp_path / "m.onnx.data")
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def traced_peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_export_holds_no_second_copy_of_the_weights(ckpt, tmp_path):
    from trainrun import checkpoint
    from trainrun.commands import export
    size = os.path.getsize(ckpt / "model.safetensors")        # 13 MB
    export.export_checkpoint(str(ckpt), str(tmp_path / "warm.onnx"), echo=lambda *_: None)   # imports done
    checksums = traced_peak(lambda: checkpoint.verify(str(ckpt)))      # its read buffers, whatever the model
    peak = traced_peak(lambda: export.export_checkpoint(str(ckpt), str(tmp_path / "m.onnx"), echo=lambda *_: None))
    # what Python allocates at once (numpy arrays, bytes, buffers) beyond the checksum pass: below half the
    # weights; the model built in memory (arrays, then its serialized bytes) takes at least twice them
    assert peak < checksums + size / 2, (peak, checksums, size)
