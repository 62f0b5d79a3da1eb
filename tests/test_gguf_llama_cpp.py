"""llama.cpp itself (``llama-cpp-python``) loads the exported files and runs them: its logits
agree with the torch model run on the weights the file holds, it tokenizes text as the
tokenizer does, and the check tells a wrong file from a right one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import graphbuild as gb
from graphbuild.targets.gguf.adapters import LLAMA
from tests import gguf_models as gm

pytest.importorskip(
    "llama_cpp",
    reason="llama.cpp's Python binding is an optional extra: pip install 'graphbuild[llama-cpp]'",
)

#: llama.cpp's matrix products quantize activations to Q8_0 blocks and sum in another order;
#: measured here (README, "GGUF target"): 35-44 dB, relative error 0.004-0.03. A wrong row
#: order or scale gives single-digit dB.
MIN_SQNR_DB = 30.0
MAX_RELATIVE_ERROR = 0.06


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    gm.tokenizer(path)
    return path


def check(model, tmp_path, tokenizer_path, rows=1, **options) -> list[dict]:
    art = gb.export(
        model,
        (gm.token_ids(rows=rows),),
        tmp_path,
        "m",
        target="gguf",
        options=gb.GgufOptions(tokenizer=tokenizer_path, check_numerics=True, **options),
        cache=False,
    )
    return art.report.extra["numerics"]["outputs"]


def assert_agrees(outputs: list[dict]) -> None:
    for out in outputs:
        assert out["sqnr_db"] >= MIN_SQNR_DB, out
        assert out["relative_error"] <= MAX_RELATIVE_ERROR, out


def test_llama_q8_0_logits_agree(tmp_path, tokenizer_path):
    assert_agrees(check(gm.decoder("llama"), tmp_path, tokenizer_path, quantizer="q8_0"))


def test_fastforward_q4_0_blocks_with_the_models_scales_agree(tmp_path, tokenizer_path):
    model = gm.quantize_linears(gm.decoder("llama"), lambda lin: gm.BlockQuantLinear(lin, 4, 32))
    assert_agrees(check(model, tmp_path, tokenizer_path))


def test_the_check_tells_a_wrong_row_order_from_the_right_one(tmp_path, tokenizer_path):
    unpermuted = dataclasses.replace(LLAMA, rope_heads=None)  # Q/K rows as Hugging Face has them
    outputs = check(
        gm.decoder("llama"), tmp_path, tokenizer_path, quantizer="q8_0", architecture=unpermuted
    )
    assert all(out["sqnr_db"] < 15.0 and out["relative_error"] > 0.2 for out in outputs)


def test_llama_cpp_tokenizes_text_as_the_tokenizer_does(tmp_path, tokenizer_path):
    from llama_cpp import Llama

    art = gb.export(
        gm.decoder("llama"),
        (gm.token_ids(),),
        tmp_path,
        "m",
        target="gguf",
        options=gb.GgufOptions(tokenizer=tokenizer_path, quantizer="q8_0"),
        cache=False,
    )
    llm = Llama(model_path=str(art.files["gguf"]), vocab_only=True, verbose=False)
    try:
        for text in (gm.PROMPT, gm.SENTENCES[1], "a fox, a dog and 12 words!"):
            ours = llm.tokenize(text.encode(), add_bos=True)
            assert ours == gm.tokenizer().encode(text).ids, text  # BOS from its template
            assert llm.detokenize(ours[1:]).decode() == text
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("quantizer", ["q8_0", "q4_0"])
def test_qwen_logits_agree(tmp_path, tokenizer_path, kind, quantizer):
    outputs = check(gm.decoder(kind), tmp_path, tokenizer_path, rows=2, quantizer=quantizer)
    assert len(outputs) == 2
    assert_agrees(outputs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda lin: gm.FakeQuantLinear(lin, -127, 127),
        lambda lin: gm.FakeQuantLinear(lin, -8, 7),
        lambda lin: gm.BlockQuantLinear(lin, 8, 64),
    ],
    ids=["fake-quant int8 per channel", "fake-quant int4 per channel", "FastForward 8-bit/64"],
)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_models_own_quantizers_agree(tmp_path, tokenizer_path, make, kind):
    model = gm.quantize_linears(gm.decoder(kind), make)
    assert_agrees(check(model, tmp_path, tokenizer_path))


@pytest.mark.slow
def test_float_weights_agree_closely(tmp_path, tokenizer_path):
    outputs = check(gm.decoder("llama"), tmp_path, tokenizer_path, float_type="f32")
    assert all(out["sqnr_db"] >= 50.0 for out in outputs), outputs


def test_check_numerics_refuses_inputs_that_are_not_token_ids(tmp_path, tokenizer_path):
    with pytest.raises(gb.StageError, match="first one must be a tensor of token ids"):
        gb.export(
            gm.decoder("llama"),
            (torch.randn(1, 4),),
            tmp_path,
            "m",
            target="gguf",
            options=gb.GgufOptions(tokenizer=tokenizer_path, quantizer="q8_0", check_numerics=True),
            cache=False,
        )
