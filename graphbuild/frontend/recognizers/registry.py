"""What a recogniser returns (:class:`Match`), what one is (:class:`Recognizer`), and the registry.

Recognisers are tried in registration order; :func:`register_recognizer` adds one for a custom
quantizer op (``first=True``: before the built-ins).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch.export import ExportedProgram
from torch.fx import Node

from graphbuild.quant.quantmap import ValueRef


def grid_bits(qmin: int, qmax: int) -> int:
    """Bits a grid ``[qmin, qmax]`` needs: ``ceil(log2(qmax - qmin + 1))``."""
    if qmax <= qmin:
        raise ValueError(f"empty quantization grid [{qmin}, {qmax}]")
    return (qmax - qmin).bit_length()


@dataclass(frozen=True)
class Match:
    """What a recogniser found at a node.

    ``input`` is the tensor being quantized; ``replaces`` every node the marker stands for (the
    fake-quant node, or the quantize node and all its dequantize users). Nodes of ``replaces``
    with users outside it are the quantizer's outputs: their users are rewired to the marker.
    The matched node must be one of ``replaces``. ``scale`` and ``zero_point`` say where the
    values live (see :func:`value_ref`); a ``zero_point`` of None means zero. ``bits`` and
    ``signed`` default to what the grid implies (``grid_bits``, ``qmin < 0``).
    ``block_scale_bits`` and ``channel_axis`` make a blocked quantizer LPBQ (see
    :class:`~graphbuild.quant.quantmap.QuantSpec`).
    """

    input: Node
    replaces: tuple[Node, ...]
    op: str
    qmin: int
    qmax: int
    scale: ValueRef
    zero_point: ValueRef | None = None
    axis: int | None = None
    block_size: int | None = None
    bits: int | None = None
    signed: bool | None = None
    symmetric: bool | None = None
    block_scale_bits: int | None = None
    channel_axis: int | None = None

    def __post_init__(self) -> None:
        if self.bits is None:
            object.__setattr__(self, "bits", grid_bits(self.qmin, self.qmax))
        if self.signed is None:
            object.__setattr__(self, "signed", self.qmin < 0)


@runtime_checkable
class Recognizer(Protocol):
    """Recognises one quantizer form. ``match`` must not modify the program."""

    def match(self, node: Node, program: ExportedProgram) -> Match | None: ...


_registry: list[Recognizer] = []


def register_recognizer(recognizer: Recognizer, *, first: bool = False) -> Recognizer:
    """Add ``recognizer`` (tried after the others, or before them with ``first=True``)."""
    if not isinstance(recognizer, Recognizer):
        raise TypeError(f"{recognizer!r} has no match(node, program) method")
    if first:
        _registry.insert(0, recognizer)
    else:
        _registry.append(recognizer)
    return recognizer


def unregister_recognizer(recognizer: Recognizer) -> None:
    """Remove a recogniser added with :func:`register_recognizer`."""
    _registry.remove(recognizer)


def recognizers() -> tuple[Recognizer, ...]:
    """The recognisers, in the order they are tried."""
    return tuple(_registry)
