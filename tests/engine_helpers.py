"""Shared helpers for the engine's tests: counted stages, an event recorder, a counting codec
and tiny real torch models.

Stage functions keep their call log in the module global ``CALLS`` rather than in a closure:
closure values are part of a stage's code version, so a closed-over list that grows would
change every key it is in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphbuild.engine.codecs import Codec, Encoded, Part, register_codec
from graphbuild.engine.scheduler import EventKind, StageEvent

CALLS: list[str] = []
DECODES: list[str] = []


def reset() -> None:
    CALLS.clear()
    DECODES.clear()


def stage(name: str, body: Callable[[Any, Any, Any], Any]) -> Callable[[Any, Any, Any], Any]:
    """A stage that logs its call in ``CALLS`` and returns ``body(inputs, samples, ctx)``."""

    def fn(inputs: Any, samples: Any, ctx: Any) -> Any:
        CALLS.append(name)
        return body(inputs, samples, ctx)

    fn.__name__ = name
    return fn


class Recorder:
    """A run listener keeping every event."""

    def __init__(self) -> None:
        self.events: list[StageEvent] = []

    def __call__(self, event: StageEvent) -> None:
        self.events.append(event)

    def of(self, kind: EventKind) -> list[str]:
        return [e.stage for e in self.events if e.kind is kind]


@dataclass(frozen=True)
class Box:
    """A stage output type whose codec counts its decodes in ``DECODES``."""

    text: str


class BoxCodec(Codec):
    name = "test-box"
    types = (Box,)

    def encode(self, value: Box) -> Encoded:
        return Encoded(self.name, None, [Part(value.text.encode())])

    def decode(self, meta: Any, parts: Sequence[bytes], children: Sequence[Any]) -> Any:
        text = bytes(parts[0]).decode()
        DECODES.append(text)
        return Box(text)


register_codec(BoxCodec())


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=1)
        self.norm = nn.LayerNorm(4, eps=1e-5)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).mean((2, 3))
        return self.fc(self.norm(y))


def tiny_net(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()
