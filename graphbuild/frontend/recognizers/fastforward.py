"""FastForward's static quantizers in export mode: ``quantize_by_tile`` whose users are all
``dequantize_by_tile`` with the same scale, tiles and offset."""

from __future__ import annotations

from typing import Any

from torch.export import ExportedProgram
from torch.fx import Node

from graphbuild.errors import UnknownQuantizerError
from graphbuild.frontend.recognizers.computed import _tensor_shape, computed_ref
from graphbuild.frontend.recognizers.helpers import (
    _origin,
    _same_arg,
    get_arg,
    op_name,
    op_parts,
    value_ref,
)
from graphbuild.frontend.recognizers.registry import Match
from graphbuild.quant.quantmap import ValueRef


class FastForwardRecognizer:
    """FastForward's static quantizers in export mode (``ff.export_mode(True)``).

    ``fastforward::quantize_by_tile(x, scale, tile_size, num_bits, output_dtype, offset)``
    whose users are all ``fastforward::dequantize_by_tile(q, scale, tile_size, offset,
    output_dtype)`` with the same scale, tiles and offset (FastForward's
    ``quantization/_quantizer_impl.py``): ``q = clamp(round(x / scale - round(offset)),
    -2^(b-1), 2^(b-1) - 1)``, ``x' = (q + round(offset)) * scale``, one scale and offset per
    tile. So the grid is signed ``b``-bit, the zero point ``-round(offset)`` (not clamped:
    FastForward does not clamp it), and the tiles say the granularity: one tile is per
    tensor, tiles one element thick along one axis per channel, tiles ``B`` long along one
    axis and one element thick along every other is blocked (ONNX's ``block_size``).
    """

    namespace = "fastforward"

    def __repr__(self) -> str:
        return "FastForwardRecognizer(fastforward.quantize_by_tile/dequantize_by_tile)"

    def match(self, node: Node, program: ExportedProgram) -> Match | None:
        parts = op_parts(node.target) if node.op == "call_function" else None
        if parts is None or parts[:2] != (self.namespace, "quantize_by_tile"):
            return None
        x, tile, bits = node.args[0], get_arg(node, 2), get_arg(node, 3)
        dequants = list(node.users)
        if (
            not isinstance(x, Node)
            or not dequants
            or not all(self._pairs(node, d) for d in dequants)
        ):
            return None
        shape = _tensor_shape(x)
        if shape is None or not isinstance(tile, (list, tuple)) or len(tile) != len(shape):
            return None
        if not isinstance(bits, (int, float)) or bits != int(bits) or not 2 <= bits <= 32:
            return None
        layout = _tile_layout(shape, [int(t) for t in tile])
        if layout is None:
            raise UnknownQuantizerError(
                f"FastForward quantizer at node '{node.name}': tiles {list(tile)} on a tensor "
                f"of shape {list(shape)} are neither per tensor, per channel nor ONNX blocks"
            )
        axis, block_size, grid = layout
        then = [("reshape.default", [list(grid)])] if block_size is not None else []
        scale = self._value(program, node, 1, then)
        offset = get_arg(node, 5)
        zero_point = None
        if offset is not None:
            zero_point = self._value(
                program, node, 5, [*then, ("round.default", []), ("neg.default", [])]
            )
        if scale is None or (offset is not None and zero_point is None):
            return None
        b = int(bits)
        return Match(
            input=x,
            replaces=(node, *dequants),
            op=op_name(node.target),
            qmin=-(2 ** (b - 1)),
            qmax=2 ** (b - 1) - 1,
            scale=scale,
            zero_point=zero_point,
            axis=axis,
            block_size=block_size,
            bits=b,
            signed=True,
        )

    def _pairs(self, q: Node, dq: Node) -> bool:
        parts = op_parts(dq.target) if dq.op == "call_function" else None
        if (
            parts is None
            or parts[:2] != (self.namespace, "dequantize_by_tile")
            or dq.args[0] is not q
        ):
            return False
        return all(_same_arg(get_arg(q, i), get_arg(dq, j)) for i, j in ((1, 1), (2, 2), (5, 3)))

    @staticmethod
    def _value(
        program: ExportedProgram, node: Node, index: int, then: list[tuple[str, list[Any]]]
    ) -> ValueRef | None:
        arg = get_arg(node, index)
        if not then:
            return value_ref(program, node, index)
        found = computed_ref(program, _origin(arg), then) if isinstance(arg, Node) else None
        return found[0] if found is not None else None


def _tile_layout(
    shape: tuple[int, ...], tile: list[int]
) -> tuple[int | None, int | None, tuple[int, ...]] | None:
    """(axis, block size, tile grid) of FastForward tiles on ``shape``, or None when no
    encoding can say it."""
    if any(t <= 0 or d % t for d, t in zip(shape, tile, strict=True)):
        return None
    grid = tuple(d // t for d, t in zip(shape, tile, strict=True))
    split = [i for i, g in enumerate(grid) if g > 1]
    if not split:
        return None, None, grid
    if len(split) == 1 and tile[split[0]] == 1:
        return split[0], None, grid
    blocked = [i for i in split if tile[i] > 1]
    if len(blocked) == 1 and all(tile[i] == 1 for i in range(len(shape)) if i != blocked[0]):
        return blocked[0], tile[blocked[0]], grid
    return None
