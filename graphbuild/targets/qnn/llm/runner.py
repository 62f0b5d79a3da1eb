"""Generation through the part modules, as a runtime runs the part graphs.

:class:`PartRunner` is the protocol the graphs are built for, in torch: a prompt goes through
the prompt graphs in chunks of ``N`` tokens (the last chunk padded on the left, so its last row
predicts the next token), then each new token through the token graphs. The KV cache keeps
the ``CL - N`` most recent positions, right-aligned in the past slots, each layer's new entries
appended after a step (quantized to the layer's KV encoding when there is one, as the runtime
stores the graph's integer output). The same runner records what each part receives, which is
what the parts are calibrated on: the statistics are those of generation, not of one traced
batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphbuild.targets.qnn.llm.adapters import CausalLm
from graphbuild.targets.qnn.llm.parts import MASK_MIN, PartSpec, part_module

#: (part, "prompt" or "token", the part's inputs) for every part call
Recorder = Callable[[PartSpec, str, tuple[torch.Tensor, ...]], None]
#: runs one part graph: (part, kind, inputs) -> outputs (the part's hidden states or logits
#: alone for the embedding part, else a tuple with the new KV entries after it)
Caller = Callable[[PartSpec, str, tuple[torch.Tensor, ...]], Any]


@dataclass(frozen=True)
class KvEncoding:
    """One tensor's KV encoding: ``x = scale * (q - zero_point)`` on [0, 2^bits - 1]."""

    scale: float
    zero_point: int
    bits: int = 8

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        qmax = (1 << self.bits) - 1
        q = torch.clamp(torch.round(x / self.scale) + self.zero_point, 0, qmax)
        return (q - self.zero_point) * self.scale


@dataclass
class Generation:
    """Generated token ids and the logits that chose each of them."""

    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


def rotary_tables(
    inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [1, 1, N, R/2] of ``positions`` [N] (float64 angles, as precise as the
    model's own tables)."""
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    cos = (torch.cos(angles) * scaling).float()[None, None]
    sin = (torch.sin(angles) * scaling).float()[None, None]
    return cos, sin


def attention_mask(valid_past: int, pad: int, seq_len: int, context_len: int) -> torch.Tensor:
    """The additive mask [1, 1, N, CL]: row r (a real token when r >= pad) attends the
    ``valid_past`` right-aligned past slots and the new slots of real tokens up to itself; a
    padding row attends itself only."""
    past_slots = context_len - seq_len
    mask = torch.full((1, 1, seq_len, context_len), MASK_MIN)
    for r in range(seq_len):
        if r < pad:
            mask[0, 0, r, past_slots + r] = 0.0
            continue
        mask[0, 0, r, past_slots - valid_past : past_slots] = 0.0
        mask[0, 0, r, past_slots + pad : past_slots + r + 1] = 0.0
    return mask


class PartRunner:
    """Greedy generation through the part modules (see the module's docstring)."""

    def __init__(
        self,
        lm: CausalLm,
        specs: Sequence[PartSpec],
        prompt_len: int,
        context_len: int,
        kv_encodings: Mapping[str, KvEncoding] | None = None,
        recorder: Recorder | None = None,
        caller: Caller | None = None,
    ) -> None:
        self.lm = lm
        self.specs = tuple(specs)
        self.modules = {s.index: part_module(lm, s) for s in self.specs}
        self.caller = caller or (lambda spec, kind, inputs: self.modules[spec.index](*inputs))
        self.prompt_len = prompt_len
        self.context_len = context_len
        self.kv_encodings = dict(kv_encodings or {})
        self.recorder = recorder
        self.inv_freq = lm.inv_freq()
        self.scaling = lm.attention_scaling()
        self.cache: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], steps: int) -> Generation:
        """``steps`` greedy tokens after ``prompt``."""
        if not prompt:
            raise ValueError("a prompt of at least one token")
        cache: dict[str, torch.Tensor] = {}
        self.cache = cache  # the KV entries this generation wrote, per tensor
        out = Generation()
        position = 0
        chunks = [
            list(prompt[i : i + self.prompt_len]) for i in range(0, len(prompt), self.prompt_len)
        ]
        logits = None
        for chunk in chunks:
            logits = self._step("prompt", chunk, position, cache)
            position += len(chunk)
        for step in range(steps):
            token = int(torch.argmax(logits))
            out.tokens.append(token)
            out.logits.append(logits)
            if step == steps - 1 or position >= self.context_len:
                break
            logits = self._step("token", [token], position, cache)
            position += 1
        return out

    @torch.no_grad()
    def replay(self, prompt: Sequence[int], continuation: Sequence[int]) -> None:
        """Run ``prompt`` through the prompt graphs, then each token of ``continuation`` through
        the token graphs, as generation would had it chosen them (teacher forcing): what each
        layer receives then depends on the tokens and the layers before it alone."""
        if not prompt:
            raise ValueError("a prompt of at least one token")
        cache: dict[str, torch.Tensor] = {}
        self.cache = cache
        position = 0
        for i in range(0, len(prompt), self.prompt_len):
            chunk = list(prompt[i : i + self.prompt_len])
            self._step("prompt", chunk, position, cache)
            position += len(chunk)
        for token in continuation:
            if position >= self.context_len:
                break
            self._step("token", [int(token)], position, cache)
            position += 1

    def _step(
        self, kind: str, tokens: list[int], position: int, cache: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        n = self.prompt_len if kind == "prompt" else 1
        pad = n - len(tokens)
        past_slots = self.context_len - n
        ids = torch.tensor([[0] * pad + tokens], dtype=torch.int32)
        positions = torch.tensor([0] * pad + list(range(position, position + len(tokens))))
        cos, sin = rotary_tables(self.inv_freq, self.scaling, positions)
        valid = min(position, past_slots)
        mask = attention_mask(valid, pad, n, self.context_len)
        hidden = None
        for spec in self.specs:
            if spec.embed:
                inputs: tuple[torch.Tensor, ...] = (ids,)
            else:
                inputs = (hidden, mask, cos, sin, *self._past(spec, cache, past_slots))
            if self.recorder is not None:
                self.recorder(spec, kind, inputs)
            outputs = self.caller(spec, kind, inputs)
            if spec.embed:
                hidden = outputs
                continue
            hidden = outputs[0]
            for i, layer in enumerate(spec.layers):
                self._append(cache, f"past_key_{layer}", outputs[1 + 2 * i][..., pad:], -1)
                self._append(cache, f"past_value_{layer}", outputs[2 + 2 * i][:, :, pad:], 2)
        return hidden[0, -1]

    def _past(
        self, spec: PartSpec, cache: dict[str, torch.Tensor], slots: int
    ) -> list[torch.Tensor]:
        lm = self.lm
        h, d = lm.kv_heads, lm.head_dim
        out = []
        for layer in spec.layers:
            key = torch.zeros(h, 1, d, slots)
            value = torch.zeros(h, 1, slots, d)
            held = cache.get(f"past_key_{layer}")
            if held is not None:
                kept = min(held.shape[-1], slots)
                if kept:
                    key[..., slots - kept :] = held[..., held.shape[-1] - kept :]
                    vals = cache[f"past_value_{layer}"]
                    value[:, :, slots - kept :] = vals[:, :, vals.shape[2] - kept :]
            out += [key, value]
        return out

    def _append(
        self, cache: dict[str, torch.Tensor], name: str, new: torch.Tensor, dim: int
    ) -> None:
        encoding = self.kv_encodings.get(name)
        if encoding is not None:
            new = encoding.round_trip(new)
        held = cache.get(name)
        cache[name] = new if held is None else torch.cat((held, new), dim=dim)
