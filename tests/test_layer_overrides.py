"""Per-layer overrides of a QNN preset: other bit-widths, or float, for the modules a pattern
matches; the encodings carry them, the coverage report expects them, and a bit-width override
changes values only (the ONNX exporter is cut off)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import graphbuild as gb
from examples import tiny_decoder
from graphbuild.errors import ConfigError, StageError
from graphbuild.targets.qnn import build_qnn_pipeline
from graphbuild.targets.qnn.presets.overrides import parse_layer_overrides


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return gb.Cache(tmp_path_factory.mktemp("cache"))


def export(tmp_path, cache, overrides, preset="w8a16", events=None, factory=None):
    model, samples = tiny_decoder.build()
    return gb.export(
        model,
        samples,
        tmp_path,
        "decoder",
        options=gb.QnnOnnxOptions(
            quantizer=preset,
            calibration=tiny_decoder.calibration(),
            check_numerics=True,
            layer_overrides=overrides,
        ),
        cache=cache,
        listeners=[events.append] if events is not None else (),
        pipeline_factory=factory,
    )


def encodings(art) -> tuple[dict[str, int], dict[str, int]]:
    doc = json.loads(art.files["encodings"].read_text())
    params = {e["name"]: e["bw"] for e in doc["param_encodings"]}
    acts = {e["name"]: e["bw"] for e in doc["activation_encodings"]}
    return params, acts


def test_a_float_override_leaves_the_modules_tensors_float(tmp_path, cache):
    art = export(tmp_path, cache, {"lm_head": "float"})

    params, acts = encodings(art)
    assert "lm_head.weight" not in params and "output" not in acts
    assert any(name.startswith("blocks.0.mlp") for name in params)  # the rest as before
    coverage = art.report.extra["coverage"]
    assert {e["tensor"] for e in coverage["overridden"]} == {"lm_head.weight", "output"}
    assert "lm_head.weight" not in {e["tensor"] for e in coverage["float"]}
    assert art.report.extra["numerics"]["outputs"][0]["sqnr_db"] > 30


def test_bit_width_overrides_change_the_matched_weights_and_activations_only(tmp_path, cache):
    base_params, base_acts = encodings(export(tmp_path / "base", cache, None))
    art = export(tmp_path / "w4", cache, {"blocks.*.mlp.*": "w4", "blocks.1.attn.*": "a8"})

    params, acts = encodings(art)
    mlp = {n: b for n, b in params.items() if ".mlp." in n}
    assert len(mlp) == 6 and set(mlp.values()) == {4}
    assert {n: b for n, b in params.items() if n not in mlp} == {
        n: b for n, b in base_params.items() if n not in mlp
    }  # the attention's weights, norms and constants as before
    assert acts.keys() == base_acts.keys()
    changed = {n for n in acts if acts[n] != base_acts[n]}
    assert changed and {acts[n] for n in changed} == {8}
    assert {n for n in acts if acts[n] == 16} == set(acts) - changed
    overridden = {e["tensor"] for e in art.report.extra["coverage"]["overridden"]}
    assert overridden == set(mlp) | changed


def test_a_bit_width_override_reruns_values_and_cuts_off_the_onnx_exporter(tmp_path, cache):
    export(tmp_path, cache, None)
    events: list = []

    report = export(tmp_path, cache, {"blocks.0.mlp.*": "w4"}, events=events).report

    assert report.statuses["capture"] == "hit"
    assert "quantize" not in report.statuses  # the preset's split, not PT2E in one stage
    assert report.statuses["quant_map"] == "ran"
    assert report.statuses["to_onnx"] in ("hit", "cutoff")


#: the stages that trace (torch.export, the ONNX exporter's input) or run calibration batches
TRACE_AND_CALIBRATION = ("capture", "place_quantizers", "weight_stats", "calibrate")


def oracle(request):
    """PT2E prepare, calibrate and convert in one ``quantize`` stage: what the split must
    write, byte for byte."""
    return build_qnn_pipeline(request, one_stage_oracle=True)


def files(art) -> dict[str, bytes]:
    return {k: Path(v).read_bytes() for k, v in art.files.items() if k != "lock"}


@pytest.mark.parametrize(
    "overrides",
    [
        {"blocks.0.mlp.*": "w4", "blocks.1.attn.*": "a8"},
        {"lm_head": "float", "blocks.1.mlp.down": "float"},
        {"blocks.0.attn.*": "float", "blocks.1.*": "w4a16"},
    ],
    ids=["bits", "float", "both"],
)
def test_a_layer_override_change_reruns_no_trace_and_no_calibration(tmp_path, overrides):
    cache = gb.Cache(tmp_path / "cache")
    export(tmp_path / "out", cache, None)

    art = export(tmp_path / "out", cache, overrides)

    statuses = art.report.statuses
    assert all(statuses[s] in ("hit", "cutoff") for s in TRACE_AND_CALIBRATION), statuses
    assert "quantize" not in statuses
    golden = export(tmp_path / "one", False, overrides, factory=oracle)
    assert "quantize" in golden.report.statuses
    assert files(art) == files(golden)
    assert art.report.extra["numerics"] == golden.report.extra["numerics"]
    assert art.report.extra["coverage"] == golden.report.extra["coverage"]


def test_two_patterns_with_different_settings_for_one_tensor_are_an_error(tmp_path, cache):
    with pytest.raises(StageError) as err:
        export(tmp_path, cache, {"blocks.0.*": "w4", "blocks.0.mlp.*": "float"})

    assert isinstance(err.value.cause, ConfigError)
    assert "'blocks.0.*'" in str(err.value) and "'blocks.0.mlp.*'" in str(err.value)


@pytest.mark.parametrize(
    ("setting", "message"),
    [("w3", "4 or 8 bits"), ("a4", "8 or 16 bits"), ("half", "expected 'float'"), (8, "string")],
)
def test_a_setting_that_is_not_one_is_a_config_error(setting, message):
    with pytest.raises(ConfigError, match=message):
        parse_layer_overrides({"lm_head": setting})


def test_overrides_need_a_preset():
    with pytest.raises(ConfigError, match="set a preset"):
        gb.QnnOnnxOptions(layer_overrides={"lm_head": "float"})


def test_presets_and_combined_settings_parse():
    parsed = parse_layer_overrides({"a": "w4a16", "b": "A8", "c": "float", "d": "w8a8"})

    assert (parsed["a"].weight_bits, parsed["a"].activation_bits) == (4, 16)
    assert (parsed["b"].weight_bits, parsed["b"].activation_bits) == (None, 8)
    assert parsed["c"].float
    assert parsed["d"].weight_bits == 8


class Branch(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.conv, self.scale = nn.Conv2d(3, 4, 3, padding=1), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) * self.scale


class TwoBranches(nn.Module):
    """Two branches concatenated: their outputs share the Concat output's encoding (as HTP
    requires), the first branch's range a quarter of the second's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Branch(0.25), Branch(1.0)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.a(x), self.b(x)], dim=1))


def concat_export(out, overrides, factory=None):
    torch.manual_seed(0)
    model = TwoBranches().eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(1, 3, 8, 8, generator=g),) for _ in range(2)]
    options = gb.QnnOnnxOptions(quantizer="w8a16", calibration=batches, layer_overrides=overrides)
    return gb.export(
        model, batches[0], out, "m", options=options, cache=False, pipeline_factory=factory
    )


def concat_encodings(art) -> dict[str, tuple]:
    doc = json.loads(art.files["encodings"].read_text())
    return {e["name"]: (e["scale"], e["offset"]) for e in doc["activation_encodings"]}


def test_a_float_override_of_one_tensor_of_a_shared_encoding_keeps_the_others(tmp_path):
    """The second branch float: the first branch and the Concat keep their shared encoding,
    calibrated as PT2E's shared observer sees it with the branch float (the Concat holds
    every value, so the range stays)."""
    base = concat_encodings(concat_export(tmp_path / "base", None))
    assert base["mul"] == base["mul_1"] == base["cat"]  # one encoding for the three

    split = concat_export(tmp_path / "split", {"b": "float"})
    golden = concat_export(tmp_path / "one", {"b": "float"}, oracle)

    assert "quantize" in golden.report.statuses and "quantize" not in split.report.statuses
    assert files(split) == files(golden)
    acts = concat_encodings(split)
    assert "mul_1" not in acts and acts["mul"] == acts["cat"] == base["cat"]


def test_a_float_override_of_the_tensor_others_share_an_encoding_with_floats_them_all(
    tmp_path,
):
    """The first branch's output is the tensor the rules give the shared encoding to: float,
    it takes the Concat and the other branch with it, as PT2E's annotation does."""
    split = concat_export(tmp_path / "split", {"a": "float"})
    golden = concat_export(tmp_path / "one", {"a": "float"}, oracle)

    assert files(split) == files(golden)
    assert not {"mul", "mul_1", "cat"} & set(concat_encodings(split))


def test_a_preset_quantizer_made_with_overrides_quantizes_in_the_split(tmp_path):
    """``QnnQuantizer("w8a16", {...})`` is the preset with those overrides: the split, as the
    option gives them, and the coverage report expects them."""
    from graphbuild.targets.qnn.presets.quantizer import QnnQuantizer

    model, samples = tiny_decoder.build()
    options = gb.QnnOnnxOptions(
        quantizer=QnnQuantizer("w8a16", {"lm_head": "float"}),
        calibration=tiny_decoder.calibration(),
    )
    art = gb.export(model, samples, tmp_path / "own", "decoder", options=options, cache=False)
    given = export(tmp_path / "option", False, {"lm_head": "float"})

    assert "place_quantizers" in art.report.statuses
    assert art.files["encodings"].read_bytes() == given.files["encodings"].read_bytes()
    overridden = {e["tensor"] for e in art.report.extra["coverage"]["overridden"]}
    assert overridden == {"lm_head.weight", "output"}
