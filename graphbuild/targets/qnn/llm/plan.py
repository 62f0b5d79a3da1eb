"""The part plan: which layers go in which part, and the facts every later stage needs.

The plan depends on the model's structure and the format's options only (never on weight
values), so it is a structure stage: a weight change or a retune keeps it, and every part
graph's stages key on it instead of on the token samples.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from graphbuild.errors import ConfigError
from graphbuild.targets.qnn.llm.adapters import CausalLm
from graphbuild.targets.qnn.llm.parts import (
    FLOAT,
    PartSpec,
    layer_bytes,
    part_module,
    plan_parts,
)

#: The graph kinds of every part: (name, sequence length) with ``N`` standing for prompt_len.
KINDS = ("prompt", "token")
#: The sizes a float graph is traced at (new tokens, past tokens): any other size runs too
#: (:func:`float_dynamic_shapes`); not 0 or 1, which torch.export would specialise.
FLOAT_SAMPLE = (3, 5)

#: What one part may weigh on the device by default: below the HTP's per-context limit of v73
#: (about 2 GB, shared with activations), as Qualcomm's own splits of 3B and 8B models are.
DEFAULT_MAX_PART_BYTES = 1 << 30


@dataclass(frozen=True)
class ModelFacts:
    """What the runtimes' configurations and the part shapes need of the causal LM."""

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    vocab: int
    tied: bool
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None

    @classmethod
    def of(cls, lm: CausalLm) -> ModelFacts:
        config = lm.config
        return cls(
            lm.adapter.name,
            len(lm.layers),
            int(config.hidden_size),
            lm.heads,
            lm.kv_heads,
            lm.head_dim,
            lm.rotary_dim,
            int(config.vocab_size),
            lm.tied,
            getattr(config, "bos_token_id", None),
            getattr(config, "eos_token_id", None),
            getattr(config, "pad_token_id", None),
        )


@dataclass(frozen=True)
class LlmPlan:
    """The parts of one export and its geometry (``N`` prompt tokens, ``CL`` positions)."""

    facts: ModelFacts
    specs: tuple[PartSpec, ...]
    prompt_len: int
    context_len: int

    def spec(self, index: int) -> PartSpec:
        return next(s for s in self.specs if s.index == index)

    def for_graph(self, index: int, kind: str) -> LlmPlan:
        """What one part graph depends on: its part alone, and the prompt length only for a
        prompt graph (a token graph's shapes do not depend on it); a float graph on neither."""
        return LlmPlan(
            self.facts,
            (self.spec(index),),
            self.prompt_len if kind == "prompt" else 0,
            0 if kind == FLOAT else self.context_len,
        )

    def seq_len(self, kind: str) -> int:
        return self.prompt_len if kind == "prompt" else 1

    def graph_name(self, index: int, kind: str) -> str:
        return self.spec(index).graph_name(kind, self.seq_len(kind), self.context_len)

    def part_module(self, lm: CausalLm, index: int, kind: str = "prompt") -> nn.Module:
        return part_module(lm, self.spec(index), float_cache=kind == FLOAT)

    def sample_inputs(self, index: int, kind: str) -> tuple[torch.Tensor, ...]:
        """Zeros of the part's input shapes and dtypes (what it is traced on: its graph
        depends on shapes alone)."""
        if kind == FLOAT:
            return self._float_samples(index)
        spec, n, cl, f = self.spec(index), self.seq_len(kind), self.context_len, self.facts
        if spec.embed:
            return (torch.zeros(1, n, dtype=torch.int32),)
        out = [
            torch.zeros(1, n, f.hidden),
            torch.zeros(1, 1, n, cl),
            torch.zeros(1, 1, n, f.rotary_dim // 2),
            torch.zeros(1, 1, n, f.rotary_dim // 2),
        ]
        for _ in spec.layers:
            out += [torch.zeros(f.kv_heads, 1, f.head_dim, cl - n)]
            out += [torch.zeros(f.kv_heads, 1, cl - n, f.head_dim)]
        return tuple(out)

    def _float_samples(self, index: int) -> tuple[torch.Tensor, ...]:
        spec, f = self.spec(index), self.facts
        s, past = FLOAT_SAMPLE
        if spec.embed:
            return (torch.zeros(1, s, dtype=torch.int32),)
        out = [
            torch.zeros(1, s, f.hidden),
            torch.zeros(1, 1, s, past + s + 1),  # longer: see DecoderPart
            torch.zeros(1, 1, s, f.rotary_dim // 2),
            torch.zeros(1, 1, s, f.rotary_dim // 2),
        ]
        out += [torch.zeros(1, f.kv_heads, past, f.head_dim) for _ in range(2 * len(spec.layers))]
        return tuple(out)

    def to_json(self) -> dict[str, Any]:
        return {
            "facts": asdict(self.facts),
            "parts": [[s.index, s.count, s.first, s.stop, s.head] for s in self.specs],
            "prompt_len": self.prompt_len,
            "context_len": self.context_len,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LlmPlan:
        facts = ModelFacts(**data["facts"])
        specs = tuple(PartSpec(*row) for row in data["parts"])
        return cls(facts, specs, int(data["prompt_len"]), int(data["context_len"]))


def bytes_per_weight(quantizer: Any) -> float:
    """Device bytes of one weight under ``quantizer``: 4-bit presets half a byte, 8-bit one,
    a float export 2 (the HTP runs float as fp16)."""
    name = quantizer if isinstance(quantizer, str) else getattr(quantizer, "preset", None)
    if isinstance(name, str) and name.startswith("w4"):
        return 0.5
    if isinstance(name, str) and name.startswith("w8"):
        return 1.0
    return 2.0


def make_plan(
    lm: CausalLm,
    *,
    prompt_len: int,
    context_len: int,
    parts: int | None,
    max_part_bytes: int | None,
    quantizer: Any,
) -> LlmPlan:
    """Split ``lm`` into parts: ``parts`` of them when given, else the fewest whose decoder
    parts each fit ``max_part_bytes``; errors name the layer or part that does not fit."""
    layers = len(lm.layers)
    limit = max_part_bytes or DEFAULT_MAX_PART_BYTES
    per_weight = bytes_per_weight(quantizer)
    heaviest = max(range(layers), key=lambda i: layer_bytes(lm, [i], per_weight))
    one = layer_bytes(lm, [heaviest], per_weight)
    if one > limit:
        raise ConfigError(
            f"decoder layer {heaviest} alone weighs {one / 2**20:.1f} MiB on the device, over "
            f"max_part_bytes ({limit / 2**20:.1f} MiB): raise max_part_bytes or quantize the "
            "weights to fewer bits"
        )
    if parts is not None:
        if parts < 2:
            raise ConfigError(
                f"parts must be at least 2 (the embedding and the decoder), not {parts}"
            )
        if parts - 1 > layers:
            raise ConfigError(
                f"parts = {parts} asks for {parts - 1} decoder parts, but the model has "
                f"{layers} decoder layers: use at most {layers + 1} parts"
            )
        specs = plan_parts(layers, parts)
        for spec in specs[1:]:
            weight = layer_bytes(lm, list(spec.layers), per_weight)
            if weight > limit:
                need = math.ceil(layer_bytes(lm, range(layers), per_weight) / limit) + 1
                raise ConfigError(
                    f"part {spec.index} of {parts} (layers {spec.first}-{spec.stop - 1}) weighs "
                    f"{weight / 2**20:.1f} MiB on the device, over max_part_bytes "
                    f"({limit / 2**20:.1f} MiB): use about {need} parts"
                )
    else:
        count = 2
        while True:
            specs = plan_parts(layers, count)
            if all(layer_bytes(lm, list(s.layers), per_weight) <= limit for s in specs[1:]):
                break
            count += 1
    return LlmPlan(ModelFacts.of(lm), specs, prompt_len, context_len)


def float_dynamic_shapes(samples: tuple[torch.Tensor, ...]) -> tuple:
    """torch.export's ``dynamic_shapes`` of a float graph's inputs (:meth:`LlmPlan.
    sample_inputs` of kind ``float``): the new tokens ``S`` and the past ``P`` any size, the
    mask's keys ``P + S``. Each dimension is ``Dim.DYNAMIC``: torch works out which are equal
    and that the mask's is the sum (a named ``Dim`` cannot say so)."""
    dyn = torch.export.Dim.DYNAMIC
    if len(samples) == 1:
        return ({1: dyn},)
    kv = tuple({2: dyn} for _ in samples[4:])
    return ({1: dyn}, {2: dyn, 3: dyn}, {2: dyn}, {2: dyn}, kv)
