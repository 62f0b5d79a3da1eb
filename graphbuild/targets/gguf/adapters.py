"""Architecture adapters: how a transformers model becomes llama.cpp's tensors and metadata.

An :class:`ArchAdapter` is everything architecture-specific the GGUF target knows: which
transformers ``model_type`` it takes, llama.cpp's architecture name, the tensor names llama.cpp
expects for each of the model's parameters, which rows llama.cpp wants reordered (Llama's
RoPE Q/K permutation), the hyperparameters it reads, and the pre-tokenizer it names by
default. The built-in adapters cover Llama, Qwen2 and Qwen3; a user adds one with
:func:`register_adapter` (or passes it as the ``architecture`` option), and it is part of the
keys of the stages that consult it (``registry.gguf_adapters``).

Facts from llama.cpp (``convert_hf_to_gguf.py``, ``conversion/llama.py`` and ``qwen.py``,
``src/llama-model.cpp``): Llama's Q and K projection rows (and biases) are permuted per head
from the Hugging Face layout to the interleaved one llama.cpp's RoPE uses, with K by the
key/value head count; Qwen2 and Qwen3 use NeoX RoPE and are not permuted; Qwen2 carries Q/K/V
biases, Qwen3 per-head Q/K RMSNorm weights; an absent ``output.weight`` makes llama.cpp use
``token_embd.weight`` (tied embeddings).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from graphbuild.engine.fingerprint import register_registry
from graphbuild.errors import ConfigError, ExportError

#: One metadata entry: (key, GGUF value type, value); see :mod:`.container`.
Entry = tuple[str, str, Any]

#: Hugging Face parameter names (relative to the causal LM) -> GGUF names; ``{bid}`` is the
#: layer number the pattern's first group captured.
LLAMA_TENSORS: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "blk.{bid}.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "blk.{bid}.attn_q.{kind}"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "blk.{bid}.attn_k.{kind}"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "blk.{bid}.attn_v.{kind}"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", "blk.{bid}.attn_output.{kind}"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "blk.{bid}.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.(weight|bias)", "blk.{bid}.ffn_gate.{kind}"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.(weight|bias)", "blk.{bid}.ffn_up.{kind}"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.(weight|bias)", "blk.{bid}.ffn_down.{kind}"),
)
QK_NORM_TENSORS: tuple[tuple[str, str], ...] = (
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "blk.{bid}.attn_q_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "blk.{bid}.attn_k_norm.weight"),
)


@dataclass(frozen=True)
class ArchAdapter:
    """What the GGUF target needs to know about one architecture.

    ``name``: llama.cpp's architecture (``general.architecture``, the prefix of its keys).
    ``model_types``: the transformers ``config.model_type`` values it takes. ``tensors``:
    ``(regex, GGUF name)`` pairs over the parameter names of the causal LM (``model.layers.0
    .self_attn.q_proj.weight``); a template may use ``{bid}`` (the first group) and ``{kind}``
    (the second); a parameter no pattern matches is left out of the file and reported.
    ``anchor``: the one parameter every model of the architecture has, which locates the
    causal LM inside a wrapper (``LogitsOnly(model).model.model.embed_tokens.weight``).
    ``rope_heads``: ``(gguf_name, config) -> head count or None``: rows of that tensor are
    permuted per head as llama.cpp's Llama loader expects. ``hparams``: ``config -> entries``
    under the architecture's prefix (``llama.context_length``...). ``tokenizer_pre``:
    llama.cpp's pre-tokenizer when the tokenizer does not say. ``output_fallback``: the
    tensor llama.cpp reads in place of ``output.weight`` when the file has none (a tied
    embedding is then written once). ``embedding``: the tensor llama.cpp looks tokens up in
    (a quantizer of a tied parameter's lookup belongs to it).
    """

    name: str
    model_types: tuple[str, ...]
    tensors: tuple[tuple[str, str], ...]
    hparams: Callable[[Any], list[Entry]]
    anchor: str = "model.embed_tokens.weight"
    rope_heads: Callable[[str, Any], int | None] | None = None
    tokenizer_pre: str = "default"
    output_fallback: tuple[str, str] | None = ("output.weight", "token_embd.weight")
    embedding: str = "token_embd.weight"

    def gguf_name(self, hf_name: str) -> str | None:
        """The GGUF name of a causal-LM parameter, or None when the file has no place for it."""
        for pattern, template in self.tensors:
            m = re.fullmatch(pattern, hf_name)  # re caches compiled patterns
            if m is not None:
                groups = m.groups()
                bid = groups[0] if groups else ""
                kind = groups[1] if len(groups) > 1 else ""
                return template.format(bid=bid, kind=kind)
        return None


# --------------------------------------------------------------------------- hyperparameters


def config_value(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` the config has (not None), else ``default``."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def head_dim(config: Any) -> int:
    return int(config_value(config, "head_dim", default=config.hidden_size // heads(config)))


def heads(config: Any) -> int:
    return int(config.num_attention_heads)


def kv_heads(config: Any) -> int:
    return int(config_value(config, "num_key_value_heads", default=heads(config)))


def rope(config: Any) -> dict[str, Any]:
    """RoPE parameters (transformers 5 ``rope_parameters``; 4.x ``rope_theta`` and
    ``rope_scaling``)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    merged = {**scaling, **params}
    if "rope_theta" not in merged and getattr(config, "rope_theta", None) is not None:
        merged["rope_theta"] = config.rope_theta
    merged.setdefault("rope_type", merged.get("type", "default"))
    return merged


def common_hparams(arch: str, config: Any) -> list[Entry]:
    """The hyperparameters llama.cpp reads for Llama-family decoders (what its converter
    writes): context, widths, layers, heads, RoPE, RMSNorm epsilon, vocabulary size."""
    p = f"{arch}."
    entries: list[Entry] = [
        (p + "context_length", "uint32", int(config.max_position_embeddings)),
        (p + "embedding_length", "uint32", int(config.hidden_size)),
        (p + "block_count", "uint32", int(config.num_hidden_layers)),
        (p + "feed_forward_length", "uint32", int(config.intermediate_size)),
        (p + "attention.head_count", "uint32", heads(config)),
        (p + "attention.head_count_kv", "uint32", kv_heads(config)),
        (p + "attention.layer_norm_rms_epsilon", "float32", float(config.rms_norm_eps)),
        (p + "rope.dimension_count", "uint32", head_dim(config)),
        (p + "vocab_size", "uint32", int(config.vocab_size)),
    ]
    if getattr(config, "head_dim", None) is not None:
        entries += [
            (p + "attention.key_length", "uint32", head_dim(config)),
            (p + "attention.value_length", "uint32", head_dim(config)),
        ]
    params = rope(config)
    if params.get("rope_theta") is not None:
        entries.append((p + "rope.freq_base", "float32", float(params["rope_theta"])))
    kind = params["rope_type"]
    if kind == "linear" and params.get("factor") is not None:
        entries += [
            (p + "rope.scaling.type", "string", "linear"),
            (p + "rope.scaling.factor", "float32", float(params["factor"])),
        ]
    elif kind not in ("default", None):
        raise ExportError(
            f"RoPE type '{kind}' of this {arch} model is not supported by the GGUF target "
            "(default and linear are); register an adapter whose hparams write it"
        )
    return entries


def _llama_rope_heads(gguf_name: str, config: Any) -> int | None:
    if re.fullmatch(r"blk\.\d+\.attn_q\.(weight|bias)", gguf_name):
        return heads(config)
    if re.fullmatch(r"blk\.\d+\.attn_k\.(weight|bias)", gguf_name):
        return kv_heads(config)
    return None


LLAMA = ArchAdapter(
    name="llama",
    model_types=("llama",),
    tensors=LLAMA_TENSORS,
    hparams=lambda config: common_hparams("llama", config),
    rope_heads=_llama_rope_heads,
    tokenizer_pre="llama-bpe",
)
QWEN2 = ArchAdapter(
    name="qwen2",
    model_types=("qwen2",),
    tensors=LLAMA_TENSORS,
    hparams=lambda config: common_hparams("qwen2", config),
    tokenizer_pre="qwen2",
)
QWEN3 = ArchAdapter(
    name="qwen3",
    model_types=("qwen3",),
    tensors=LLAMA_TENSORS + QK_NORM_TENSORS,
    hparams=lambda config: common_hparams("qwen3", config),
    tokenizer_pre="qwen2",
)

_ADAPTERS: dict[str, ArchAdapter] = {}


def register_adapter(adapter: ArchAdapter, *, replace: bool = False) -> None:
    """Make ``adapter`` the one for its ``model_types`` (``replace=True`` overrides one
    registered before, a built-in included)."""
    for model_type in adapter.model_types:
        if model_type in _ADAPTERS and not replace and _ADAPTERS[model_type] is not adapter:
            raise ConfigError(
                f"an adapter for model type '{model_type}' is already registered "
                f"({_ADAPTERS[model_type].name}); pass replace=True to override it"
            )
    for model_type in adapter.model_types:
        _ADAPTERS[model_type] = adapter


def unregister_adapter(adapter: ArchAdapter) -> None:
    """Forget ``adapter`` for every model type it is registered for."""
    for model_type, registered in list(_ADAPTERS.items()):
        if registered is adapter:
            del _ADAPTERS[model_type]


def adapters() -> dict[str, ArchAdapter]:
    """Registered adapters by transformers model type."""
    return dict(_ADAPTERS)


for _builtin in (LLAMA, QWEN2, QWEN3):
    register_adapter(_builtin)
register_registry("gguf_adapters", adapters)


def find_adapter(config: Any, chosen: ArchAdapter | str | None) -> ArchAdapter:
    """The adapter for ``config``: ``chosen`` when given (an adapter, or the model type or
    llama.cpp architecture name of a registered one), else the one registered for the
    config's ``model_type``."""
    if isinstance(chosen, ArchAdapter):
        return chosen
    registered = adapters()
    if isinstance(chosen, str):
        for adapter in registered.values():
            if chosen in (adapter.name, *adapter.model_types):
                return adapter
        raise ConfigError(
            f"no GGUF architecture adapter named '{chosen}'; known: {', '.join(sorted(registered))}"
        )
    model_type = getattr(config, "model_type", None)
    if model_type in registered:
        return registered[model_type]
    raise ExportError(
        f"no GGUF architecture adapter for transformers model type '{model_type}'; known: "
        f"{', '.join(sorted(registered))}. Register one with "
        "graphbuild.targets.gguf.register_adapter(ArchAdapter(...)) or name one with the "
        "architecture option"
    )


def find_config(model: Any) -> tuple[Any, str]:
    """The transformers config the model carries (``model.config`` or a submodule's, the
    shallowest first) and that submodule's path."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ExportError(f"the GGUF target exports a torch.nn.Module, not {type(model).__name__}")
    for path, module in sorted(model.named_modules(), key=lambda item: item[0].count(".")):
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "model_type", None) is not None:
            return config, path
    raise ExportError(
        "the model carries no transformers config (a `config` attribute with a `model_type`, "
        "on the model or a submodule): the GGUF target reads the architecture's "
        "hyperparameters from it; set `model.config = <PretrainedConfig>`"
    )


def source_prefix(names: Sequence[str], adapter: ArchAdapter) -> str:
    """The prefix of the causal LM's parameters in the model's state names, found by the
    adapter's anchor parameter (``""`` for the causal LM itself)."""
    found = sorted(n[: -len(adapter.anchor)] for n in names if n.endswith(adapter.anchor))
    found = [p for p in found if p == "" or p.endswith(".")]
    if not found:
        raise ExportError(
            f"the model has no parameter named like '{adapter.anchor}' (the {adapter.name} "
            "adapter's anchor), so its tensors cannot be named for llama.cpp"
        )
    if len(found) > 1:
        raise ExportError(
            f"the model has several parameters named like '{adapter.anchor}' "
            f"({', '.join(p + adapter.anchor for p in found[:4])}): export the causal LM itself"
        )
    return found[0]
