"""``gguf/llama_cpp`` exports, read back with the ``gguf`` package (llama.cpp's Python reader):
the names, types, shapes and metadata llama.cpp expects, blocks as llama.cpp's converter
writes them (presets) or with the model's own scales (pre-quantized models), the vocabulary,
and the errors that name what cannot be written."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import graphbuild as gb
from graphbuild.errors import ConfigError, StageError
from graphbuild.targets.gguf import ArchAdapter, register_adapter
from graphbuild.targets.gguf.adapters import LLAMA, adapters, unregister_adapter
from tests import gguf_models as gm

gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install gguf")

Q8_0, Q4_0 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    gm.tokenizer(path)
    return path


def export(model, out, tokenizer_path, name="m", cache=False, **options):
    options.setdefault("tokenizer", tokenizer_path)
    return gb.export(
        model,
        (gm.token_ids(),),
        out,
        name,
        target="gguf",
        options=gb.GgufOptions(**options),
        cache=cache,
    )


def read(art):
    return gguf.GGUFReader(art.files["gguf"])


def fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def tensors(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def expected_names(layers: int, extra: tuple[str, ...] = (), output: bool = True) -> set[str]:
    per_layer = (
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
        *extra,
    )
    names = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if output else set())
    return names | {f"blk.{i}.{n}" for i in range(layers) for n in per_layer}


# --------------------------------------------------------------------------- architectures


def test_a_llama_holds_llamas_tensors_metadata_and_permuted_q8_0_blocks(tmp_path, tokenizer_path):
    model = gm.decoder("llama")
    reader = read(export(model, tmp_path, tokenizer_path, quantizer="q8_0"))
    meta, found = fields(reader), tensors(reader)
    config = model.model.config
    assert meta["general.architecture"] == "llama" and meta["general.name"] == "m"
    assert meta["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert {
        k: meta[f"llama.{k}"]
        for k in (
            "context_length",
            "embedding_length",
            "block_count",
            "feed_forward_length",
            "attention.head_count",
            "attention.head_count_kv",
            "rope.dimension_count",
        )
    } == {
        "context_length": 512,
        "embedding_length": 64,
        "block_count": 2,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "rope.dimension_count": 16,
    }
    assert meta["llama.rope.freq_base"] == config.rope_parameters["rope_theta"]
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert set(found) == expected_names(2)
    for name, t in found.items():
        expected = gguf.GGMLQuantizationType.F32 if name.endswith("norm.weight") else Q8_0
        assert t.tensor_type == expected, name
    assert [int(n) for n in found["blk.0.attn_k.weight"].shape] == [64, 32]  # ne: in, out
    layer = model.model.model.layers[0].self_attn
    for gguf_name, w, heads in (
        ("blk.0.attn_q.weight", layer.q_proj.weight, 4),
        ("blk.0.attn_k.weight", layer.k_proj.weight, 2),  # K by its key/value heads
        ("blk.0.attn_v.weight", layer.v_proj.weight, None),
    ):
        rows = permute(w.detach(), heads) if heads else w.detach()
        expected = gguf.quants.quantize(rows.numpy(), Q8_0)  # what llama.cpp's converter writes
        assert found[gguf_name].data.tobytes() == expected.tobytes(), gguf_name


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwens_hold_their_own_tensors_unpermuted_and_the_tied_embedding_once(
    tmp_path, tokenizer_path, kind
):
    model = gm.decoder(kind)
    art = export(model, tmp_path, tokenizer_path, quantizer="q4_0")
    assert art.report.extra["coverage"]["stored_once"] == {"output.weight": "token_embd.weight"}
    reader = read(art)
    meta, found = fields(reader), tensors(reader)
    assert meta["general.architecture"] == kind
    assert meta["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    extra = {
        "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
        "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight"),
    }[kind]
    assert set(found) == expected_names(2, extra, output=False)  # llama.cpp reads token_embd
    if kind == "qwen3":
        assert meta["qwen3.attention.key_length"] == meta["qwen3.attention.value_length"] == 32
        assert meta["qwen3.rope.dimension_count"] == 32
        assert [int(n) for n in found["blk.0.attn_q_norm.weight"].shape] == [32]
    else:
        bias = model.model.model.layers[1].self_attn.k_proj.bias.detach().numpy()
        np.testing.assert_array_equal(found["blk.1.attn_k.bias"].data, bias)  # not permuted
    q = model.model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert found["blk.0.attn_q.weight"].data.tobytes() == gguf.quants.quantize(q, Q4_0).tobytes()


def test_the_vocabulary_is_the_tokenizers(tmp_path, tokenizer_path):
    tok = gm.tokenizer()
    reader = read(export(gm.decoder("llama"), tmp_path, tokenizer_path, quantizer="q8_0"))
    meta = fields(reader)
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == gm.VOCAB
    assert tokens == [tok.id_to_token(i) or f"[PAD{i}]" for i in range(gm.VOCAB)]
    types = meta["tokenizer.ggml.token_type"]
    assert types[:2] == [gguf.TokenType.CONTROL] * 2 and set(types[2:]) == {gguf.TokenType.NORMAL}
    import json

    merges = json.loads(tok.to_str())["model"]["merges"]
    assert meta["tokenizer.ggml.merges"] == [" ".join(m) for m in merges]
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "gpt-2"  # the tokenizer's own byte-level regex
    assert meta["tokenizer.ggml.bos_token_id"] == 0 and meta["tokenizer.ggml.add_bos_token"]


def test_a_tokenizer_object_or_directory_gives_the_same_file(tmp_path, tokenizer_path):
    from transformers import PreTrainedTokenizerFast

    files = set()
    for i, tok in enumerate(
        [
            tokenizer_path,
            tokenizer_path.parent,
            gm.tokenizer(),
            PreTrainedTokenizerFast(tokenizer_object=gm.tokenizer()),
        ]
    ):
        art = export(gm.decoder("llama"), tmp_path / str(i), tok, quantizer="q8_0", tokenizer=tok)
        files.add(art.files["gguf"].read_bytes())
    assert len(files) == 1


def test_without_a_tokenizer_the_file_says_it_has_no_vocabulary(tmp_path, tokenizer_path):
    with pytest.warns(UserWarning, match="no tokenizer given"):
        art = export(gm.decoder("llama"), tmp_path, None, quantizer="q8_0", tokenizer=None)
    assert fields(read(art))["tokenizer.ggml.model"] == "none"


def test_metadata_alignment_and_float_type_options(tmp_path, tokenizer_path):
    art = export(
        gm.decoder("llama"),
        tmp_path,
        tokenizer_path,
        float_type="f32",
        alignment=64,
        metadata={"general.author": "graphbuild tests", "general.version": 3},
    )
    reader = read(art)
    meta = fields(reader)
    assert meta["general.author"] == "graphbuild tests" and meta["general.version"] == 3
    assert meta["general.alignment"] == 64 and reader.alignment == 64
    assert all(t.data_offset % 64 == 0 for t in reader.tensors)
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}


# --------------------------------------------------------------------------- the model's own quantizers


def assert_models_own_blocks(found, name, weight, snapped, scale, ggml):
    """The file's blocks dequantize to the model's fake-quantized weight up to float16's
    rounding of the scale, and each block's ``d`` is the model's scale in float16."""
    t = found[name]
    assert t.tensor_type == ggml, name
    values = gguf.quants.dequantize(np.asarray(t.data), ggml).reshape(weight.shape)
    d = np.asarray(t.data).reshape(-1, gguf.GGML_QUANT_SIZES[ggml][1])[:, :2].copy()
    np.testing.assert_array_equal(d.view(np.float16).reshape(-1), scale.astype(np.float16))
    np.testing.assert_allclose(values, snapped, rtol=2**-11, atol=0)


def test_per_channel_fake_quant_weights_keep_the_models_scales(tmp_path, tokenizer_path):
    model = gm.quantize_linears(gm.decoder("llama"), lambda lin: gm.FakeQuantLinear(lin, -8, 7))
    art = export(model, tmp_path, tokenizer_path)
    found = tensors(read(art))
    layer = model.model.model.layers[1]
    for name, lin in (
        ("blk.1.attn_v.weight", layer.self_attn.v_proj),
        ("blk.1.ffn_down.weight", layer.mlp.down_proj),
    ):
        snapped = lin(torch.eye(lin.weight.shape[1])).T.detach().numpy()  # the weight it uses
        scale = np.repeat(lin.w_scale.numpy(), lin.weight.shape[1] // 32)
        assert_models_own_blocks(found, name, lin.weight, snapped, scale, Q4_0)
    assert found["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16  # no quantizer
    report = art.report.extra["coverage"]
    assert report["summary"].startswith("15/16 weight matrices quantized")
    assert 0 < report["scale_float16_max_rel_change"] <= 2**-11


def test_fastforward_blocks_of_32_keep_their_scales_and_rope_rows(tmp_path, tokenizer_path):
    model = gm.quantize_linears(gm.decoder("llama"), lambda lin: gm.BlockQuantLinear(lin, 4, 32))
    found = tensors(read(export(model, tmp_path, tokenizer_path)))
    q = model.model.model.layers[0].self_attn.q_proj
    snapped = q.weight_quantizer(q.weight).detach()
    scale = q.weight_quantizer.scale.detach().reshape(q.weight.shape[0], -1)
    assert_models_own_blocks(
        found,
        "blk.0.attn_q.weight",
        q.weight,
        permute(snapped, 4).numpy(),  # rows as llama.cpp reads them, each with its scale
        permute(scale, 4).reshape(-1).numpy(),
        Q4_0,
    )


def test_an_unsigned_4_bit_grid_is_held_exactly_as_q8_0(tmp_path, tokenizer_path):
    """Codes 0..15 (zero point 0) are not Q4_0's -8..7, but Q8_0 holds them exactly."""
    model = gm.quantize_linears(gm.decoder("llama"), lambda lin: gm.FakeQuantLinear(lin, 0, 15))
    found = tensors(read(export(model, tmp_path, tokenizer_path)))
    o = model.model.model.layers[0].self_attn.o_proj
    snapped = o(torch.eye(64)).T.detach().numpy()
    scale = np.repeat(o.w_scale.numpy(), 2)
    assert_models_own_blocks(found, "blk.0.attn_output.weight", o.weight, snapped, scale, Q8_0)


def test_a_tied_embeddings_two_quantizers_go_to_their_own_uses(tmp_path, tokenizer_path):
    """torch.export reads a tied parameter through one name for both uses; each quantizer
    is given to the tensor of the use it quantizes (the lookup's to token_embd)."""
    model = gm.quantize_linears(gm.decoder("qwen2"), lambda lin: gm.FakeQuantLinear(lin, -8, 7))
    inner = model.model.model
    inner.embed_tokens = gm.FakeQuantEmbedding(inner.embed_tokens)
    assert model.model.lm_head.weight is inner.embed_tokens.weight  # still tied
    found = tensors(read(export(model, tmp_path, tokenizer_path)))
    table = inner.embed_tokens
    snapped = table(torch.arange(gm.VOCAB)).detach().numpy()
    scale = np.repeat(table.w_scale.numpy(), 2)
    assert_models_own_blocks(found, "token_embd.weight", table.weight, snapped, scale, Q8_0)
    head = model.model.lm_head
    snapped = head(torch.eye(64)).T.detach().numpy()
    scale = np.repeat(head.w_scale.numpy(), 2)
    assert_models_own_blocks(found, "output.weight", head.weight, snapped, scale, Q4_0)


def test_blocks_of_a_multiple_of_32_are_written_as_32s(tmp_path, tokenizer_path):
    model = gm.quantize_linears(gm.decoder("llama"), lambda lin: gm.BlockQuantLinear(lin, 8, 64))
    found = tensors(read(export(model, tmp_path, tokenizer_path)))
    up = model.model.model.layers[0].mlp.up_proj
    scale = up.weight_quantizer.scale.detach().repeat_interleave(2)  # one per 32 values
    snapped = up.weight_quantizer(up.weight).detach().numpy()
    assert_models_own_blocks(found, "blk.0.ffn_up.weight", up.weight, snapped, scale.numpy(), Q8_0)


@pytest.mark.slow
def test_a_pt2e_converted_graph_keeps_its_scales(tmp_path, tokenizer_path):
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    import graphbuild.targets.qnn.presets.quantizer  # noqa: F401  - registers the QNN presets
    from graphbuild.frontend.presets import QUANTIZER_PRESETS

    model = gm.decoder("llama")
    ids = gm.token_ids()
    graph = prepare_pt2e(torch.export.export(model, (ids,)).module(), QUANTIZER_PRESETS["w8a16"]())
    graph(ids)
    graph = convert_pt2e(graph, fold_quantize=False)
    graph.config = model.model.config  # a graph module carries no config of its own
    art = export(graph, tmp_path, tokenizer_path)
    found = tensors(read(art))
    assert found["blk.0.attn_v.weight"].tensor_type == Q8_0
    # the preset quantizes the embedding table on a 16-bit grid: no block type holds it
    assert found["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    floats = art.report.extra["coverage"]["float_from_quantizers"]
    assert "token_embd.weight" in floats  # and the norm weights, on the activation grid
    assert all(n == "token_embd.weight" or n.endswith("norm.weight") for n in floats)
    v = model.model.model.layers[0].self_attn.v_proj.weight.detach()
    values = gguf.quants.dequantize(np.asarray(found["blk.0.attn_v.weight"].data), Q8_0)
    step = v.abs().amax(dim=1, keepdim=True) / 127  # AIMET's symmetric int8 scale, about
    assert np.abs(values.reshape(v.shape) - v.numpy()).max() <= float(step.max()) * 0.51


# --------------------------------------------------------------------------- what cannot be written


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda lin: gm.BlockQuantLinear(lin, 4, 16), "blocks of 16 along axis 1.*no GGUF form"),
        (lambda lin: gm.FakeQuantLinear(lin, 0, 255), r"8-bit grid \[0, 255\] with zero point 0"),
    ],
)
def test_quantizers_gguf_cannot_hold_are_named(tmp_path, tokenizer_path, make, message):
    model = gm.quantize_linears(gm.decoder("llama"), make)
    with pytest.raises(StageError, match=message) as err:
        export(model, tmp_path, tokenizer_path)
    assert re.search(r"'model\.(model\.layers\.\d+\.\w+\.\w+|lm_head)\.weight'", str(err.value))


def test_an_unknown_architecture_names_the_known_ones(tmp_path, tokenizer_path):
    model = gm.decoder("llama")
    model.model.config.model_type = "gpt_neox"
    with pytest.raises(StageError, match="model type 'gpt_neox'; known: llama, qwen2, qwen3"):
        export(model, tmp_path, tokenizer_path, quantizer="q8_0")


def test_a_model_without_a_transformers_config_is_refused(tmp_path, tokenizer_path):
    with pytest.raises(StageError, match="carries no transformers config"):
        export(torch.nn.Linear(32, 32), tmp_path, tokenizer_path, quantizer="q8_0")


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    big = tmp_path / "big.json"
    gm.tokenizer(big, vocab_size=gm.VOCAB + 40)
    model = gm.decoder("llama", vocab_size=gm.VOCAB - 20)
    with pytest.raises(StageError, match="token ids up to .* outside the model's vocabulary"):
        export(model, tmp_path / "out", big, quantizer="q8_0")


def test_tokenizers_llama_cpp_cannot_run_are_refused(tmp_path):
    from tokenizers import Tokenizer, models

    words = tmp_path / "words.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(words))
    with pytest.raises(StageError, match="holds a WordLevel tokenizer.*byte-level BPE"):
        export(gm.decoder("llama"), tmp_path / "out", words, quantizer="q8_0")
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": {"type": "BPE"}}')
    with pytest.raises(StageError, match="tokenizers library cannot read the tokenizer"):
        export(gm.decoder("llama"), tmp_path / "out", broken, quantizer="q8_0")


def test_options_are_checked():
    with pytest.raises(ConfigError, match="not a GGUF preset; known: q8_0, q4_0"):
        gb.GgufOptions(quantizer="w8a16")
    with pytest.raises(ConfigError, match="float_type"):
        gb.GgufOptions(float_type="bf16")
    with pytest.raises(ConfigError, match="'general.<name>'"):
        gb.GgufOptions(metadata={"llama.context_length": 4})
    with pytest.raises(ConfigError, match="cannot read"):
        gb.GgufOptions(tokenizer="/nonexistent/tokenizer.json")


# --------------------------------------------------------------------------- adapters


def test_a_registered_adapter_exports_another_model_type(tmp_path, tokenizer_path):
    """Mistral is a Llama to llama.cpp (its converter writes it as ``llama``): one adapter."""
    from transformers import MistralConfig, MistralForCausalLM

    from examples.tiny_llama import LogitsOnly

    mistral = dataclasses.replace(LLAMA, model_types=("mistral",))
    register_adapter(mistral)
    try:
        config = MistralConfig(
            vocab_size=gm.VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=None,
        )
        model = LogitsOnly(MistralForCausalLM(config)).eval()
        found = tensors(read(export(model, tmp_path, tokenizer_path, quantizer="q8_0")))
        assert set(found) == expected_names(1)
    finally:
        unregister_adapter(mistral)
    assert "mistral" not in adapters()


def test_an_adapter_for_a_registered_model_type_needs_replace():
    with pytest.raises(ConfigError, match="already registered"):
        register_adapter(ArchAdapter("other", ("llama",), LLAMA.tensors, LLAMA.hparams))


# --------------------------------------------------------------------------- command line


def test_the_command_line_exports_a_tiny_qwen2_from_a_config_file(tmp_path, monkeypatch):
    """``graphbuild export --target gguf`` from a project of one's own: the example factory,
    a preset from ``[quantization]``, the tokenizer path from ``[options]``."""
    from typer.testing import CliRunner

    from graphbuild.cli import app

    root = Path(__file__).resolve().parents[1]
    gm.tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "graphbuild.toml").write_text(
        f'model = "{root / "examples" / "tiny_gguf.py"}:qwen2"\n'
        'model_name = "tiny_qwen2"\ntarget = "gguf"\n'
        '[quantization]\npreset = "q4_0"\n'
        '[options]\ntokenizer = "tokenizer.json"\nmetadata = {"general.author" = "me"}\n'
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(root))
    result = CliRunner().invoke(app, ["export", "--no-cache", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["target"], doc["format"]) == ("gguf", "llama_cpp")
    assert doc["reports"]["coverage"]["summary"].startswith("15/15 weight matrices quantized")
    meta = fields(gguf.GGUFReader(tmp_path / "graphbuild-out" / "tiny_qwen2.gguf"))
    assert meta["general.architecture"] == "qwen2" and meta["general.author"] == "me"
