"""Tiny transformers decoders and a tiny tokenizer for the GGUF target, built offline.

Llama, Qwen2 and Qwen3 with 2 layers and random weights (Q and K projections scaled up so
that attention is sharp), and a byte-level BPE tokenizer trained on three sentences. Needs
the ``examples`` and ``gguf`` extras (transformers, tokenizers)::

    python examples/tiny_gguf.py tiny-tokenizer.json        # writes the tokenizer
    graphbuild export --target gguf --model examples/tiny_gguf.py:llama --name tiny_llama \\
        --set quantization.preset=q8_0 --set tokenizer=tiny-tokenizer.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

VOCAB = 320
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny tokenizer for a tiny model",
    "llama.cpp reads the file and runs the model on the prompt",
]
PROMPT = "the lazy fox runs over the tiny world"


def tokenizer(path: str | Path | None = None, vocab_size: int = VOCAB):
    """A byte-level BPE tokenizer trained on :data:`SENTENCES` (BOS added by its template),
    saved to ``path`` when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", 0)]
    )
    if path is not None:
        tok.save(str(path))
    return tok


def token_ids(text: str = PROMPT, rows: int = 1) -> torch.Tensor:
    """``text`` as the tokenizer encodes it, ``rows`` times: a batch of token ids."""
    return torch.tensor([tokenizer().encode(text).ids] * rows, dtype=torch.int64)


def decoder(kind: str = "llama", seed: int = 0, gain: float = 10.0, **overrides) -> nn.Module:
    """A 2-layer transformers Llama, Qwen2 or Qwen3 returning logits, its Q/K weights ``gain``
    times larger than initialised (transformers' initialisation makes attention nearly
    uniform, which would hide a wrong RoPE row order), Qwen2's Q/K/V biases and the norm
    weights drawn at random."""
    import transformers

    from examples.tiny_llama import LogitsOnly

    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }
    config_cls, model_cls = (getattr(transformers, n) for n in classes[kind])
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=kind != "llama",
        attn_implementation="eager",
    )
    if kind == "qwen3":
        settings["head_dim"] = 32  # not hidden / heads: llama.cpp reads key_length
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LogitsOnly(model_cls(config_cls(**settings))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(gain)
            elif name.endswith("proj.bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def llama() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return decoder("llama"), (token_ids(),)


def qwen2() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return decoder("qwen2"), (token_ids(),)


def qwen3() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return decoder("qwen3"), (token_ids(),)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} path/to/tokenizer.json")
    tokenizer(sys.argv[1])
    print(f"wrote {sys.argv[1]}")
