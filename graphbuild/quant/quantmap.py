"""The quant map: what each quantizer in a graph is, apart from its values.

``normalize`` produces a :class:`QuantMap` (structure: bits, grid, axis, which tensor) and a
:class:`QuantValues` (scales and zero points). Keeping them apart is what lets a retuned scale
skip tracing and ONNX conversion (docs/design.md, invariant 5).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch


@dataclass(frozen=True)
class ValueRef:
    """Where a quantizer's scale or zero point comes from.

    ``kind`` is ``"state"`` (a parameter or buffer of the exported program, by name),
    ``"constant"`` (a lifted tensor constant of the program, by name), ``"literal"`` (a
    number written into the graph; ``name`` is then ``"<node>:<arg index>"``) or
    ``"computed"``: a value the graph computes from state and constants with a few pure
    ATen ops (AIMET's scale from its min/max parameters, FastForward's zero point from its
    offset); ``expr`` holds those steps as JSON (``frontend.qvalues.evaluate``) and ``name``
    the graph node it stands for, for messages.
    """

    kind: str
    name: str
    expr: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.expr is None:
            del data["expr"]  # the quant maps of every other kind read as they always have
        return data


@dataclass(frozen=True)
class QuantSpec:
    """One quantizer: ``x = scale * (q - zero_point)`` with ``q`` in ``[qmin, qmax]``.

    ``bits`` is the grid's width as QNN counts it (``bw``); ``signed`` says whether the grid
    sits in a signed container. ``axis`` is the channel axis (per-channel and blocked);
    ``block_size`` the block length along ``axis`` (blocked only). ``param`` names the state
    tensor the quantizer acts on when it quantizes a weight or buffer, else ``None``.
    ``symmetric`` is ``None`` when only the values can tell (zero point at the grid's centre).

    Low-power blockwise quantization (LPBQ, AIMET's ``GroupedBlockQuantizeDequantize`` and
    QNN's ``enc_type: LPBQ``) is a blocked quantizer whose per-block scales are integers in
    ``[1, 2^block_scale_bits]`` times one float scale per channel along ``channel_axis``
    (:mod:`graphbuild.quant.lpbq`): ``block_scale_bits`` is set only then, and QNN's
    decompressed bit-width is ``bits + block_scale_bits``.
    """

    qid: int
    bits: int
    signed: bool
    qmin: int
    qmax: int
    axis: int | None = None
    block_size: int | None = None
    param: str | None = None
    op: str = ""
    node: str = ""
    scale: ValueRef | None = None
    zero_point: ValueRef | None = None
    symmetric: bool | None = None
    block_scale_bits: int | None = None
    channel_axis: int | None = None

    @property
    def is_lpbq(self) -> bool:
        return self.block_scale_bits is not None

    @property
    def granularity(self) -> str:
        if self.block_scale_bits is not None:
            return "LPBQ"
        if self.block_size is not None:
            return "PER_BLOCK"
        return "PER_TENSOR" if self.axis is None else "PER_CHANNEL"

    def to_json(self) -> dict[str, Any]:
        # the fields are flat: no deep copy (asdict), a quant map has a spec per quantizer
        data = {name: getattr(self, name) for name in _SPEC_FIELDS}
        for key in ("scale", "zero_point"):
            ref = getattr(self, key)
            data[key] = ref.to_json() if ref is not None else None
        for key in _LPBQ_FIELDS:  # the quant maps of every other quantizer read as they did
            if data[key] is None:
                del data[key]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> QuantSpec:
        data = dict(data)
        for key in ("scale", "zero_point"):
            if data.get(key) is not None:
                data[key] = ValueRef(**data[key])
        return cls(**data)


_LPBQ_FIELDS = ("block_scale_bits", "channel_axis")
_SPEC_FIELDS = tuple(f.name for f in fields(QuantSpec))


@dataclass(frozen=True)
class QuantMap:
    """Every quantizer of a graph, by ``qid`` (0..n-1 in graph order)."""

    specs: tuple[QuantSpec, ...] = ()

    def __iter__(self) -> Iterator[QuantSpec]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __getitem__(self, qid: int) -> QuantSpec:
        return self.specs[qid]

    def to_json(self) -> dict[str, Any]:
        return {"quantizers": [s.to_json() for s in self.specs]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> QuantMap:
        return cls(tuple(QuantSpec.from_json(s) for s in data["quantizers"]))


@dataclass(frozen=True)
class QParams:
    """A quantizer's values: ``scale`` float32 and ``zero_point`` int64, both 1-D for
    per-tensor (one element) and per-channel; blocked keeps the weight's rank.

    An LPBQ quantizer also has ``channel_scale`` (float32, one per channel) and
    ``block_int_scale`` (int64, shaped like ``scale``); ``scale`` is then their product, the
    block scale the quantizer uses (:func:`graphbuild.quant.lpbq.compress`).
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    channel_scale: torch.Tensor | None = None
    block_int_scale: torch.Tensor | None = None


@dataclass
class QuantValues:
    """Scales and zero points by ``qid``."""

    values: dict[int, QParams] = field(default_factory=dict)

    def __getitem__(self, qid: int) -> QParams:
        return self.values[qid]

    def __len__(self) -> int:
        return len(self.values)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for qid, p in sorted(self.values.items()):
            out[f"{qid}.scale"] = p.scale
            out[f"{qid}.zero_point"] = p.zero_point
            if p.channel_scale is not None and p.block_int_scale is not None:
                out[f"{qid}.channel_scale"] = p.channel_scale
                out[f"{qid}.block_int_scale"] = p.block_int_scale
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> QuantValues:
        qids = sorted({int(k.split(".")[0]) for k in tensors})
        return cls(
            {
                q: QParams(
                    tensors[f"{q}.scale"],
                    tensors[f"{q}.zero_point"],
                    tensors.get(f"{q}.channel_scale"),
                    tensors.get(f"{q}.block_int_scale"),
                )
                for q in qids
            }
        )
