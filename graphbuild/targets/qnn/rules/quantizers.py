"""The quantizers the HTP rules place, while the rules run: one mutable settings object per
quantizer (AIMET's ``QcQuantizeOp``, reduced to its settings) in a table from tensor to
quantizer, where several tensors may hold the same one (a shared encoding)."""

from __future__ import annotations

from graphbuild.targets.qnn.rules.config import GRID_PRESERVING
from graphbuild.targets.qnn.rules.view import OpNode, ViewWalk

__all__ = ["Quantizer", "Quantizers"]


class Quantizer:
    """One quantizer under construction: enabled or why not, and its settings."""

    __slots__ = (
        "enabled",
        "param",
        "bits",
        "symmetric",
        "per_channel",
        "fixed",
        "min_scale",
        "why",
        "role",
    )

    def __init__(self, *, param: bool, bits: int, symmetric: bool, role: str = "") -> None:
        self.enabled = True
        self.param = param
        self.bits = bits
        self.symmetric = symmetric
        self.per_channel = False
        self.fixed: tuple[float | None, float | None] | None = None
        self.min_scale: float | None = None
        self.why = ""
        self.role = role

    def disable(self, why: str) -> None:
        if self.enabled:
            self.enabled, self.why = False, why


class Quantizers(dict[str, Quantizer]):
    """Tensor -> its quantizer, over one view (``walk``)."""

    def __init__(self, walk: ViewWalk) -> None:
        super().__init__()
        self.walk = walk

    def disable_outputs(self, ops: list[OpNode], why: str) -> None:
        """Disable the quantizers of every output of ``ops``."""
        for op in ops:
            for t in op.outputs:
                if t in self:
                    self[t].disable(why)

    def enabled_source(self, tensor: str | None) -> str | None:
        """The tensor whose enabled quantizer is ``tensor``'s effective one: itself, or the
        closest ancestor through grid-preserving ops, float casts and disabled quantizers."""
        seen: set[str] = set()
        while tensor is not None and tensor not in seen:
            seen.add(tensor)
            q = self.get(tensor)
            if q is not None and q.enabled:
                return tensor
            producer = self.walk.producers.get(tensor)
            if producer is None or not producer.inputs:
                return None
            passes = producer.op_type in GRID_PRESERVING or (
                producer.op_type == "Cast" and producer.cast_from_float
            )
            if not passes:
                return None
            tensor = producer.inputs[0]
        return None

    def share(self, tensor: str, quantizer: Quantizer) -> None:
        """Every tensor holding ``tensor``'s quantizer holds ``quantizer`` instead."""
        old = self[tensor]
        for t, q in self.items():
            if q is old:
                self[t] = quantizer

    def readers(self, tensor: str) -> list[OpNode]:
        """The ops that read ``tensor``'s quantized value: its consumers, and the consumers
        of data-movement ops in between (they read the same quantizer)."""
        readers: list[OpNode] = []
        stack = [tensor]
        while stack:
            t = stack.pop()
            for c in self.walk.consumers.get(t, []):
                q = self.get(c.outputs[0]) if c.outputs else None
                through = c.op_type in GRID_PRESERVING and (q is None or not q.enabled)
                if through:
                    stack.extend(c.outputs)
                else:
                    readers.append(c)
            if t in self.walk.view.outputs:
                readers.append(OpNode("<output>", "Output", (t,), ()))
        return list({r.name: r for r in readers}.values())
