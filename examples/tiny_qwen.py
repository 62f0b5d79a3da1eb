"""A small Qwen2 causal LM (tied embeddings, q/k/v biases, grouped-query attention), built from
a config with seeded weights: the llm format's tutorial model. Nothing is downloaded.

``build`` returns the transformers model as it is (a ``Qwen2ForCausalLM``, ``use_cache`` left
at its default) and a prompt of token ids; ``calibration`` returns token sequences (the model's
own continuations of random prompts), which the llm format runs as generation runs them
(prompt, then one token at a time).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 512


def config(**overrides):
    from transformers import Qwen2Config

    settings = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    settings.update(overrides)
    return Qwen2Config(**settings)


def build(seed: int = 0, **overrides) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The model (eval mode, seeded weights scaled so greedy choices are clear-cut) and a
    prompt of 12 token ids."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config(**overrides)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                # queries and keys smaller: soft attention, as in a trained model
                scale = 0.05 if name.endswith(("q_proj.weight", "k_proj.weight")) else 0.2
                p.copy_(torch.randn(p.shape, generator=generator) * scale)
    prompt = torch.randint(3, VOCAB, (1, 12), generator=generator)
    return model, (prompt,)


def calibration(sequences: int = 4, length: int = 64, seed: int = 1) -> list[torch.Tensor]:
    """Token sequences of ``length`` ids: random prompts of 8 ids continued by the model's own
    greedy generation (data-free calibration: the KV cache and activations see what generation
    produces, which random ids alone would not show them)."""
    model, _ = build()
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for _ in range(sequences):
            ids = torch.randint(3, VOCAB, (1, 8), generator=g)
            while ids.shape[1] < length:
                next_id = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat((ids, next_id), dim=1)
            out.append(ids)
    return out
