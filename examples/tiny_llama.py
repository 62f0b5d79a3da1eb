"""A small Llama-style decoder from transformers' own LlamaForCausalLM, built from a config
with random weights (nothing is downloaded). Needs the ``examples`` extra (transformers).

    graphbuild export --model examples/tiny_llama.py:build --name tiny_llama \\
        --set calibration='"examples/tiny_llama.py:calibration"' --set quantization.preset=w8a16
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ = 256, 16


class LogitsOnly(nn.Module):
    """LlamaForCausalLM returning only the logits tensor (no cache, no output dataclass)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def config(**overrides):
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def build(seed: int = 0, **overrides) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The model (eval mode, seeded random weights) and one batch of token ids."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LogitsOnly(LlamaForCausalLM(config(**overrides))).eval()
    return model, (torch.randint(0, VOCAB, (1, SEQ)),)


def calibration(batches: int = 4, seed: int = 1) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (1, SEQ), generator=g),) for _ in range(batches)]
