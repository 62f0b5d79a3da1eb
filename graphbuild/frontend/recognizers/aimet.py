"""aimet-torch's ``QuantizeDequantize`` (QuantizationSimModel v2) as ``torch.export`` leaves it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from graphbuild.errors import UnknownQuantizerError
from graphbuild.frontend.recognizers.computed import (
    _exclusive,
    _is_assert,
    _tensor_shape,
    computed_ref,
)
from graphbuild.frontend.recognizers.helpers import (
    _origin,
    _same_arg,
    aten_name,
    get_arg,
)
from graphbuild.frontend.recognizers.registry import Match


def _one(node: Node, names: tuple[str, ...]) -> Node | None:
    """The single user of ``node`` (asserts aside) if it is one of the ATen ops ``names``
    (in-place variants included) reading ``node`` first."""
    users = [u for u in node.users if not _is_assert(u)]
    if len(users) != 1:
        return None
    (user,) = users
    name = aten_name(user.target) if user.op == "call_function" else None
    if name is None or name.rstrip("_") not in names or not user.args or user.args[0] is not node:
        return None
    return user


def _is_noop(node: Node, like: Node) -> bool:
    """``node`` is ``to``/``_to_copy`` to ``like``'s dtype or a ``view``/``reshape`` to its
    shape, with nothing else to it: the identity on ``like``."""
    name = aten_name(node.target) if node.op == "call_function" else None
    shape, val = _tensor_shape(like), like.meta.get("val")
    if name in ("to", "_to_copy"):
        dtype = node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None)
        extra = {k for k in node.kwargs if k not in ("dtype", "device", "layout")}
        return isinstance(val, torch.Tensor) and dtype == val.dtype and not extra
    if name in ("view", "reshape") and len(node.args) == 2 and shape is not None:
        return list(node.args[1]) == list(shape)
    return name in ("alias", "detach", "clone") and len(node.args) == 1


def _same_value(a: Any, b: Any) -> bool:
    """:func:`_same_arg`, also looking through no-op ``to`` casts."""

    def strip(n: Any) -> Any:
        n = _origin(n)
        while isinstance(n, Node) and n.args and isinstance(n.args[0], Node):
            if aten_name(n.target) not in ("to", "_to_copy") or not _is_noop(n, n.args[0]):
                break
            n = _origin(n.args[0])
        return n

    return _same_arg(strip(a), strip(b))


class AimetQuantizeDequantizeRecognizer:
    """aimet-torch's ``QuantizeDequantize`` (QuantizationSimModel v2) as ``torch.export``
    leaves it: no custom op, ATen arithmetic (``aimet_torch/quantization/affine/backends/
    torch_builtins.py``)::

        div(x, S) -> round -> sub(., O) -> clamp(., qmin, qmax) -> add(., O) -> mul(., S)

    with the dead range check ``ge``/``le``/``__and__`` on the ``sub`` and, around it, no-op
    ``to`` casts, same-shape views and ``_assert_tensor_metadata``. ``S`` and ``O`` are
    computed from the quantizer's ``min``/``max`` parameters (``get_scale``/``get_offset``,
    the minimum-scale clamp included); graphbuild reads them by running that computation on
    the model's state (a ``computed`` value), so the encodings are AIMET's exact scale and
    ``zero_point = -offset``. Per-tensor and per-channel (``S`` of one non-unit dim) are
    recognised, and blocked (``quantize_dequantize`` with a ``block_size``: ``x`` reshaped to
    ``(-1, S0, B0, S1, B1, ...)``, ``S`` viewed as ``(S0, 1, S1, 1, ...)``, the result viewed
    back) with one blocked axis. A blocked quantizer whose scale is itself such a chain on the
    grid ``[1, 2^k]`` over ``amax(...) / 2^k`` is ``GroupedBlockQuantizeDequantize``: LPBQ
    with ``k``-bit block scales (the inner chain is part of the scale, never a quantizer).
    """

    def __repr__(self) -> str:
        return "AimetQuantizeDequantizeRecognizer(aten div/round/sub/clamp/add/mul)"

    def match(self, node: Node, program: ExportedProgram) -> Match | None:
        found = self._chain(node)
        if found is None:
            return None
        chain, offset, (qmin, qmax) = found
        if qmin > 0:  # LPBQ's integer block scales [1, 2^k]: part of a scale, not a quantizer
            return None
        xin, scale = node.args
        mul = chain[-1]
        x, before = self._through_noops_up(xin, node)
        out, after = self._through_noops_down(mul)
        blocked = _blocked_layout(node, x, scale)
        lpbq: tuple[int, list[Node]] | None = None
        if blocked is not None:
            x, scale, axis, block_size = blocked.weight, blocked.scale, blocked.axis, blocked.size
            before.append(blocked.reshape)
            after.extend(_unblocking_views(out, x))
            lpbq = _lpbq_scale(scale)
        else:
            axis, block_size = self._axis(node, x, scale), None
        s = computed_ref(program, scale)
        o = computed_ref(program, offset, [("neg.default", [])])
        if s is None or o is None:
            return None
        group = set(chain) | set(before) | set(after) | set(lpbq[1] if lpbq else ())
        group |= {u for n in list(group) for u in n.users if _is_assert(u)}
        group |= _exclusive(s[1] | o[1], group)
        return Match(
            input=x,
            replaces=tuple(n for n in program.graph.nodes if n in group),
            op="aimet.quantize_dequantize",
            qmin=qmin,
            qmax=qmax,
            scale=s[0],
            zero_point=o[0],
            axis=axis,
            block_size=block_size,
            block_scale_bits=lpbq[0] if lpbq else None,
            channel_axis=_other_axis(scale, axis) if lpbq else None,
        )

    @classmethod
    def _chain(cls, node: Node) -> tuple[list[Node], Node, tuple[int, int]] | None:
        """``div -> round -> sub -> clamp -> add -> mul`` from ``node`` (the range checks on
        the ``sub`` included), its offset and grid, or None."""
        if node.op != "call_function" or aten_name(node.target) not in ("div", "div_"):
            return None
        if len(node.args) != 2 or not all(isinstance(a, Node) for a in node.args):
            return None
        scale = node.args[1]
        rnd = _one(node, ("round",))
        sub = _one(rnd, ("sub",)) if rnd is not None and len(rnd.args) == 1 else None
        if sub is None or len(sub.args) != 2 or not isinstance(sub.args[1], Node):
            return None
        offset = sub.args[1]
        checks = cls._range_checks(sub)
        clamps = [u for u in sub.users if u not in (checks or ()) and not _is_assert(u)]
        if (
            checks is None
            or len(clamps) != 1
            or aten_name(clamps[0].target) not in ("clamp", "clamp_")
        ):
            return None
        (clamp,) = clamps
        qmin, qmax = get_arg(clamp, 1), get_arg(clamp, 2)
        add = _one(clamp, ("add",))
        mul = _one(add, ("mul",)) if add is not None else None
        if not (
            isinstance(qmin, int) and isinstance(qmax, int) and qmin < qmax and mul is not None
        ):
            return None
        if not (_same_value(add.args[1], offset) and _same_value(mul.args[1], scale)):
            return None
        return [node, rnd, sub, *checks, clamp, add, mul], offset, (qmin, qmax)

    @staticmethod
    def _range_checks(sub: Node) -> list[Node] | None:
        """AIMET's unused ``(q >= qmin) & (q <= qmax)``, or None if something reads it."""
        checks = [u for u in sub.users if aten_name(u.target) in ("ge", "le")]
        ands = {a for c in checks for a in c.users}
        if any(aten_name(a.target) != "__and__" or a.users for a in ands):
            return None
        if any(set(c.users) - ands for c in checks):
            return None
        return [*checks, *ands]

    @staticmethod
    def _through_noops_up(xin: Node, div: Node) -> tuple[Node, list[Node]]:
        taken: list[Node] = []
        while (
            xin.op == "call_function"
            and xin.args
            and isinstance(xin.args[0], Node)
            and _is_noop(xin, xin.args[0])
            and all(u is (taken[-1] if taken else div) or _is_assert(u) for u in xin.users)
        ):
            taken.append(xin)
            xin = xin.args[0]
        return xin, taken

    @staticmethod
    def _through_noops_down(out: Node) -> tuple[Node, list[Node]]:
        taken: list[Node] = []
        while True:
            users = [u for u in out.users if not _is_assert(u)]
            if len(users) != 1 or not _is_noop(users[0], out) or users[0].args[0] is not out:
                return out, taken
            out = users[0]
            taken.append(out)

    @staticmethod
    def _axis(anchor: Node, x: Node, scale: Node) -> int | None:
        shape, s_shape = _tensor_shape(x), _tensor_shape(scale)
        if s_shape is None or shape is None or len(s_shape) > len(shape):
            raise UnknownQuantizerError(
                f"AIMET quantizer at node '{anchor.name}': cannot tell its granularity"
            )
        wide = [i for i, d in enumerate(s_shape) if d != 1]
        if not wide:
            return None
        axis = wide[0] + len(shape) - len(s_shape)
        if len(wide) == 1 and s_shape[wide[0]] == shape[axis]:
            return axis
        raise UnknownQuantizerError(
            f"AIMET quantizer at node '{anchor.name}': scales of shape {list(s_shape)} on a "
            f"tensor of shape {list(shape)} are neither per tensor nor per channel (blocked "
            "AIMET quantizers are not supported)"
        )


@dataclass(frozen=True)
class _Blocked:
    """A blocked AIMET quantizer's weight, block scale, the reshape into blocks, and its one
    blocked axis and block size."""

    weight: Node
    scale: Node
    reshape: Node
    axis: int
    size: int


def _blocked_layout(anchor: Node, x: Node, scale: Node) -> _Blocked | None:
    """AIMET's block layout around ``div(x, S)``: ``x = reshape(W, (-1, *interleave(S.shape,
    block)))`` and ``S = view(scale, interleave(scale.shape, 1))``; None when ``x`` is not
    reshaped into blocks. Several blocked axes are an :class:`UnknownQuantizerError`."""
    name = aten_name(x.target) if x.op == "call_function" else None
    if name not in ("reshape", "view", "_unsafe_view") or not isinstance(x.args[0], Node):
        return None
    weight, shape = x.args[0], list(x.args[1]) if len(x.args) > 1 else []
    w_shape = _tensor_shape(weight)
    s_view = scale
    base = s_view.args[0] if s_view.op == "call_function" and s_view.args else None
    b_shape = _tensor_shape(base) if isinstance(base, Node) else None
    if (
        w_shape is None
        or b_shape is None
        or aten_name(s_view.target) not in ("view", "reshape")
        or len(shape) != 1 + 2 * len(b_shape)
        or len(b_shape) != len(w_shape)
        or list(s_view.args[1]) != [v for d in b_shape for v in (d, 1)]
    ):
        return None
    pairs = list(zip(shape[1::2], shape[2::2], strict=True))
    if any(p[0] != d for p, d in zip(pairs, b_shape, strict=True)) or any(
        s * b != w for (s, b), w in zip(pairs, w_shape, strict=True)
    ):
        return None
    blocked = [i for i, (_, b) in enumerate(pairs) if b > 1]
    if len(blocked) != 1:
        raise UnknownQuantizerError(
            f"AIMET quantizer at node '{anchor.name}': blocks of {[b for _, b in pairs]} on a "
            f"tensor of shape {list(w_shape)} are not ONNX blocks along one axis"
        )
    return _Blocked(weight, base, x, blocked[0], pairs[blocked[0]][1])


def _unblocking_views(out: Node, weight: Node) -> list[Node]:
    """The view of the blocked result back to the weight's shape (the last of the chain)."""
    users = [u for u in out.users if not _is_assert(u)]
    if len(users) != 1:
        return []
    (view,) = users
    name = aten_name(view.target) if view.op == "call_function" else None
    same = _tensor_shape(view) == _tensor_shape(weight)
    return [view] if name in ("view", "reshape") and view.args[0] is out and same else []


def _lpbq_scale(scale: Node) -> tuple[int, list[Node]] | None:
    """``(k, the dead range checks to erase)`` when ``scale`` is AIMET's LPBQ scale: a
    quantize-dequantize of the raw block scales on ``[1, 2^k]`` whose scale is the maximum
    over a channel's blocks ``/ 2^k`` (``GroupedBlockQuantizeDequantize._get_scale``)."""
    mul = scale
    while (
        mul.op == "call_function"
        and aten_name(mul.target) in ("to", "_to_copy", "view", "reshape")
        and isinstance(mul.args[0], Node)
    ):
        mul = mul.args[0]
    steps = ("add", "clamp", "sub", "round", "div")
    node = mul
    if aten_name(mul.target) not in ("mul", "mul_"):
        return None
    for step in steps:
        node = node.args[0] if node.args and isinstance(node.args[0], Node) else None
        if node is None or (aten_name(node.target) or "").rstrip("_") != step:
            return None
    found = AimetQuantizeDequantizeRecognizer._chain(node)
    if found is None or found[0][-1] is not mul:
        return None
    chain, _, (qmin, qmax) = found
    k = qmax.bit_length() - 1
    if qmin != 1 or qmax != 2**k or not 1 <= k <= 8 or not _over_group_max(node.args[1], qmax):
        return None
    return k, [n for n in chain if aten_name(n.target) in ("ge", "le", "__and__")]


def _over_group_max(scale: Node, top: int) -> bool:
    """``scale`` is ``amax(...) / top`` (through views): AIMET's per-channel scale."""
    node = scale
    while aten_name(node.target) in ("view", "reshape", "to", "_to_copy"):
        node = node.args[0]
    if aten_name(node.target) not in ("div", "div_") or len(node.args) != 2:
        return False
    numerator, divisor = node.args
    return (
        isinstance(divisor, (int, float))
        and float(divisor) == float(top)
        and isinstance(numerator, Node)
        and aten_name(numerator.target) == "amax"
    )


def _other_axis(scale: Node, axis: int) -> int | None:
    """The channel axis of a blocked scale: its one other axis longer than 1."""
    shape = _tensor_shape(scale) or ()
    wide = [i for i, d in enumerate(shape) if d > 1 and i != axis]
    return wide[0] if len(wide) == 1 else None
