"""Rotary LLMs pass ``--check-htp --strict-coverage``: a static-shape export's rotary positions
(``arange`` cast to float) are folded into a constant the preset quantizes, so QNN's HTP runs
``positions x inv_freq`` quantized, and the numbers stay those of the float-Mul export.

Before the fold, every Llama, Qwen2 and Phi-3 export kept that one Mul float on the HTP (its
input an integer Cast): 43.79 dB SQNR against the float model for this Llama at w8a16,
which the folded export keeps.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import graphbuild as gb
from graphbuild.targets.qnn import htp_runtime as hr

pytest.importorskip("onnxruntime_qnn", reason="the htp extra (onnxruntime-qnn) is not installed")
pytest.importorskip("transformers", reason="builds transformers causal LMs (the dev extra)")
if not hr.availability().available:
    pytest.skip(hr.availability().reason, allow_module_level=True)

VOCAB, SEQ = 64, 8
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "use_cache": False,
}


class Logits(torch.nn.Module):
    """The causal LM's logits for token ids (the graph's one output)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def causal_lm(family: str) -> tuple[torch.nn.Module, list[tuple[torch.Tensor]]]:
    import transformers as tf

    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
    }[family]
    extra = {"pad_token_id": 0} if family == "phi3" else {}
    torch.manual_seed(0)
    model = Logits(model_cls(config_cls(**SMALL, **extra))).eval()
    g = torch.Generator().manual_seed(100)
    batches = [(torch.randint(0, VOCAB, (1, SEQ), generator=g),) for _ in range(4)]
    return model, batches


def export(family: str, tmp_path, **options) -> gb.ExportArtifacts:
    model, batches = causal_lm(family)
    return gb.export(
        model,
        batches[0],
        tmp_path / "out",
        family,
        format="onnx_qdq",
        options=gb.QnnOnnxOptions(
            **{
                "quantizer": "w8a16",
                "calibration": batches,
                "check_numerics": True,
                "check_htp": True,
                "strict_coverage": True,
                **options,
            }
        ),
        cache=gb.Cache(tmp_path / "cache"),
    )


def test_a_rotary_llama_passes_strict_coverage_on_the_htp(tmp_path):
    art = export("llama", tmp_path)
    (check,) = art.report.extra["htp"]["checks"]
    assert check["compiled"], check["summary"]
    assert check["partition"]["float_ops"] == []
    assert check["partition"]["cpu_nodes"] == []
    (out,) = check["outputs"]
    assert out["forced_max_diff_steps"] <= 2, out
    # the numbers of the export whose Mul ran float (43.79 dB), or better
    (numerics,) = art.report.extra["numerics"]["outputs"]
    assert numerics["sqnr_db_vs_float"] >= 43.78, numerics
    assert out["sqnr_htp_db"] >= 43.5, out


def test_the_positions_are_a_quantized_constant_in_the_export(tmp_path):
    """No integer-to-float Cast is left on the rotary path: the positions are an initializer
    behind a Q/DQ pair, holding 0..SEQ-1 on its grid (stored snapped, as every weight)."""
    art = export("llama", tmp_path, check_htp=False)
    model = onnx.load(art.files["onnx"])
    rotary = [n for n in model.graph.node if n.op_type == "Cos"]
    assert rotary
    produced = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}

    def ancestors(name: str, seen: set[str]) -> set[str]:
        node = produced.get(name)
        if node is None or name in seen:
            return seen
        seen.add(name)
        for x in node.input:
            ancestors(x, seen)
        return seen

    names = ancestors(rotary[0].input[0], set())
    ops = {produced[n].op_type for n in names}
    assert "Cast" not in ops and "Range" not in ops, ops
    quantized = [
        produced[n].input[0]
        for n in names
        if produced[n].op_type == "QuantizeLinear" and produced[n].input[0] in inits
    ]
    positions = [
        inits[q]
        for q in quantized
        if inits[q].size == SEQ
        and np.allclose(inits[q].ravel(), np.arange(SEQ), atol=float(inits[f"{q}_scale"]))
    ]
    assert len(positions) == 1, {q: inits[q] for q in quantized}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_other_rotary_families_pass_strict_coverage_on_the_htp(family, tmp_path):
    (check,) = export(family, tmp_path).report.extra["htp"]["checks"]
    assert check["compiled"], check["summary"]
    assert check["partition"]["float_ops"] == []


@pytest.mark.slow
def test_a_rotary_llama_with_layer_overrides_passes_strict_coverage_on_the_htp(tmp_path):
    """Overrides quantize in one PT2E stage (not the split placement): the same fold runs
    there, so no op is float either (8 were before it)."""
    art = export("llama", tmp_path, layer_overrides={"model.model.layers.0.mlp.*": "w4"})
    (check,) = art.report.extra["htp"]["checks"]
    assert check["compiled"], check["summary"]
    assert check["partition"]["float_ops"] == []
    assert "as layer_overrides asked" in art.report.extra["coverage"]["summary"]
