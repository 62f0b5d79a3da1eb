"""Tiny causal LMs of each family the llm format adapts, built from configs (nothing
downloaded), with weights scaled so greedy generation is decisive: a near-tie between two
tokens would make a token comparison test the rounding of the last bit, not the export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import graphbuild as gb

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")

#: Seeds whose 32 greedy tokens after :data:`PROMPT` (3 layers) are each ahead of the runner-up by at
#: least 0.025 logits (``min_margin`` checks it): comparisons then test the export, not a tie.
SEEDS = {"llama": 1, "mistral": 1, "qwen2": 1, "qwen3": 3, "phi3": 6}
PROMPT = [5, 17, 33, 9, 100, 42, 7, 64, 3]


def causal_lm(
    family: str,
    *,
    layers: int = 3,
    seed: int | None = None,
    vocab: int = 256,
    hidden: int = 64,
    intermediate: int = 128,
) -> torch.nn.Module:
    """A ``*ForCausalLM`` of ``family``: GQA (4 heads, 2 KV heads); Qwen2 with tied
    embeddings and q/k/v biases, Qwen3 with per-head q/k norms, Phi-3 with fused projections.
    ``hidden`` and ``intermediate`` widen it where a test needs weights to outweigh what a
    runtime adds around them."""
    import transformers as t

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    configs = {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM, {}),
        "mistral": (t.MistralConfig, t.MistralForCausalLM, {"sliding_window": None}),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, {"head_dim": 32}),
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM, {}),
    }
    config_cls, model_cls, extra = configs[family]
    seed = SEEDS[family] if seed is None else seed
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common, **extra)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def greedy_tokens(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """transformers' own greedy decoding with its own KV cache, ``steps`` tokens whatever they
    are (``generate()`` stops at the end-of-sequence token, which a random model emits): the
    reference every export is held to."""
    tokens: list[int] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(
                input_ids=torch.tensor([[tokens[-1]]]),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return tokens


def min_margin(logits: list[torch.Tensor]) -> float:
    """The smallest lead of the chosen token over the runner-up across generation steps."""
    return min(float(torch.topk(step, 2).values.diff().abs()) for step in logits)


def export_llm(model: torch.nn.Module, out: Path, cache: Path, options: dict, **kwargs: Any):
    """The qnn target's ``llm`` export of ``model`` as ``lm`` into ``out``, PROMPT its sample
    prompt: every llm test's one way to export (``kwargs`` go to :func:`graphbuild.export`)."""
    return gb.export(
        model,
        (torch.tensor([PROMPT]),),
        out,
        "lm",
        target="qnn",
        format="llm",
        options=options,
        cache=cache,
        **kwargs,
    )
