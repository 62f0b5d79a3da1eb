"""The llm format's HTP bundles (``contexts = true``): one weight-shared QNN context binary per
part holding its prompt and token graphs, the onnxruntime-genai and Genie configurations that
run them, prepared as cached stages."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from graphbuild.engine.events import StageStatus
from graphbuild.errors import ConfigError
from tests.llm_models import PROMPT, causal_lm, export_llm

pytest.importorskip("transformers", reason="builds transformers causal LMs (the dev extra)")

GEOMETRY = dict(prompt_len=4, context_len=64, parts=3, contexts=True, htp_arch="v73")
#: Wide enough that each part's weights (1 to 3 MiB quantized) outweigh the fixed bytes of a
#: QNN context (about 80 KiB): the tiny default model's binaries are mostly that overhead, so
#: their size could not tell one copy of the weights from two.
WIDE = dict(hidden=256, intermediate=1024, vocab=4096)
GRAPHS = [
    f"{kind}_ar{n}_cl64_{i}_of_3" for i in (1, 2, 3) for kind, n in (("prompt", 4), ("token", 1))
]
BINS = [f"lm_part_{i}_of_3.bin" for i in (1, 2, 3)]


def _backend_reason() -> str:
    try:
        from graphbuild.targets.qnn.htp_runtime import availability
    except ImportError as exc:  # pragma: no cover - part of graphbuild
        return str(exc)
    found = availability()
    return "" if found.available else found.reason


needs_htp = pytest.mark.skipif(bool(_backend_reason()), reason=_backend_reason() or "available")


def _export(model, out: Path, cache: Path, **options):
    return export_llm(model, out, cache, {**GEOMETRY, "quantizer": "w8a16", **options})


def _ran(artifacts) -> set[str]:
    return {s.name for s in artifacts.report.stages if s.status is StageStatus.RAN}


def _quantized_weight_bytes(models: list[Path]) -> int:
    """One copy of the graphs' weights as the HTP stores them: a float initializer that a
    QuantizeLinear quantizes counts at its quantized width (the zero point's type), any other
    initializer at its own bytes; each distinct content once, across the graphs."""
    sizes: dict[str, int] = {}
    for path in models:
        graph = onnx.load(str(path)).graph
        inits = {t.name: t for t in graph.initializer}
        width = {}
        for node in graph.node:
            if node.op_type == "QuantizeLinear" and node.input[0] in inits and len(node.input) > 2:
                zp = inits[node.input[2]]
                width[node.input[0]] = np.dtype(helper.tensor_dtype_to_np_dtype(zp.data_type))
        for name, t in inits.items():
            array = numpy_helper.to_array(t)
            key = hashlib.sha256(f"{t.data_type}:{list(t.dims)}:".encode() + array.tobytes())
            itemsize = width[name].itemsize if name in width else array.dtype.itemsize
            sizes[key.hexdigest()] = array.size * itemsize
    return sum(sizes.values())


def _files(out: Path) -> list[str]:
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def wide_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if _backend_reason():
        pytest.skip(_backend_reason())
    tmp = tmp_path_factory.mktemp("wide")
    _export(causal_lm("llama", layers=2, **WIDE), tmp / "out", tmp / "cache")
    return tmp / "out"


@needs_htp
def test_the_bundles_hold_each_parts_contexts_and_the_runtimes_configs(wide_export: Path) -> None:
    htp = {f"htp/{g}.onnx" for g in GRAPHS} | {f"htp/{b}" for b in BINS}
    htp |= {"htp/genai_config.json", "htp/position-processor.onnx"}
    genie = {f"genie/{b}" for b in BINS} | {
        "genie/genie_config.json",
        "genie/htp_backend_ext_config.json",
    }
    files = [f for f in _files(wide_export) if not f.startswith("cpu/")]
    assert files == sorted({*htp, *genie, "graphbuild.lock.json"})


@needs_htp
def test_each_part_has_one_binary_of_about_one_copy_of_its_weights(wide_export: Path) -> None:
    from graphbuild.targets.qnn.htp_runtime.context import context_binaries

    out = wide_export
    for i, binary in enumerate(BINS, start=1):
        names = [f"{kind}_ar{n}_cl64_{i}_of_3" for kind, n in (("prompt", 4), ("token", 1))]
        for name in names:  # each EPContext model names the part's binary, beside it
            assert context_binaries(out / "htp" / f"{name}.onnx") == [binary]
        weights = _quantized_weight_bytes([out / "cpu" / f"{n}.onnx" for n in names])
        size = (out / "htp" / binary).stat().st_size
        assert weights > 1 << 19, weights  # far above a context's own bytes
        assert size < 1.5 * weights, (binary, size, weights)
        assert (out / "genie" / binary).read_bytes() == (out / "htp" / binary).read_bytes()


@needs_htp
def test_genai_runs_the_contexts_on_the_htp_and_genie_names_the_binaries(
    wide_export: Path,
) -> None:
    genai = json.loads((wide_export / "htp" / "genai_config.json").read_text())
    pipeline = genai["model"]["decoder"]["pipeline"][0]
    assert list(pipeline) == ["position-processor", *GRAPHS]
    for name in GRAPHS:
        assert pipeline[name]["filename"] == f"{name}.onnx"
        (qnn,) = pipeline[name]["session_options"]["provider_options"]
        assert qnn["qnn"]["htp_arch"] == "73"
        # the backend by its file name, found on the runtime's library path: no path of the
        # machine that built the bundle
        assert qnn["qnn"]["backend_path"] == "libQnnHtp.so"
    assert (wide_export / "htp" / "position-processor.onnx").read_bytes() == (
        wide_export / "cpu" / "position-processor.onnx"
    ).read_bytes()
    genie = json.loads((wide_export / "genie" / "genie_config.json").read_text())
    assert genie["dialog"]["engine"]["model"]["binary"]["ctx-bins"] == BINS
    ext = json.loads((wide_export / "genie" / "htp_backend_ext_config.json").read_text())
    assert ext["devices"][0]["dsp_arch"] == "v73"


@needs_htp
def test_a_warm_re_export_is_all_hits(tmp_path: Path) -> None:
    model = causal_lm("llama", layers=2)
    cold = _export(model, tmp_path / "out", tmp_path / "cache")
    assert {"p1.context.v73", "htp_bundle", "genie_bundle"} <= _ran(cold)
    warm = _export(model, tmp_path / "out", tmp_path / "cache")
    assert _ran(warm) == set()


@needs_htp
def test_a_one_layer_weight_change_re_prepares_that_parts_context_alone(tmp_path: Path) -> None:
    """Layer 1 is the last part's (part 1 the embedding, part 2 layer 0, part 3 layer 1 and
    the head)."""
    model = causal_lm("llama", layers=2)
    _export(model, tmp_path / "out", tmp_path / "cache")
    before = (tmp_path / "out" / "htp" / "lm_part_3_of_3.bin").read_bytes()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    ran = _ran(_export(model, tmp_path / "out", tmp_path / "cache"))
    assert {s for s in ran if ".context." in s} == {"p3.context.v73"}
    assert (tmp_path / "out" / "htp" / "lm_part_3_of_3.bin").read_bytes() != before


def test_an_arch_without_weight_sharing_is_refused_before_any_stage(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _export(causal_lm("llama", layers=2), tmp_path / "out", tmp_path / "cache", htp_arch="v69")
    assert "v69" in str(err.value) and "contexts = false" in str(err.value)
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.json"))


@pytest.mark.parametrize("option", ["contexts", "check_htp"])
def test_the_htp_without_a_preset_is_refused_before_any_stage(tmp_path: Path, option: str) -> None:
    """The HTP runs the quantized part graphs: with no preset there are none to prepare."""
    with pytest.raises(ConfigError) as err:
        _export(
            causal_lm("llama", layers=2),
            tmp_path / "out",
            tmp_path / "cache",
            quantizer=None,
            **{"contexts": False, option: True},
        )
    assert option in str(err.value) and "w8a16" in str(err.value)
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.json"))


@needs_htp
def test_the_part_graphs_on_the_htp_simulator_generate_what_they_do_on_the_cpu(
    tmp_path: Path,
) -> None:
    """The QDQ part graphs the contexts are prepared from, each compiled on its own for v73
    (the x86 simulator cannot load a weight-shared binary), generate the CPU's 12 greedy
    tokens through the llm format's runner."""
    from graphbuild.targets.qnn.arch.targets import HtpTarget
    from graphbuild.targets.qnn.htp_runtime import open_session
    from graphbuild.targets.qnn.llm.adapters import find_causal_lm
    from graphbuild.targets.qnn.llm.ort_runner import onnx_caller
    from graphbuild.targets.qnn.llm.plan import make_plan
    from graphbuild.targets.qnn.llm.runner import PartRunner

    model = causal_lm("llama", layers=2)
    _export(model, tmp_path / "out", tmp_path / "cache")
    lm = find_causal_lm(model)
    plan = make_plan(
        lm, prompt_len=4, context_len=64, parts=3, max_part_bytes=None, quantizer="w8a16"
    )
    target = HtpTarget.of("v73")

    def generate(factory) -> tuple[list[int], np.ndarray]:
        call, kv = onnx_caller(tmp_path / "out" / "cpu", plan, session_factory=factory)
        runner = PartRunner(lm, plan.specs, 4, 64, kv_encodings=kv, caller=call)
        out = runner.generate(PROMPT, 12)
        return out.tokens, torch.stack(list(out.logits)).numpy()

    cpu_tokens, cpu_logits = generate(None)
    htp_tokens, htp_logits = generate(lambda path: open_session(path, target).session)
    assert htp_tokens == cpu_tokens
    error = htp_logits - cpu_logits
    sqnr = 10 * np.log10(np.sum(cpu_logits**2) / np.sum(error**2))
    assert sqnr > 20, sqnr


@needs_htp
@pytest.mark.parametrize("preset", ["w4a16", "w8a16"])
def test_qk_norm_parts_compile_on_the_htp_fully_quantized(tmp_path: Path, preset: str) -> None:
    """Qwen3's per-head q/k norms, 4- and 8-bit weights: every part's graphs compile into their
    weight-shared context with CPU fallback disabled, and QNN takes no tensor the preset
    quantizes as float (strict coverage fails the export otherwise)."""
    artifacts = _export(
        causal_lm("qwen3", layers=2),
        tmp_path / "out",
        tmp_path / "cache",
        quantizer=preset,
        strict_coverage=True,
    )
    coverage = artifacts.report.extra["coverage"]
    assert coverage["quantized"] == coverage["expected"] > 0 and coverage["float"] == []
    bins = sorted(p.name for p in (tmp_path / "out" / "htp").glob("*.bin"))
    assert bins == [f"lm_part_{i}_of_3.bin" for i in (1, 2, 3)]


@needs_htp
def test_check_htp_reports_the_htps_tokens_against_the_cpu_graphs(tmp_path: Path) -> None:
    """--check-htp for the llm format: the part graphs generate on the HTP simulator (a context
    per graph, which the report says) and on the CPU; the report gives both and where they
    part, if they do, with each side's lead there."""
    artifacts = _export(
        causal_lm("llama", layers=2),
        tmp_path / "out",
        tmp_path / "cache",
        contexts=False,
        check_htp=True,
    )
    report = artifacts.report.extra["htp"]
    assert "weight-shared binary" in report["contexts"]
    assert len(report["tokens"]) == 16 and len(report["cpu_tokens"]) == 16
    floats = report["sqnr_db_vs_float"]
    assert len(floats["htp"]) == len(floats["cpu"]) >= 1
    # QNN's 16-bit kernels round otherwise than onnxruntime's CPU: each is held to the float
    # model, the HTP within 3 dB of the CPU at its worst step
    assert min(floats["htp"]) >= min(floats["cpu"]) - 3
    if report["equal"]:
        assert report["tokens"] == report["cpu_tokens"]
        assert "16 tokens equal to the CPU graphs'" in report["summary"]
    else:
        step = report["first_difference"]["step"]
        assert report["tokens"][:step] == report["cpu_tokens"][:step]
        assert f"step {step}" in report["summary"]
