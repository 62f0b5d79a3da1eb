"""The llm format's float bundle (no preset, no kv_bits): one graph per part with the KV cache
float end to end, run by onnxruntime-genai's default cache, generating transformers' own
greedy tokens."""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest
import torch

from graphbuild.engine.events import StageStatus
from tests.llm_models import FAMILIES, PROMPT, causal_lm, export_llm, greedy_tokens

pytest.importorskip("transformers", reason="builds transformers causal LMs (the dev extra)")

GEOMETRY = dict(prompt_len=4, context_len=64, parts=3)
#: The family the default suite exports (q/k norms and a head_dim of its own); the others
#: are slow.
DEFAULT_FAMILY = "qwen3"


def lm_running_32(family: str) -> tuple[torch.nn.Module, list[int]]:
    """``family``'s test model with an end-of-sequence id it does not emit in 32 greedy
    tokens (a random model emits any), and transformers' ``generate()`` tokens: both runtimes
    then generate all 32."""
    model = causal_lm(family)
    emitted = set(greedy_tokens(model, PROMPT, 32))
    eos = max(set(range(model.config.vocab_size)) - emitted - {0, 1})
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False
        )
    tokens = out[0, len(PROMPT) :].tolist()
    assert len(tokens) == 32
    return model, tokens


def _export(model, out: Path, cache: Path, **options):
    return export_llm(model, out, cache, {**GEOMETRY, **options})


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """The default family's float bundle, checked (its report) and placed."""
    tmp = tmp_path_factory.mktemp("float")
    model, expected = lm_running_32(DEFAULT_FAMILY)
    artifacts = _export(model, tmp / "out", tmp / "cache", check_numerics=True)
    return model, expected, artifacts, tmp


def _families():
    return [
        pytest.param(f, marks=() if f == DEFAULT_FAMILY else pytest.mark.slow) for f in FAMILIES
    ]


@pytest.mark.parametrize("family", _families())
def test_genai_generates_transformers_32_greedy_tokens_from_the_float_bundle(
    family: str, exported: tuple, tmp_path: Path
) -> None:
    """Llama, Mistral, Qwen2 (tied embeddings), Qwen3 (q/k norms) and Phi-3 (fused
    projections): onnxruntime-genai, run on the placed bundle, and the export's own check
    both give transformers' 32 greedy tokens."""
    pytest.importorskip("onnxruntime_genai", reason="runs the bundle (the llm extra)")
    from graphbuild.targets.qnn.llm.generate import generate

    if family == DEFAULT_FAMILY:
        _, expected, artifacts, tmp = exported
    else:
        (model, expected), tmp = lm_running_32(family), tmp_path
        artifacts = _export(model, tmp / "out", tmp / "cache", check_numerics=True)
    assert generate(tmp / "out" / "cpu", PROMPT, 32).tokens == expected
    report = artifacts.report.extra["numerics"]
    assert report["tokens"] == expected and report["equal"]
    assert report["runtime"].startswith("onnxruntime-genai")
    assert report["summary"].startswith("32 tokens equal to transformers' (onnxruntime-genai")


def test_the_float_bundle_is_a_graph_per_part_with_a_float_kv_cache(exported: tuple) -> None:
    """genai keeps its default cache (no sliding window, which holds uint8 only): each part's
    one graph runs on the prompt and on every token, its KV inputs and outputs float
    [1, H, past, D] -> [1, H, past + new, D], both lengths any size."""
    import json

    *_, tmp = exported
    cpu = tmp / "out" / "cpu"
    assert sorted(p.name for p in cpu.iterdir()) == [
        "float_1_of_3.onnx",
        "float_2_of_3.onnx",
        "float_3_of_3.onnx",
        "genai_config.json",
        "position-processor.onnx",
    ]
    decoder = json.loads((cpu / "genai_config.json").read_text())["model"]["decoder"]
    assert "sliding_window" not in decoder
    entries = decoder["pipeline"][0]
    assert list(entries) == ["position-processor", "float_1_of_3", "float_2_of_3", "float_3_of_3"]
    assert all(e["run_on_prompt"] and e["run_on_token_gen"] for e in entries.values())
    graph = onnx.load(cpu / "float_3_of_3.onnx", load_external_data=False).graph
    kv = [v for v in [*graph.input, *graph.output] if v.name.startswith("past_")]
    assert [v.name for v in kv] == ["past_key_2_in", "past_value_2_in"] + [
        "past_key_2_out",
        "past_value_2_out",
    ]
    for value in kv:
        dims = value.type.tensor_type.shape.dim
        assert value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert [d.dim_value for d in dims] == [1, 2, 0, 32] and dims[2].dim_param


def test_graphbuilds_onnxruntime_runner_generates_the_same_tokens(exported: tuple) -> None:
    """Where onnxruntime-genai is not installed the check runs the bundle as genai does."""
    from graphbuild.targets.qnn.llm.float_runner import float_generation

    _, expected, _, tmp = exported
    tokens, logits = float_generation(tmp / "out" / "cpu", PROMPT, 32)
    assert tokens == expected
    assert len(logits) == 32


def test_the_float_graphs_depend_on_no_length(exported: tuple) -> None:
    """A new prompt or context length traces no float graph again (they take any)."""
    model, _, _, tmp = exported
    again = _export(model, tmp / "other", tmp / "cache", prompt_len=8, context_len=32)
    ran = {s.name for s in again.report.stages if s.status is StageStatus.RAN}
    built = (".capture", ".to_onnx", ".bind", ".graph")
    assert not [s for s in ran if ".float." in s and s.endswith(built)]


#: PROMPT's 9 ids and this many new tokens make 65: one past GEOMETRY's context_len.
PAST_THE_CONTEXT = GEOMETRY["context_len"] - len(PROMPT) + 1
TOO_LONG = (
    r"the prompt \(9 ids\) and 56 new tokens \(65\) exceed the bundle's max_length 64 "
    r"\(context_len 64\): export with a larger context_len, or generate at most 55 new tokens"
)


def test_a_prompt_and_tokens_past_the_context_are_refused_before_running(exported: tuple):
    """Past the context, position ids would overrun the rotary table (onnxruntime: a Gather
    index error): the runner says what does not fit and what to do instead; the most that
    fits runs."""
    from graphbuild.targets.qnn.llm.errors import ContextLengthError
    from graphbuild.targets.qnn.llm.float_runner import float_generation

    cpu = exported[3] / "out" / "cpu"
    with pytest.raises(ContextLengthError, match=TOO_LONG):
        float_generation(cpu, PROMPT, PAST_THE_CONTEXT)
    tokens, _ = float_generation(cpu, PROMPT, PAST_THE_CONTEXT - 1)
    assert len(tokens) == PAST_THE_CONTEXT - 1


def test_genai_and_graphbuild_generate_refuse_the_same_length_alike(exported: tuple):
    pytest.importorskip("onnxruntime_genai", reason="runs the bundle (the llm extra)")
    from typer.testing import CliRunner

    from graphbuild.cli.app import app
    from graphbuild.targets.qnn.llm.errors import ContextLengthError
    from graphbuild.targets.qnn.llm.generate import generate

    cpu = exported[3] / "out" / "cpu"
    with pytest.raises(ContextLengthError, match=TOO_LONG):
        generate(cpu, PROMPT, PAST_THE_CONTEXT)
    prompt = " ".join(map(str, PROMPT))
    result = CliRunner().invoke(app, ["generate", str(cpu), "-p", prompt, "-n", "56"])
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    assert re.search(TOO_LONG, " ".join(result.output.split())), result.output
