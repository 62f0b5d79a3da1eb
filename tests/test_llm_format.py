"""The qnn target's llm format: part graphs that generate the model's own tokens, built as
independent cached parts, and bad input refused before any work."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import graphbuild as gb
from graphbuild.engine.events import StageStatus
from graphbuild.errors import ConfigError
from graphbuild.targets.qnn.llm.adapters import find_causal_lm
from graphbuild.targets.qnn.llm.ort_runner import onnx_caller
from graphbuild.targets.qnn.llm.plan import make_plan
from graphbuild.targets.qnn.llm.runner import PartRunner
from tests.llm_models import FAMILIES, PROMPT, causal_lm, export_llm, greedy_tokens, min_margin

pytest.importorskip("transformers", reason="builds transformers causal LMs (the dev extra)")

GEOMETRY = dict(prompt_len=4, context_len=64, parts=3)
EXAMPLES = Path(__file__).parent.parent / "examples"


def _export(model, out: Path, cache: Path, **options):
    return export_llm(model, out, cache, {**GEOMETRY, **options})


def _ran(artifacts) -> set[str]:
    return {s.name for s in artifacts.report.stages if s.status is StageStatus.RAN}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_part_modules_generate_the_models_greedy_tokens(family: str) -> None:
    """The protocol itself: prompt chunks of N (the last padded), then one token at a time,
    the KV cache right-aligned in CL - N slots; float, so token for token."""
    model = causal_lm(family)
    lm = find_causal_lm(model)
    plan = make_plan(lm, prompt_len=4, context_len=64, parts=3, max_part_bytes=None, quantizer=None)
    got = PartRunner(lm, plan.specs, 4, 64).generate(PROMPT, 32)
    assert min_margin(got.logits) >= 0.025  # no near-tie: the comparison means something
    assert got.tokens == greedy_tokens(model, PROMPT, 32)


def _onnx_runner(model, out: Path) -> tuple[PartRunner, dict]:
    lm = find_causal_lm(model)
    plan = make_plan(lm, prompt_len=4, context_len=64, parts=3, max_part_bytes=None, quantizer=None)
    call, encodings = onnx_caller(out, plan)
    return PartRunner(lm, plan.specs, 4, 64, kv_encodings=encodings, caller=call), encodings


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3"])
def test_a_float_export_with_a_16_bit_kv_cache_generates_transformers_tokens(
    family: str, tmp_path: Path
) -> None:
    """Tied embeddings (Qwen2), q/k norms (Qwen3) and fused projections (Phi-3): the placed
    graphs, run in onnxruntime, generate transformers' tokens, 32 of them."""
    model = causal_lm(family)
    expected = greedy_tokens(model, PROMPT, 32)
    out = tmp_path / "out"
    # the KV ranges of the sequence generated (a range too narrow clips, whatever the bits)
    calibration = [torch.tensor([PROMPT + expected])]
    _export(model, out, tmp_path / "cache", kv_bits=16, calibration=calibration)
    runner, encodings = _onnx_runner(model, out / "cpu")
    assert {e.bits for e in encodings.values()} == {16}
    assert runner.generate(PROMPT, 32).tokens == expected


def test_the_graphs_with_an_8_bit_kv_cache_generate_what_the_parts_do_on_its_grid(
    tmp_path: Path,
) -> None:
    """One encoding per KV tensor, declared in the graph, shared by the past input and the new
    output: the graphs generate the torch parts' tokens with the cache on those grids."""
    model = causal_lm("qwen3")
    out = tmp_path / "out"
    _export(model, out, tmp_path / "cache", kv_bits=8)
    runner, encodings = _onnx_runner(model, out / "cpu")
    assert sorted(encodings) == sorted(
        f"past_{kind}_{layer}" for layer in range(3) for kind in ("key", "value")
    )
    assert {(e.bits, e.zero_point) for e in encodings.values()} == {(8, 128)}
    lm = find_causal_lm(model)
    reference = PartRunner(lm, runner.specs, 4, 64, kv_encodings=encodings)
    assert runner.generate(PROMPT, 32).tokens == reference.generate(PROMPT, 32).tokens


def test_the_export_places_a_prompt_and_a_token_graph_per_part(tmp_path: Path) -> None:
    """With an integer KV cache (kv_bits, or a preset): the graphs the HTP runs."""
    out = tmp_path / "out"
    _export(causal_lm("llama"), out, tmp_path / "cache", kv_bits=8)
    graphs = sorted(p.name for p in (out / "cpu").glob("*_of_3.onnx"))
    assert graphs == [
        f"{kind}_ar{n}_cl64_{i}_of_3.onnx"
        for kind, n in (("prompt", 4), ("token", 1))
        for i in (1, 2, 3)
    ]


def test_a_warm_export_is_all_hits(tmp_path: Path) -> None:
    model = causal_lm("llama")
    cold = _export(model, tmp_path / "out", tmp_path / "cache")
    warm = _export(model, tmp_path / "out", tmp_path / "cache")
    assert len(_ran(cold)) == len(cold.report.stages)
    assert _ran(warm) == set()


def test_a_weight_change_in_one_layer_rebuilds_only_the_part_that_holds_it(
    tmp_path: Path,
) -> None:
    """Layer 2 is the last part's (3 layers in parts 2 and 3: layers 0-1 and 2). Its graphs
    rebind; the other parts' graphs and every trace stay hits."""
    model = causal_lm("llama")
    _export(model, tmp_path / "out", tmp_path / "cache")
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight.mul_(1.5)
    ran = _ran(_export(model, tmp_path / "out", tmp_path / "cache"))
    rebuilt_parts = {s.split(".")[0] for s in ran if s.endswith((".bind", ".graph"))}
    assert rebuilt_parts == {"p3"}
    assert not [s for s in ran if s.endswith((".capture", ".to_onnx", ".lower_markers"))]


def test_a_structure_change_in_one_layer_retraces_only_the_part_that_holds_it(
    tmp_path: Path,
) -> None:
    """An attribute of layer 2's attention (the last part's) is structure: that part's graphs
    trace again, the other parts' stay hits."""
    model = causal_lm("llama")
    _export(model, tmp_path / "out", tmp_path / "cache")
    model.model.layers[2].self_attn.note = "retuned"
    ran = _ran(_export(model, tmp_path / "out", tmp_path / "cache"))
    traced = {s.split(".")[0] for s in ran if s.endswith(".capture")}
    assert traced == {"p3"}


def test_a_preset_change_recomputes_values_and_traces_nothing(tmp_path: Path) -> None:
    model = causal_lm("qwen3", layers=2)
    _export(model, tmp_path / "out", tmp_path / "cache", quantizer="w8a16")
    ran = _ran(_export(model, tmp_path / "out", tmp_path / "cache", quantizer="w8a8"))
    assert {s for s in ran if s.endswith(".qparams")}
    traced = [
        s
        for s in ran
        if s.endswith((".capture", ".to_onnx", ".place_quantizers", ".calibrate", ".marker_graph"))
    ]
    assert traced == []


def test_a_new_prompt_length_retraces_the_prompt_graphs_only(tmp_path: Path) -> None:
    model = causal_lm("llama", layers=2)
    _export(model, tmp_path / "out", tmp_path / "cache", kv_bits=8)
    ran = _ran(_export(model, tmp_path / "out", tmp_path / "cache", kv_bits=8, prompt_len=8))
    captured = {s for s in ran if s.endswith(".capture")}
    assert captured == {"p1.prompt.capture", "p2.prompt.capture", "p3.prompt.capture"}


# --------------------------------------------------------------------------- bad input


def _refused(tmp_path: Path, model=None, data=None, **options) -> str:
    model = model if model is not None else causal_lm("llama", layers=2)
    data = data if data is not None else (torch.tensor([PROMPT]),)
    with pytest.raises(ConfigError) as err:
        gb.export(
            model,
            data,
            tmp_path / "out",
            "lm",
            target="qnn",
            format="llm",
            options={**GEOMETRY, **options},
            cache=tmp_path / "cache",
        )
    assert not (tmp_path / "out").exists()
    return str(err.value)


def test_a_model_that_is_not_a_causal_lm_is_refused(tmp_path: Path) -> None:
    message = _refused(tmp_path, model=torch.nn.Linear(4, 4))
    assert "causal LM" in message and "onnx_qdq" in message


def test_a_family_without_an_adapter_names_how_to_register_one(tmp_path: Path) -> None:
    model = causal_lm("llama", layers=2)
    model.config.model_type = "newfamily"
    message = _refused(tmp_path, model=model)
    assert "newfamily" in message and "register_adapter" in message


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"prompt_len": 64, "context_len": 64}, "less than context_len"),
        ({"prompt_len": 40, "context_len": 64}, "twice prompt_len"),
        ({"kv_bits": 4}, "kv_bits"),
        ({"parts": 4}, "at most 3 parts"),
        ({"parts": None, "max_part_bytes": 1000}, "alone weighs"),
    ],
)
def test_bad_options_are_refused_before_any_work(tmp_path: Path, options: dict, words: str) -> None:
    assert words in _refused(tmp_path, **options)


def test_a_part_over_the_size_limit_says_how_many_parts_would_fit(tmp_path: Path) -> None:
    model = causal_lm("llama", layers=4)
    one_layer = sum(p.numel() for p in model.model.layers[0].parameters()) * 2
    message = _refused(tmp_path, model=model, parts=2, max_part_bytes=int(one_layer * 1.5))
    assert "part 2 of 2" in message and "parts" in message


def test_calibration_batches_must_be_token_ids(tmp_path: Path) -> None:
    message = _refused(tmp_path, quantizer="w8a16", calibration=[(torch.randn(1, 4, 64),)])
    assert "token ids" in message and "calibration batch 0" in message


# --------------------------------------------------------------------------- the CPU bundle


def test_the_cpu_bundle_is_a_folder_of_graphs_processor_and_genai_config(tmp_path: Path) -> None:
    """With an 8-bit KV cache: genai's windowed cache over the prompt and token graphs (the
    float bundle is tests/test_llm_float.py's)."""
    out = tmp_path / "out"
    _export(causal_lm("llama", layers=2), out, tmp_path / "cache", kv_bits=8)
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    graphs = [
        f"cpu/{kind}_ar{n}_cl64_{i}_of_3.onnx"
        for kind, n in (("prompt", 4), ("token", 1))
        for i in (1, 2, 3)
    ]
    assert names == sorted(
        [*graphs, "cpu/genai_config.json", "cpu/position-processor.onnx", "graphbuild.lock.json"]
    )
    config = json.loads((out / "cpu" / "genai_config.json").read_text())
    entries = list(config["model"]["decoder"]["pipeline"][0])
    assert entries[0] == "position-processor"
    assert entries[1:3] == ["prompt_ar4_cl64_1_of_3", "token_ar1_cl64_1_of_3"]
    assert config["model"]["decoder"]["sliding_window"]["window_size"] == 4


def test_a_re_export_with_other_parts_leaves_no_graph_of_the_old_split(tmp_path: Path) -> None:
    """The bundle's folder belongs to the export: replaced whole, nothing of the old split
    left for genai to load by mistake."""
    model = causal_lm("llama", layers=2)
    out = tmp_path / "out"
    _export(model, out, tmp_path / "cache", kv_bits=8)
    _export(model, out, tmp_path / "cache", kv_bits=8, parts=2)
    assert sorted(p.name for p in (out / "cpu").glob("*_of_*.onnx")) == [
        "prompt_ar4_cl64_1_of_2.onnx",
        "prompt_ar4_cl64_2_of_2.onnx",
        "token_ar1_cl64_1_of_2.onnx",
        "token_ar1_cl64_2_of_2.onnx",
    ]


def test_the_tutorial_bundle_generates_transformers_32_tokens(tmp_path: Path) -> None:
    """examples/llm.toml's model, exported as the README does: onnxruntime-genai (graphbuild's
    onnxruntime runner where genai is not installed, named in the report) generates
    transformers' own greedy tokens from the CPU bundle (no preset: the float one)."""
    tiny_qwen = _example("tiny_qwen")
    model, data = tiny_qwen.build()
    artifacts = gb.export(
        model,
        data,
        tmp_path / "out",
        "tiny_qwen",
        target="qnn",
        format="llm",
        options=dict(
            prompt_len=16,
            context_len=128,
            parts=3,
            check_numerics=True,
            calibration=tiny_qwen.calibration(),
        ),
        cache=tmp_path / "cache",
    )
    report = artifacts.report.extra["numerics"]
    assert report["equal"], report["summary"]
    assert report["tokens"] == greedy_tokens(model, data[0][0].tolist(), 32)
    assert min(report["sqnr_db"]) > 20


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_quantized_bundle_reports_where_its_tokens_part_from_transformers(tmp_path: Path) -> None:
    model = causal_lm("llama", layers=2)
    artifacts = _export(
        model, tmp_path / "out", tmp_path / "cache", quantizer="w8a16", check_numerics=True
    )
    report = artifacts.report.extra["numerics"]
    assert report["reference_tokens"] == greedy_tokens(model, PROMPT, 32)[: len(report["tokens"])]
    if not report["equal"]:
        diff = report["first_difference"]
        assert report["tokens"][: diff["step"]] == report["reference_tokens"][: diff["step"]]
        assert diff["reference_lead"] >= 0 and diff["bundle_lead"] >= 0
        assert f"step {diff['step']}" in report["summary"]
    compared = (
        report["first_difference"]["step"] + 1 if not report["equal"] else len(report["tokens"])
    )
    assert len(report["sqnr_db"]) == compared  # the steps both sides generated from one context


def test_sample_inputs_must_be_a_prompt_of_token_ids(tmp_path: Path) -> None:
    message = _refused(tmp_path, data=(torch.randn(1, 9),))
    assert "token ids" in message and "sample inputs" in message


def test_graphbuild_generate_prints_the_bundles_tokens(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime_genai", reason="runs the bundle (the llm extra)")
    from typer.testing import CliRunner

    from graphbuild.cli.app import app

    out = tmp_path / "out"
    _export(causal_lm("llama", layers=2), out, tmp_path / "cache")
    prompt = " ".join(map(str, PROMPT))
    result = CliRunner().invoke(app, ["generate", str(out / "cpu"), "--prompt", prompt, "-n", "8"])
    assert result.exit_code == 0, result.output
    tokens = [int(t) for t in result.output.split()]
    assert 1 <= len(tokens) <= 8
    bad = CliRunner().invoke(app, ["generate", str(out / "cpu"), "--prompt", "five"])
    assert bad.exit_code == 2 and "token ids" in bad.output


def _concat_steps(graph: Path) -> dict[str, float]:
    """The quantization step of each Concat's output in ``graph``: the KV cache's concat of
    the past and the new keys or values, among others."""
    import onnx
    from onnx import numpy_helper

    nodes = onnx.load(str(graph)).graph
    scales = {t.name: t for t in nodes.initializer}
    scales |= {n.output[0]: n.attribute[0].t for n in nodes.node if n.op_type == "Constant"}
    concats = {n.output[0] for n in nodes.node if n.op_type == "Concat"}
    return {
        n.input[0]: float(numpy_helper.to_array(scales[n.input[1]]))
        for n in nodes.node
        if n.op_type == "QuantizeLinear" and n.input[0] in concats
    }


@pytest.mark.slow
def test_a_moving_average_keeps_the_kv_concats_range_from_an_empty_cache(tmp_path: Path) -> None:
    """The prompt graph's first calibration call sees an empty KV cache (zeros) beside the
    new keys, both in the concat's one quantizer: a moving average over each sighting
    started from that zero and kept 1/60 of the keys' range (QNN's preparer then never
    finished, or crashed, on such a part). Averaged over calibration batches, each concat's
    step stays near its min/max one."""
    model = causal_lm("llama", layers=2)
    g = torch.Generator().manual_seed(0)
    calibration = [torch.randint(3, 256, (1, 12), generator=g) for _ in range(2)]
    steps = {}
    for method in ("minmax", "moving_average"):
        out = tmp_path / method
        _export(
            model,
            out,
            tmp_path / "cache",
            quantizer="w8a8",
            calibration=calibration,
            range_method=method,
        )
        steps[method] = _concat_steps(out / "cpu" / "prompt_ar4_cl64_3_of_3.onnx")
    assert len(steps["minmax"]) >= 2 and steps["moving_average"].keys() == steps["minmax"].keys()
    for name, step in steps["minmax"].items():
        assert steps["moving_average"][name] > 0.5 * step, (name, steps)
