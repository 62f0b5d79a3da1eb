"""Groups of ops the HTP runs as one, and encodings tensors share: the parts of the HTP rules
(:mod:`graphbuild.targets.qnn.rules.plan`) that match patterns across ops.

* AIMET's graph passes: MatMul + Add of a constant is a linear (its MatMul output and bias stay
  float), an RMSNorm spelled out keeps only its last output quantized;
* supergroups (AIMET's ``GraphSearcher`` over the configuration's patterns: ``Conv -> Relu``):
  every output but the last is not quantized;
* tied quantizers: Relu, AveragePool and Resize outputs share their input's encoding
  (forward), a Concat's inputs share its output's (backward).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graphbuild.targets.qnn.rules.config import (
    GRID_PRESERVING,
    TIED_BACKWARD,
    TIED_FORWARD,
    supergroups,
)
from graphbuild.targets.qnn.rules.quantizers import Quantizer, Quantizers
from graphbuild.targets.qnn.rules.view import OpNode, ViewWalk

__all__ = ["apply_matmul_add", "apply_rms_norm", "apply_supergroups", "tie_backward", "tie_forward"]

Range = tuple[float | None, float | None]


# ---------------------------------------------------------------------------- graph passes


def apply_matmul_add(
    walk: ViewWalk, q: Quantizers, params: dict[str, tuple[OpNode, str]], param_bits: int
) -> set[str]:
    """AIMET's MatmulAdd pass: MatMul(x, W) + b is a linear; its MatMul output and b stay
    float (the bias, recorded in ``params``). Returns the MatMuls it matched: the Add is the
    linear's output op, and may start a supergroup (``Add -> Relu``), as in AIMET's sim."""
    matched: set[str] = set()
    constants = walk.view.constants
    for op in walk.view.ops:
        if op.op_type != "MatMul" or walk.constant(op.inputs[1]) is None:
            continue
        add = walk.single_consumer(op.outputs[0])
        if add is None or add.op_type != "Add":
            continue
        other = [t for t in add.inputs if t != op.outputs[0]]
        if len(other) != 1 or other[0] not in constants:
            continue
        bias = other[0]
        matched.add(op.name)
        if op.outputs[0] in q:
            q[op.outputs[0]].disable("MatMul of a linear: its Add is quantized")
        if bias in q:
            q[bias] = Quantizer(param=True, bits=param_bits, symmetric=True)
            q[bias].disable("bias")
            params.setdefault(bias, (add, "bias"))
    return matched


def apply_rms_norm(walk: ViewWalk, q: Quantizers) -> set[str]:
    """AIMET's RMSNormalization pass: x / sqrt(mean(x * x) + eps) [* w] spelled out keeps
    only its last output (and the weight) quantized. Returns the ops it matched."""
    matched: set[str] = set()
    for op in walk.view.ops:
        chain = _match_rms_norm(walk, op)
        if not chain:
            continue
        affine = False
        tail, casts = chain[-1], []
        users = walk.output_ops(tail)
        while len(users) == 1 and users[0].op_type == "Cast":
            tail = users[0]
            casts.append(tail)
            users = walk.output_ops(tail)
        if len(users) == 1 and users[0].op_type == "Mul":
            affine = True
            chain = [*chain, *casts, users[0]]
        matched.update(o.name for o in chain)
        inner = chain[:-1]
        q.disable_outputs(inner, "inside an RMSNorm (its output is quantized)")
        for o in inner if affine else chain:
            for t in o.inputs:
                if t in walk.view.constants and t in q and not q[t].param:
                    q[t].disable("constant of an RMSNorm")
    return matched


def _match_rms_norm(walk: ViewWalk, op: OpNode) -> list[OpNode]:
    if op.op_type == "RMSNormalization":
        return [op]
    x = op.inputs[0] if op.inputs else None
    if len(op.inputs) != 2:
        return []
    squares = (op.op_type == "Mul" and op.inputs[0] == op.inputs[1]) or (
        op.op_type == "Pow" and walk.scalar(op.inputs[1]) == 2
    )
    if not squares or x is None or len(walk.output_ops(op)) != 1:
        return []
    mean = walk.output_ops(op)[0]
    if mean.op_type != "ReduceMean" or len(walk.output_ops(mean)) != 1:
        return []
    add = walk.output_ops(mean)[0]
    if add.op_type != "Add" or len(walk.output_ops(add)) != 1:
        return []
    chain = [op, mean, add]
    nxt = walk.output_ops(add)[0]
    if nxt.op_type == "Sqrt" and len(walk.output_ops(nxt)) == 1:
        divide = _a_div_b(walk, x, nxt.outputs[0])
        if divide:
            return [*chain, nxt, *divide]
    if (
        nxt.op_type == "Pow"
        and len(nxt.inputs) == 2
        and walk.scalar(nxt.inputs[1]) == -0.5
        and len(walk.output_ops(nxt)) == 1
    ):
        mul = walk.output_ops(nxt)[0]
        if mul.op_type == "Mul" and x in mul.inputs[:2]:
            return [*chain, nxt, mul]
    return []


def _a_div_b(walk: ViewWalk, a: str, b: str) -> list[OpNode]:
    """Div(a, b), Mul(a, Div(1, b)) or Mul(a, Reciprocal(b)) (either Mul order)."""
    readers = walk.consumers.get(b, [])
    if len(readers) != 1:
        return []
    op = readers[0]
    if op.op_type == "Div" and op.inputs[:2] == (a, b):
        return [op]
    if len(walk.output_ops(op)) != 1:
        return []
    one_over = op.op_type == "Div" and walk.scalar(op.inputs[0]) == 1 and op.inputs[1] == b
    if not (one_over or (op.op_type == "Reciprocal" and op.inputs[0] == b)):
        return []
    mul = walk.output_ops(op)[0]
    if mul.op_type != "Mul" or a not in mul.inputs[:2]:
        return []
    return [op, mul]


# ---------------------------------------------------------------------------- supergroups


def apply_supergroups(walk: ViewWalk, q: Quantizers, matched: set[str]) -> None:
    """GraphSearcher: longest patterns first, each over the ops of its first type in graph
    order; matches are disjoint; a depthwise (or 3-D) convolution starts none, nor does an
    op a graph pass (``matched``) already handles."""
    taken: set[str] = set()
    for pattern in sorted(supergroups(), key=len, reverse=True):
        for op in walk.view.ops:
            if op.op_type != pattern[0] or op.depthwise or op.name in matched:
                continue
            chain = _match(walk, op, pattern)
            if chain is None or any(o.name in taken for o in chain):
                continue
            taken.update(o.name for o in chain)
            label = "+".join(o.op_type for o in chain)
            q.disable_outputs(chain[:-1], f"inside the {label} supergroup")


def _match(walk: ViewWalk, op: OpNode, pattern: Sequence[str]) -> list[OpNode] | None:
    chain, current = [op], op
    for op_type in pattern[1:]:
        users = walk.output_ops(current)
        if len(users) != 1 or users[0].op_type != op_type:
            return None
        current = users[0]
        chain.append(current)
    return chain


# ---------------------------------------------------------------------------- ties


def tie_backward(walk: ViewWalk, q: Quantizers) -> None:
    """Concat: inputs with no other reader share the output's quantizer."""
    visited: set[str] = set()
    floats = walk.view.floats
    for op in reversed(walk.view.ops):
        if op.op_type not in TIED_BACKWARD or len(op.outputs) != 1:
            continue
        out_q = q.get(op.outputs[0])
        if out_q is None:
            continue
        sources: dict[str, Quantizer | None] = {}
        fixed_ranges: set[Any] = set()
        stack = [op]
        while stack:
            current = stack.pop()
            if current.name in visited:
                continue
            visited.add(current.name)
            for inp in current.inputs:
                if inp is None or inp not in floats:
                    continue
                src = q.enabled_source(inp)
                name = src if src is not None else inp
                if src is not None:
                    fixed_ranges.add(q[src].fixed)
                if len(q.readers(name)) > 1:
                    continue
                sources[name] = q[src] if src is not None else None
                producer = walk.producers.get(inp)
                if producer is not None and (
                    producer.op_type in TIED_BACKWARD or producer.op_type in GRID_PRESERVING
                ):
                    stack.append(producer)
        if len(fixed_ranges) == 1:
            out_q.fixed = next(iter(fixed_ranges))
        else:
            sources = {n: s for n, s in sources.items() if s is None or not s.fixed}
        for name, source in sources.items():
            if source is not None:
                q.share(name, out_q)


def tie_forward(walk: ViewWalk, q: Quantizers) -> None:
    """Relu, AveragePool, Resize: the output shares the input's quantizer."""
    for op in walk.view.ops:
        if op.op_type not in TIED_FORWARD or not op.inputs:
            continue
        src = q.enabled_source(op.inputs[0])
        if src is None:
            continue
        in_q = q[src]
        for t in op.outputs:
            out_q = q.get(t)
            if out_q is None or not out_q.enabled:
                continue
            if out_q.fixed and out_q.fixed != in_q.fixed and len(q.readers(src)) > 1:
                continue
            if out_q.fixed:
                in_q.fixed = _merge(in_q.fixed, out_q.fixed)
            q.share(t, in_q)


def _merge(a: Range | None, b: Range | None) -> Range | None:
    """Two encoding constraints as one (each end from whichever states it)."""
    if a is None:
        return b
    if b is None:
        return a
    return (a[0] if a[0] is not None else b[0], a[1] if a[1] is not None else b[1])
