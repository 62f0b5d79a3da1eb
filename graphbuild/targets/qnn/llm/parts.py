"""The part modules: a causal LM rebuilt as the HTP runs it, from the model's own submodules.

Every part has static shapes for a sequence of ``N`` tokens (``N = prompt_len`` for the prompt
graph, 1 for the token graph) in a context of ``CL`` positions:

- :class:`EmbedPart`: ``input_ids`` int32 [1, N] -> ``hidden_states`` [1, N, E];
- :class:`DecoderPart`: ``hidden_states`` [1, N, E], the additive ``attention_mask``
  [1, 1, N, CL], the rotary tables ``position_ids_cos`` / ``position_ids_sin`` [1, 1, N, R/2]
  (R the rotary dimensions of a head), and per layer the past keys [H, 1, D, CL-N] and values
  [H, 1, CL-N, D] -> ``hidden_states`` (the last part: ``logits`` [1, N, V]) and per layer the N
  new keys [H, 1, D, N] and values [H, 1, N, D].

Key slots 0..CL-N-1 of the mask are the past, CL-N..CL-1 the N new tokens. The rotary tables
are inputs, so no float position arithmetic is in a graph; keys are cached transposed, as
onnxruntime-genai's windowed cache and Genie lay them out.

The float bundle's parts (``float_cache=True``) take onnxruntime-genai's default cache instead:
``S`` new tokens after ``P`` past ones, both dynamic, the mask [1, 1, S, P+S], per layer the past
keys and values [1, H, P, D] -> the presents [1, H, P+S, D] (the past with the new entries
appended), all float.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from graphbuild.targets.qnn.llm.adapters import CausalLm

#: The additive mask's value for a slot a query does not attend: far enough below the scores
#: that it weighs nothing after the softmax, near enough that a quantized mask keeps its steps.
MASK_MIN = -50.0
#: The graph kind of the float bundle: one graph per part, any number of tokens after any past.
FLOAT = "float"


@dataclass(frozen=True)
class PartSpec:
    """One part: its number (1-based), the decoder layers it holds (``range(first, stop)``;
    empty for the embedding part) and whether it ends with the final norm and LM head."""

    index: int
    count: int
    first: int
    stop: int
    head: bool = False

    @property
    def embed(self) -> bool:
        return self.index == 1

    @property
    def layers(self) -> range:
        return range(self.first, self.stop)

    def graph_name(self, kind: str, seq_len: int, context_len: int) -> str:
        """``prompt_ar128_cl4096_2_of_3``: the QNN graph name runtimes look parts up by;
        ``float_2_of_3`` for the float bundle's graph (any length)."""
        if kind == FLOAT:
            return f"{kind}_{self.index}_of_{self.count}"
        return f"{kind}_ar{seq_len}_cl{context_len}_{self.index}_of_{self.count}"

    def input_names(self) -> list[str]:
        if self.embed:
            return ["input_ids"]
        names = [
            f"hidden_states_{self.index - 1}",
            "attention_mask",
            "position_ids_cos",
            "position_ids_sin",
        ]
        for layer in self.layers:
            names += [f"past_key_{layer}_in", f"past_value_{layer}_in"]
        return names

    def output_names(self) -> list[str]:
        if self.embed:
            return [f"hidden_states_{self.index}"]
        names = ["logits" if self.head else f"hidden_states_{self.index}"]
        for layer in self.layers:
            names += [f"past_key_{layer}_out", f"past_value_{layer}_out"]
        return names


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``x`` [1, heads, N, D] from half tables [1, 1, N, R/2]; the
    dimensions past R (partial rotary) pass unchanged."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    turned = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((turned, rest), dim=-1) if rest.shape[-1] else turned


class EmbedPart(nn.Module):
    """Part 1: the token embedding lookup."""

    def __init__(self, lm: CausalLm) -> None:
        super().__init__()
        self.embed_tokens = lm.embed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class DecoderPart(nn.Module):
    """Consecutive decoder layers of the causal LM (its own modules), and for the last part
    the final norm and the LM head."""

    def __init__(self, lm: CausalLm, spec: PartSpec, float_cache: bool = False) -> None:
        super().__init__()
        self.float_cache = float_cache
        self.layers = nn.ModuleList(lm.layers[i] for i in spec.layers)
        self.head = spec.head
        if spec.head:
            self.norm = lm.norm
            self.lm_head = lm.lm_head
        self._projections = lm.adapter.projections
        self._qk_norm = lm.adapter.qk_norm
        self.heads = lm.heads
        self.kv_heads = lm.kv_heads
        self.head_dim = lm.head_dim

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        new_kv: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            past_key, past_value = past[2 * i], past[2 * i + 1]
            attended, key, value = self._attention(
                layer, layer.input_layernorm(hidden), attention_mask, cos, sin, past_key, past_value
            )
            hidden = hidden + attended
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            new_kv += [key, value]
        if self.head:
            hidden = self.lm_head(self.norm(hidden))
        return (hidden, *new_kv)

    def _attention(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        mask: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_key: torch.Tensor,
        past_value: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = layer.self_attn
        n, d, heads, kv_heads = x.shape[1], self.head_dim, self.heads, self.kv_heads
        q, k, v = self._projections(attn, x)
        q = q.view(1, n, heads, d)
        k = k.view(1, n, kv_heads, d)
        if self._qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = rotate(q.transpose(1, 2), cos, sin)  # [1, heads, N, D]
        k = rotate(k.transpose(1, 2), cos, sin)  # [1, kv_heads, N, D]
        v = v.view(1, n, kv_heads, d).transpose(1, 2)
        if self.float_cache:  # [1, kv_heads, P, D] in, the past and the new entries out
            present_key = torch.cat((past_key, k), dim=2)
            values = torch.cat((past_value, v), dim=2)
            keys = present_key.transpose(2, 3)
            # the mask's last P+S keys: genai's mask is exactly as long, and the cut keeps its
            # length a dimension of its own in the trace (a derived P+S does not survive
            # torch.export's save and load)
            mask = mask[..., mask.shape[-1] - keys.shape[-1] :]
        else:
            keys = torch.cat((past_key.permute(1, 0, 2, 3), k.transpose(2, 3)), dim=-1)
            values = torch.cat((past_value.permute(1, 0, 2, 3), v), dim=2)
        # query heads g*j .. g*j+g-1 read key/value head j
        group = heads // kv_heads
        scores = torch.matmul(q.reshape(1, kv_heads, group * n, d), keys)
        scale = getattr(attn, "scaling", None) or d**-0.5
        scores = scores.view(1, heads, n, -1) * scale + mask
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs.view(1, kv_heads, group * n, -1), values)
        out = out.view(1, heads, n, d).transpose(1, 2).reshape(1, n, heads * d)
        if self.float_cache:
            return attn.o_proj(out), present_key, values
        return attn.o_proj(out), k.permute(1, 0, 3, 2), v.permute(1, 0, 2, 3)


def part_module(lm: CausalLm, spec: PartSpec, float_cache: bool = False) -> nn.Module:
    """The module of one part, in evaluation mode (``float_cache``: the float bundle's, with
    onnxruntime-genai's default cache layout)."""
    module = EmbedPart(lm) if spec.embed else DecoderPart(lm, spec, float_cache)
    return module.eval()


def plan_parts(layers: int, parts: int) -> tuple[PartSpec, ...]:
    """``parts`` parts: the embedding alone, then the decoder layers split as evenly as they go
    (earlier parts take the remainder), the last part ending with the LM head."""
    groups = parts - 1
    base, extra = divmod(layers, groups)
    specs = [PartSpec(1, parts, 0, 0)]
    first = 0
    for g in range(groups):
        stop = first + base + (1 if g < extra else 0)
        specs.append(PartSpec(g + 2, parts, first, stop, head=g == groups - 1))
        first = stop
    return tuple(specs)


def layer_bytes(lm: CausalLm, layers: Sequence[int], bytes_per_weight: float) -> int:
    """The device bytes of the given layers' weights at ``bytes_per_weight``."""
    count = sum(p.numel() for i in layers for p in lm.layers[i].parameters())
    return int(count * bytes_per_weight)
