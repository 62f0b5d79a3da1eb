"""The llm format places the model's tokenizer in its bundle when the model carries one, and
``graphbuild generate`` then takes a text prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphbuild.errors import ConfigError
from tests.llm_models import causal_lm, export_llm

pytest.importorskip("transformers", reason="builds transformers causal LMs (the dev extra)")
tokenizers = pytest.importorskip("tokenizers", reason="builds a tokenizer (the dev extra)")


def byte_tokenizer():
    """A byte-level BPE tokenizer of 256 tokens (the test models' vocabulary), built here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=256, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(["hello world"], trainer=trainer)
    return tok


def _export(model, out: Path, cache: Path, **options):
    return export_llm(
        model, out, cache, {"prompt_len": 4, "context_len": 64, "parts": 2, **options}
    )


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    tmp = tmp_path_factory.mktemp("tokenizer")
    model = causal_lm("llama", layers=2)
    model.tokenizer = byte_tokenizer()
    _export(model, tmp / "out", tmp / "cache")
    return model, tmp


def test_the_bundle_holds_the_models_tokenizer_which_genai_loads(bundle: tuple) -> None:
    og = pytest.importorskip("onnxruntime_genai", reason="loads the bundle (the llm extra)")
    model, tmp = bundle
    cpu = tmp / "out" / "cpu"
    assert json.loads((cpu / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast"
    }
    genai = og.Tokenizer(og.Model(str(cpu)))
    expected = model.tokenizer.encode("hello world").ids
    assert [int(t) for t in genai.encode("hello world")] == expected
    assert genai.decode(expected) == "hello world"


def test_generate_takes_text_where_the_bundle_has_a_tokenizer(bundle: tuple) -> None:
    pytest.importorskip("onnxruntime_genai", reason="runs the bundle (the llm extra)")
    from typer.testing import CliRunner

    from graphbuild.cli.app import app
    from graphbuild.targets.qnn.llm.generate import generate

    model, tmp = bundle
    cpu = tmp / "out" / "cpu"
    args = ["generate", str(cpu), "--prompt", "hello", "-n", "8"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    ids = generate(cpu, model.tokenizer.encode("hello").ids, 8).tokens
    assert json.loads(result.output) == {
        "tokens": ids,
        "text": model.tokenizer.decode(ids),
        "stopped": "max_new_tokens" if len(ids) == 8 else "eos",
        "runtime": json.loads(result.output)["runtime"],
    }
    plain = CliRunner().invoke(app, args)  # the text (the runner turns \r\n into \n)
    assert plain.exit_code == 0
    printed = plain.output.replace("\r", "").removesuffix("\n")
    assert printed == model.tokenizer.decode(ids).replace("\r", "")


def test_a_new_tokenizer_is_placed_and_rebinds_no_graph(bundle: tuple) -> None:
    from tokenizers import normalizers

    from graphbuild.engine.events import StageStatus

    model, tmp = bundle
    model.tokenizer.normalizer = normalizers.Lowercase()
    try:
        again = _export(model, tmp / "out", tmp / "cache")
    finally:
        model.tokenizer.normalizer = None
    ran = {s.name for s in again.report.stages if s.status is StageStatus.RAN}
    assert "tokenizer" in ran
    assert not [s for s in ran if s.endswith((".bind", ".graph"))]
    assert not [s for s in ran if s.endswith((".capture", ".to_onnx"))], "nothing retraces"
    assert "llm_generation" not in ran, "nothing recalibrates"
    placed = json.loads((tmp / "out" / "cpu" / "tokenizer.json").read_text())
    assert placed["normalizer"]["type"] == "Lowercase"


def test_a_bundle_without_a_tokenizer_takes_token_ids_only(tmp_path: Path) -> None:
    from graphbuild.targets.qnn.llm.tokenizer import encode

    with pytest.raises(ConfigError, match="token ids"):
        encode(tmp_path, "hello")


def test_a_tokenizer_of_another_kind_is_refused_before_any_work(tmp_path: Path) -> None:
    model = causal_lm("llama", layers=2)
    model.tokenizer = {"hello": 1}
    with pytest.raises(ConfigError, match="tokenizers.Tokenizer"):
        _export(model, tmp_path / "out", tmp_path / "cache")
    assert not (tmp_path / "out").exists()


def test_a_new_chat_template_is_placed(bundle: tuple) -> None:
    """A transformers fast tokenizer's tokenizer_config.json (its chat template, its special
    tokens) is part of what the bundle places, so a change to it places the new file."""
    from transformers import PreTrainedTokenizerFast

    model, tmp = bundle
    plain = model.tokenizer
    placed = tmp / "out" / "cpu" / "tokenizer_config.json"
    try:
        for template in ("{{ messages[0]['content'] }}", "<|user|>{{ messages[0]['content'] }}"):
            model.tokenizer = PreTrainedTokenizerFast(
                tokenizer_object=byte_tokenizer(), chat_template=template
            )
            _export(model, tmp / "out", tmp / "cache")
            assert json.loads(placed.read_text())["chat_template"] == template
    finally:
        model.tokenizer = plain


def test_a_fast_tokenizer_is_keyed_on_the_files_it_places_only() -> None:
    """What the bundle gets changes the key; the tokenizer's own bookkeeping (the warnings it
    gave) does not."""
    from transformers import PreTrainedTokenizerFast

    from graphbuild.engine.fingerprint.walk import fingerprint
    from graphbuild.targets.qnn.llm.tokenizer import model_tokenizer

    def key(template: str, warned: bool = False) -> object:
        tok = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), chat_template=template)
        if warned:
            tok.deprecation_warnings["Asking-to-pad-a-fast-tokenizer"] = True
        return fingerprint(model_tokenizer(type("M", (), {"tokenizer": tok})()))

    assert key("{{ messages }}") == key("{{ messages }}", warned=True)
    assert key("{{ messages }}") != key("<|user|>{{ messages }}")
