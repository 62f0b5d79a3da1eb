"""QNN export end to end: files, numerics in onnxruntime, and clear errors."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import graphbuild as gb
from examples import convnet, tiny_decoder
from graphbuild.targets.qnn.encodings import read_encodings
from tests.models import FakeQuantConvNet, LearnableFakeQuantNet

SAMPLE = (torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(5)),)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> gb.Cache:
    return gb.Cache(tmp_path_factory.mktemp("cache"))


def export(model, samples, out: Path, cache, fmt="onnx", **options) -> gb.ExportArtifacts:
    options.setdefault("check_numerics", True)
    return gb.export(
        model, samples, out, "model", format=fmt, options=gb.QnnOnnxOptions(**options), cache=cache
    )


def assert_numerics(art: gb.ExportArtifacts, steps: float = 2.0, sqnr: float = 40.0) -> None:
    report = art.report.extra["numerics"]
    assert report["outputs"], "the numerics check compared no output"
    for out in report["outputs"]:
        assert out["sqnr_db"] > sqnr, out
        if out["max_error_steps"] is not None:
            assert out["max_error_steps"] <= steps, out


def graph_tensor_names(model: onnx.ModelProto) -> set[str]:
    g = model.graph
    names = {i.name for i in g.input} | {o.name for o in g.output} | {i.name for i in g.initializer}
    for node in g.node:
        names.update(node.output)
    return names


def no_marker_left(model: onnx.ModelProto) -> bool:
    return all(n.domain != "graphbuild" for n in model.graph.node) and all(
        o.domain != "graphbuild" for o in model.opset_import
    )


# --------------------------------------------------------------------------- ConvNet


def test_convnet_w8a8_exports_onnx_encodings_and_lock(tmp_path, cache):
    model, samples = convnet.build()
    art = export(
        model, samples, tmp_path, cache, quantizer="w8a8", calibration=convnet.calibration()
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "graphbuild.lock.json",
        "model.encodings",
        "model.onnx",
    ]
    onnx_model = onnx.load(tmp_path / "model.onnx")
    assert no_marker_left(onnx_model)
    assert_numerics(art)
    lock = json.loads((tmp_path / "graphbuild.lock.json").read_text())
    assert set(lock["files"]) == {"model.onnx", "model.encodings"}
    assert lock["stages"]["capture"]["key"] == art.report["capture"].key


def test_convnet_w8a8_exports_onnx_qdq_that_runs_in_onnxruntime(tmp_path, cache):
    model, samples = convnet.build()
    art = export(
        model,
        samples,
        tmp_path,
        cache,
        "onnx_qdq",
        quantizer="w8a8",
        calibration=convnet.calibration(),
    )
    onnx_model = onnx.load(tmp_path / "model.onnx")
    ops = {n.op_type for n in onnx_model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert no_marker_left(onnx_model)
    assert_numerics(art)


def test_encodings_name_graph_tensors_one_entry_per_quantizer(tmp_path, cache):
    model = FakeQuantConvNet().eval()
    art = export(model, SAMPLE, tmp_path, cache)
    doc = json.loads((tmp_path / "model.encodings").read_text())
    entries = doc["activation_encodings"] + doc["param_encodings"]
    names = graph_tensor_names(onnx.load(tmp_path / "model.onnx"))
    assert all(e["name"] in names for e in entries)
    assert len(entries) == 4 + 3  # four activation quantizers, three weight quantizers
    assert {e["name"] for e in doc["param_encodings"]} == {
        "conv1.weight",
        "conv2.weight",
        "fc.weight",
    }
    assert_numerics(art)


@pytest.mark.parametrize("fmt", ["onnx", "onnx_qdq"])
def test_fake_quant_convnet_needs_no_quantize_stage(tmp_path, cache, fmt):
    art = export(FakeQuantConvNet().eval(), SAMPLE, tmp_path, cache, fmt)
    assert "quantize" not in art.report.statuses
    assert_numerics(art)


def test_learnable_fake_quant_model_exports(tmp_path, cache):
    model = LearnableFakeQuantNet().eval()
    art = export(model, (torch.randn(2, 16),), tmp_path, cache)
    doc = json.loads((tmp_path / "model.encodings").read_text())
    assert {e["name"] for e in doc["param_encodings"]} == {"fc1.weight"}
    for out in art.report.extra["numerics"]["outputs"]:
        assert out["sqnr_db"] > 40


def test_pt2e_converted_graph_exports_without_quantize_stage(tmp_path, cache):
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from graphbuild.targets.qnn.presets.quantizer import QnnQuantizer

    model, samples = convnet.build()
    gm = torch.export.export(model, samples).module()
    prepared = prepare_pt2e(gm, QnnQuantizer("w8a8"))
    for batch in convnet.calibration():
        prepared(*batch)
    converted = convert_pt2e(prepared, fold_quantize=False)
    art = export(converted, samples, tmp_path, cache)
    assert "quantize" not in art.report.statuses
    assert_numerics(art)


# --------------------------------------------------------------------------- decoder


@pytest.mark.parametrize("preset", ["w8a8", "w8a16", "w4a16"])
def test_tiny_decoder_passes_numerics_for_each_preset(tmp_path, cache, preset):
    model, samples = tiny_decoder.build()
    art = export(
        model, samples, tmp_path, cache, quantizer=preset, calibration=tiny_decoder.calibration()
    )
    assert_numerics(art)


@pytest.mark.parametrize("preset", ["w8a16", "w4a16"])
def test_tiny_decoder_a16_presets_export_qdq_at_opset_21(tmp_path, cache, preset):
    model, samples = tiny_decoder.build()
    art = export(
        model,
        samples,
        tmp_path,
        cache,
        "onnx_qdq",
        quantizer=preset,
        calibration=tiny_decoder.calibration(),
        opset=21,
    )
    onnx_model = onnx.load(tmp_path / "model.onnx")
    assert [o.version for o in onnx_model.opset_import if o.domain in ("", "ai.onnx")] == [21]
    assert_numerics(art)


# --------------------------------------------------------------------------- errors


def test_unknown_target_format_lists_known_ones(tmp_path):
    with pytest.raises(gb.ExportError, match="qnn/onnx_qdq"):
        gb.export(FakeQuantConvNet(), SAMPLE, tmp_path, "m", format="tflite", cache=False)


def test_model_name_with_path_separator_is_refused(tmp_path):
    with pytest.raises(gb.ExportError, match="path separator"):
        gb.export(FakeQuantConvNet(), SAMPLE, tmp_path, "sub/model", cache=False)


class Untraceable(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return x * 2
        return x


def test_untraceable_model_names_capture_and_keeps_torch_message(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(gb.StageError) as err:
        gb.export(Untraceable(), (torch.randn(3),), out, "m", cache=False)
    assert err.value.stage == "capture"
    assert "capture" in str(err.value)
    assert "data-dependent" in str(err.value).lower() or "guard" in str(err.value).lower()
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_int4_qdq_below_opset_21_says_the_minimum(tmp_path, cache):
    model, samples = tiny_decoder.build()
    with pytest.raises(gb.StageError, match="21"):
        export(
            model,
            samples,
            tmp_path,
            cache,
            "onnx_qdq",
            quantizer="w4a16",
            calibration=tiny_decoder.calibration(),
            opset=17,
            check_numerics=False,
        )
    assert not (tmp_path / "model.onnx").exists()


class UnknownQuantOp(torch.nn.Module):
    def forward(self, x):
        q = torch.ops.aten.quantize_per_tensor(x, 0.1, 0, torch.quint8)
        return q.dequantize()


def test_unknown_quantization_op_names_op_and_node(tmp_path):
    with pytest.raises(gb.StageError) as err:
        gb.export(UnknownQuantOp(), (torch.randn(4),), tmp_path, "m", cache=False)
    assert err.value.stage in ("capture", "normalize")
    assert "quantize" in str(err.value)


def test_failed_export_leaves_previous_outputs_untouched(tmp_path, cache):
    model = FakeQuantConvNet().eval()
    export(model, SAMPLE, tmp_path, cache)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    broken = copy.deepcopy(model)
    broken.fc = torch.nn.Linear(3, 3)  # shapes no longer fit: capture fails
    with pytest.raises(gb.StageError):
        export(broken, SAMPLE, tmp_path, cache)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_encodings_read_back_match_the_quantizers(tmp_path, cache):
    model = FakeQuantConvNet().eval()
    export(model, SAMPLE, tmp_path, cache, check_numerics=False)
    table = read_encodings(json.loads((tmp_path / "model.encodings").read_text()))
    w = table["conv1.weight"]
    assert torch.allclose(torch.from_numpy(w.scale), model.conv1_w_scale)
    assert w.granularity == "PER_CHANNEL"


def test_transformers_llama_exports_with_numerics(tmp_path, cache):
    pytest.importorskip("transformers", reason="builds a transformers model (the dev extra)")
    from examples import tiny_llama

    model, samples = tiny_llama.build()
    art = export(
        model, samples, tmp_path, cache, quantizer="w8a8", calibration=tiny_llama.calibration()
    )
    assert no_marker_left(onnx.load(tmp_path / "model.onnx"))
    assert_numerics(art)


@pytest.mark.parametrize("fmt", ["onnx", "onnx_qdq"])
def test_a_transformers_causal_lm_exports_its_logits_with_use_cache_left_on(tmp_path, cache, fmt):
    """A LlamaForCausalLM as transformers builds it (``use_cache`` at its default, a
    ``ModelOutput`` with a ``DynamicCache`` returned) exports without a logits-only wrapper:
    it is called with ``use_cache=False``, its one ONNX output is the logits, and the report
    names what of the ``ModelOutput`` was left out."""
    pytest.importorskip("transformers", reason="builds a transformers model (the dev extra)")
    import onnxruntime as ort
    from transformers import LlamaForCausalLM

    from examples import tiny_llama

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama.config(output_hidden_states=True)).eval()
    assert model.config.use_cache
    samples = (torch.randint(0, tiny_llama.VOCAB, (1, tiny_llama.SEQ)),)
    art = export(
        model,
        samples,
        tmp_path,
        cache,
        fmt,
        quantizer="w8a16",
        calibration=tiny_llama.calibration(),
    )
    graph = onnx.load(tmp_path / "model.onnx").graph
    assert len(graph.output) == 1
    dims = [d.dim_value for d in graph.output[0].type.tensor_type.shape.dim]
    assert dims == [1, tiny_llama.SEQ, tiny_llama.VOCAB]
    with torch.no_grad():
        expected = model(*samples, use_cache=False).logits.numpy()
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {graph.input[0].name: samples[0].numpy()})
    assert np.corrcoef(got.ravel(), expected.ravel())[0, 1] > 0.99
    assert_numerics(art, steps=math.inf, sqnr=20.0)
    note = art.report.extra["model_outputs"]
    assert note["kept"] == "logits"
    assert "hidden_states" in note["left_out"]
    assert "use_cache=False" in note["summary"]


# --------------------------------------------------------------------------- int32 biases


@pytest.mark.parametrize("fmt", ["onnx", "onnx_qdq"])
def test_2_0_0_int32_biases_are_input_scale_times_weight_scale_of_the_same_file(
    tmp_path, cache, fmt
):
    model, samples = convnet.build()
    art = export(
        model,
        samples,
        tmp_path,
        cache,
        fmt=fmt,
        quantizer="w8a16",
        calibration=convnet.calibration(),
        encodings_version="2.0.0",
    )
    assert_numerics(art)
    found = {
        e["name"]: e for e in json.loads((tmp_path / "model.encodings").read_text())["encodings"]
    }
    # conv1 reads the input, conv2 the first ReLU, fc the flattened second ReLU
    for layer in ("conv1", "conv2", "fc"):
        bias, weight = found[f"{layer}.bias"], found[f"{layer}.weight"]
        assert bias["output_dtype"] == "int32" and bias["axis"] == 0
        assert "y_zero_point" not in bias
        assert len(bias["y_scale"]) == len(weight["y_scale"])
    x_scale = found["x"]["y_scale"]
    expected = np.float32(x_scale) * np.asarray(found["conv1.weight"]["y_scale"], np.float32)
    assert found["conv1.bias"]["y_scale"] == expected.tolist()


def test_int32_bias_false_exports_no_bias_encodings(tmp_path, cache):
    model, samples = convnet.build()
    export(
        model,
        samples,
        tmp_path,
        cache,
        quantizer="w8a16",
        calibration=convnet.calibration(),
        encodings_version="2.0.0",
        int32_bias=False,
    )
    doc = json.loads((tmp_path / "model.encodings").read_text())
    assert not [e for e in doc["encodings"] if e["output_dtype"] == "int32"]


# --------------------------------------------------------------------------- QNN-faithful files


def preset_export(model, samples, out: Path, fmt="onnx", preset="w8a8", **options):
    return gb.export(
        model.eval(),
        samples,
        out,
        "model",
        format=fmt,
        options=gb.QnnOnnxOptions(quantizer=preset, calibration=[samples], **options),
        cache=False,
    )


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.fc(x)
        return {"logits": y.relu(), "hidden": y}


def test_graph_outputs_keep_the_model_names(tmp_path):
    model, samples = convnet.build()
    preset_export(model, samples, tmp_path / "a")
    assert [o.name for o in onnx.load(tmp_path / "a" / "model.onnx").graph.output] == ["output"]
    preset_export(TwoHeads(), (torch.randn(2, 8),), tmp_path / "b")
    graph = onnx.load(tmp_path / "b" / "model.onnx").graph
    assert [o.name for o in graph.output] == ["logits", "hidden"]


@pytest.mark.parametrize("names", [[""], ["out", "out"], "output"])
def test_empty_repeated_or_unlisted_io_names_are_a_config_error(names):
    with pytest.raises(gb.ConfigError, match="output_names"):
        gb.QnnOnnxOptions(output_names=names)


class Chunked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def test_chunk_is_one_split_not_a_sequence(tmp_path):
    art = preset_export(Chunked(), (torch.randn(1, 4, 8),), tmp_path, check_numerics=True)
    ops = {n.op_type for n in onnx.load(tmp_path / "model.onnx").graph.node}
    assert "Split" in ops and not ops & {"SplitToSequence", "SequenceAt"}
    assert art.report.extra["coverage"]["float"] == []
    assert art.report.extra["numerics"]["forced"]["max_error_steps"] <= 1


def test_a_tensor_with_several_readers_is_encoded_once_without_identity(tmp_path):
    from tests.test_quantize import Decoder

    torch.manual_seed(0)
    preset_export(Decoder(), (torch.randint(0, 64, (1, 8)),), tmp_path)
    graph = onnx.load(tmp_path / "model.onnx").graph
    doc = json.loads((tmp_path / "model.encodings").read_text())
    names = [e["name"] for s in ("activation_encodings", "param_encodings") for e in doc[s]]
    assert len(names) == len(set(names))
    identities = {o for n in graph.node if n.op_type == "Identity" for o in n.output}
    assert not identities & set(names)  # QNN may drop an Identity, and its encoding with it


@pytest.mark.parametrize("preset", ["w8a8", "w4a16"])
def test_qdq_weights_are_on_the_full_signed_grid_without_clamps(tmp_path, preset):
    model, samples = convnet.build()
    preset_export(model, samples, tmp_path, fmt="onnx_qdq", preset=preset)
    graph = onnx.load(tmp_path / "model.onnx").graph
    assert not {n.op_type for n in graph.node} & {"Clip", "Max", "Min"}
    doc = json.loads((tmp_path / "model.encodings").read_text())
    bits = 8 if preset == "w8a8" else 4
    for entry in doc["param_encodings"]:
        assert entry["is_sym"] and set(entry["offset"]) == {-(2 ** (bits - 1))}


def test_weight_scale_is_aimets_symmetric_scale(tmp_path):
    model, samples = convnet.build()
    preset_export(model, samples, tmp_path)
    doc = json.loads((tmp_path / "model.encodings").read_text())
    entry = next(e for e in doc["param_encodings"] if e["name"] == "conv1.weight")
    weight = model.conv1.weight.detach().reshape(8, -1)
    expected = torch.maximum(weight.amax(1).clamp(min=0) / 127, -weight.amin(1).clamp(max=0) / 128)
    assert entry["scale"] == pytest.approx(expected.tolist(), rel=1e-6)


class TiedEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.gelu(self.embed(ids)))


def test_a_tied_embedding_table_gets_one_initializer_per_role(tmp_path):
    """Read by Gather, the table is an activation; read by the output layer, a per-channel
    weight: two quantizers, two initializers (AIMET refuses one shared by both)."""
    torch.manual_seed(0)
    art = preset_export(TiedEmbedding(), (torch.randint(0, 32, (1, 6)),), tmp_path, preset="w8a16")
    assert art.report.extra["coverage"]["float"] == []
    doc = json.loads((tmp_path / "model.encodings").read_text())
    encoded = {e["name"]: e for s in ("activation_encodings", "param_encodings") for e in doc[s]}
    graph = onnx.load(tmp_path / "model.onnx").graph
    assert len(graph.initializer) == 2
    (gather,) = [n for n in graph.node if n.op_type == "Gather"]
    (transpose,) = [n for n in graph.node if n.op_type == "Transpose"]
    table, head = encoded[gather.input[0]], encoded[transpose.input[0]]
    assert (table["bw"], table["is_sym"], table["enc_type"]) == (16, False, "PER_TENSOR")
    assert (head["bw"], head["is_sym"], head["enc_type"]) == (8, True, "PER_CHANNEL")


@pytest.mark.parametrize("fmt", ["onnx", "onnx_qdq"])
def test_a_preset_export_measures_what_quantizing_cost_against_the_float_model(
    tmp_path, cache, fmt
):
    model, samples = convnet.build()
    sqnr = {}
    for preset in ("w8a16", "w4a16"):
        art = export(
            model,
            samples,
            tmp_path / preset,
            cache,
            fmt,
            quantizer=preset,
            calibration=convnet.calibration(),
        )
        report = art.report.extra["numerics"]
        assert report["reference"] == "quantized program"
        (out,) = report["outputs"]
        assert out["sqnr_db_vs_float"] < out["sqnr_db"]  # quantizing costs more than ORT vs torch
        assert out["max_abs_error_vs_float"] > 0
        sqnr[preset] = out["sqnr_db_vs_float"]
    assert sqnr["w4a16"] < sqnr["w8a16"]  # 4-bit weights cost more than 8-bit ones


def test_a_model_with_its_own_quantizers_is_measured_against_itself(tmp_path, cache):
    art = export(FakeQuantConvNet().eval(), SAMPLE, tmp_path, cache)
    report = art.report.extra["numerics"]
    assert report["reference"] == "torch model"
    assert all("sqnr_db_vs_float" not in out for out in report["outputs"])


def test_the_numerics_and_htp_checks_share_one_float_reference():
    from graphbuild.api import ExportRequest, build_pipeline

    options = gb.QnnOnnxOptions(quantizer="w8a16", check_numerics=True, check_htp=True)
    pipeline = build_pipeline(ExportRequest(None, None, "out", "model", options=options))

    assert pipeline.order().count("float_reference") == 1
    assert "float_reference" in pipeline.dependencies("check_numerics")
    readers = [s for s in pipeline.order() if "float_reference" in pipeline.dependencies(s)]
    assert len(readers) >= 2  # the numerics check and the HTP check
