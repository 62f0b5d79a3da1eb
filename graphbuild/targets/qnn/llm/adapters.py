"""Model-family adapters: where a transformers causal LM keeps what the part graphs need.

The ``llm`` format does not trace a transformers model as it is: its attention reads a growing
cache and computes rotary positions in float. It rebuilds each decoder layer as the device runs
it (:mod:`.parts`) from the model's own submodules, so the weights are the model's tensors, never
copies. An :class:`LlmAdapter` says where those submodules are for one family: the token
embedding, the decoder layers, the final norm, the LM head, and per layer the norms, the MLP and
the attention projections (one fused ``qkv_proj`` in Phi-3, three in the others), with the
per-head q/k norms of Qwen3 where the model has them.

The built-in adapters cover Llama, Mistral, Qwen2, Qwen3 and Phi-3; :func:`register_adapter`
adds one for another family, and the registry is part of the keys of the stages that consult it
(``registry.llm_adapters``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphbuild.engine.fingerprint import register_registry
from graphbuild.errors import ConfigError

#: q, k, v projections of one layer's normed input [1, N, E] -> three [1, N, heads * D] tensors
Projections = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def separate_qkv(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Llama, Mistral, Qwen2 and Qwen3: ``q_proj``, ``k_proj`` and ``v_proj``."""
    return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)


def fused_qkv(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Phi-3: one ``qkv_proj`` whose rows are q, then k, then v."""
    qkv = attn.qkv_proj(x)
    config = attn.config
    q_rows = config.num_attention_heads * attn.head_dim
    kv_rows = config.num_key_value_heads * attn.head_dim
    return qkv.split([q_rows, kv_rows, kv_rows], dim=-1)


@dataclass(frozen=True)
class LlmAdapter:
    """Where one family's causal LM keeps the modules the part graphs are built from.

    ``model_types``: the transformers ``config.model_type`` values it takes. ``projections``:
    the layer's q, k, v (:data:`Projections`). ``qk_norm``: the layer's attention has per-head
    ``q_norm`` and ``k_norm`` applied before the rotary embedding (Qwen3)."""

    name: str
    model_types: tuple[str, ...]
    projections: Projections = separate_qkv
    qk_norm: bool = False


_ADAPTERS: dict[str, LlmAdapter] = {}


def register_adapter(adapter: LlmAdapter) -> LlmAdapter:
    """Register ``adapter`` for its ``model_types`` (a later registration wins)."""
    for model_type in adapter.model_types:
        _ADAPTERS[model_type] = adapter
    return adapter


def adapter_entries() -> dict[str, LlmAdapter]:
    """The registry as the stages that consult it are keyed on."""
    return dict(sorted(_ADAPTERS.items()))


register_registry("llm_adapters", adapter_entries)

for _adapter in (
    LlmAdapter("llama", ("llama",)),
    LlmAdapter("mistral", ("mistral",)),
    LlmAdapter("qwen2", ("qwen2",)),
    LlmAdapter("qwen3", ("qwen3",), qk_norm=True),
    LlmAdapter("phi3", ("phi3",), projections=fused_qkv),
):
    register_adapter(_adapter)


@dataclass(frozen=True)
class CausalLm:
    """A causal LM as the part graphs see it: its family's adapter, its config and modules."""

    adapter: LlmAdapter
    config: Any
    embed: nn.Module
    layers: tuple[nn.Module, ...]
    norm: nn.Module
    lm_head: nn.Module
    rotary: nn.Module

    @property
    def head_dim(self) -> int:
        config = self.config
        return int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )

    @property
    def heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def kv_heads(self) -> int:
        return int(getattr(self.config, "num_key_value_heads", None) or self.heads)

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head the rotary embedding turns (Phi's partial rotary)."""
        return int(self.rotary.inv_freq.numel()) * 2

    @property
    def tied(self) -> bool:
        return self.lm_head.weight is self.embed.weight

    def inv_freq(self) -> torch.Tensor:
        """The model's own rotary frequencies (its rope scaling applied)."""
        return self.rotary.inv_freq.detach().float().cpu()

    def attention_scaling(self) -> float:
        return float(getattr(self.rotary, "attention_scaling", 1.0))


def find_causal_lm(model: nn.Module) -> CausalLm:
    """The causal LM inside ``model`` (itself, or the one submodule with an ``lm_head`` and a
    decoder), with its family's adapter; a clear error for anything else."""
    found = [
        m
        for m in model.modules()
        if hasattr(m, "lm_head") and hasattr(getattr(m, "model", None), "layers")
    ]
    if not found:
        raise ConfigError(
            f"the llm format exports a transformers causal LM (a *ForCausalLM with .model.layers "
            f"and .lm_head); {type(model).__name__} holds none. Export other models with the "
            "onnx or onnx_qdq format"
        )
    if len(found) > 1:
        raise ConfigError(
            f"{type(model).__name__} holds {len(found)} causal LMs: export one of them"
        )
    lm = found[0]
    config = lm.config
    model_type = getattr(config, "model_type", None)
    adapter = _ADAPTERS.get(model_type)
    if adapter is None:
        raise ConfigError(
            f"no llm adapter for model type '{model_type}' ({type(lm).__name__}); known: "
            f"{', '.join(sorted(_ADAPTERS))}. Register one with graphbuild.targets.qnn.llm."
            "register_adapter(LlmAdapter(name, (model_type,), projections=...))"
        )
    decoder = lm.model
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise ConfigError(
            f"{type(lm).__name__}.model has no rotary_emb with inv_freq: the llm format takes "
            "decoders with rotary position embeddings"
        )
    return CausalLm(
        adapter,
        config,
        decoder.embed_tokens,
        tuple(decoder.layers),
        decoder.norm,
        lm.lm_head,
        rotary,
    )
