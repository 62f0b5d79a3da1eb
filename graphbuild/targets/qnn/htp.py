"""Which tensors QNN HTP runs quantized, and how: AIMET's ``htp_v81`` configuration semantics.

QNN quantizes exactly the tensors an encodings file names, so what graphbuild's presets
quantize has to follow what Qualcomm's own tooling expects. This module states those rules once,
over a small graph view (:class:`GraphView`: ONNX op types, tensor names, which tensors are
float, constant or graph inputs). Two adapters build views: the ONNX one (``coverage``: what an
exported model should carry) and the aten one (``preset``: where the PT2E quantizer puts its
observers). The same rules on both is what makes the preset's encodings match the model.

The op lists come from AIMET's configuration (:mod:`graphbuild.targets.qnn.htp_config`); the
exception rules of AIMET's ``QuantizationSimModel`` (norm weights, activation MatMul, ties) and
its graph passes (MatmulAdd, RMSNormalization) are restated here. aimet-onnx is never imported:
``tests/test_aimet_interop.py`` checks that the two agree on the test zoo.

Rules, in AIMET's order:

1. Every float tensor gets one quantizer: graph inputs, op outputs, and constants that ops read
   (scalars too). A constant in a parameter slot (a Conv weight) gets a parameter quantizer.
2. Disabled: outputs of data-movement (grid-preserving) ops and of the config's float-output ops
   (``Cast``, ``Gather``...), biases and BatchNorm statistics, every output of a supergroup but
   its last (``Conv -> Relu``), a MatMul's output and bias when an Add finishes it as a linear.
3. Parameters are symmetric on the parameter grid, per output channel for Conv, ConvTranspose,
   Gemm and MatMul weights; norm weights use at least 8 bits and, for LayerNorm, are asymmetric.
   Activations are asymmetric on the activation grid; Sigmoid and Softmax are fixed to [0, 1],
   Tanh, Sin and Cos to [-1, 1] (symmetric).
4. The second input of a MatMul (Conv, Gemm) that is not a constant is quantized symmetrically
   (like a weight); with 16-bit activations its first input is 16-bit too.
5. Tied quantizers (one encoding for several tensors): Relu, AveragePool and Resize outputs share
   their input's; Concat's inputs share its output's.

Where the HTP backend and AIMET differ, the HTP wins (DESIGN.md, invariant 12). One rule is
the HTP's alone: a Softmax's input has a step of at least :data:`SOFTMAX_MIN_INPUT_SCALE`. The
HTP's 16-bit Softmax computes garbage from a finer input grid (a step below about 2^-18.5, a
+-0.06 range: attention scores of a random-initialised transformer; 2,000 output steps off
onnxruntime's CPU), and right from a coarser one (1-3 steps); a step of 2^-17 changes the
Softmax's output by less than half a 16-bit output step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from graphbuild.targets.qnn.htp_config import (
    CONFIG_NAME,
    GRID_PRESERVING,
    IGNORED_OUTPUTS,
    NORM_OPS,
    PARAM_INPUTS,
    TIED_BACKWARD,
    TIED_FORWARD,
    WEIGHTED_OPS,
    encoding_constraint,
    float_output_ops,
    op_config,
    param_quantized,
    param_symmetric,
    per_channel_ops,
    supergroups,
)

__all__ = [
    "CONFIG_NAME",
    "SOFTMAX_MIN_INPUT_SCALE",
    "WEIGHTED_OPS",
    "GraphView",
    "OpNode",
    "Plan",
    "TensorRule",
    "plan",
]

SOFTMAX_MIN_INPUT_SCALE = 2.0**-17
"""The smallest step the HTP's Softmax computes right from (see the module)."""


# ------------------------------------------------------------------------------- the view


@dataclass(frozen=True)
class OpNode:
    """One op of a view. ``inputs`` may hold ``None`` for an absent optional input.
    ``depthwise`` marks a grouped convolution (never part of a supergroup), ``groups`` its
    group count; ``source`` says where the op came from (aten op and module), ``origin``
    names the torch node it lowers, for reports."""

    name: str
    op_type: str
    inputs: tuple[str | None, ...]
    outputs: tuple[str, ...]
    depthwise: bool = False
    groups: int = 1
    cast_from_float: bool = False
    source: str = ""
    origin: str = ""


@dataclass
class GraphView:
    """A graph as the rules see it: ops in topological order and what is known of tensors."""

    ops: list[OpNode]
    inputs: list[str]
    outputs: list[str]
    floats: set[str]
    constants: set[str]
    #: a constant that is the transposed form of another (MatMul weights through Transpose)
    transposed: dict[str, str] = field(default_factory=dict)
    #: the values of scalar constants, where known (pattern matching reads ``1`` and ``2``)
    scalars: dict[str, float] = field(default_factory=dict)

    def producers(self) -> dict[str, OpNode]:
        return {t: op for op in self.ops for t in op.outputs}

    def consumers(self) -> dict[str, list[OpNode]]:
        users: dict[str, list[OpNode]] = defaultdict(list)
        for op in self.ops:
            for t in op.inputs:
                if t is not None:
                    users[t].append(op)
        return users


# ------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class TensorRule:
    """How one tensor is quantized on HTP (when ``quantized``), or why it stays float.

    ``group`` names the tensor whose quantizer this one shares (itself when it has its own);
    ``fixed`` is the (min, max) an encoding constraint pins, either end may be None;
    ``min_scale`` the smallest step the HTP computes right from (None: any)."""

    tensor: str
    quantized: bool
    param: bool = False
    bits: int = 0
    symmetric: bool = False
    per_channel: bool = False
    fixed: tuple[float | None, float | None] | None = None
    min_scale: float | None = None
    group: str = ""
    role: str = ""
    op_type: str = ""
    why: str = ""

    def describe(self) -> str:
        """``int8 sym per-channel`` or ``float (why)``."""
        if not self.quantized:
            return f"float ({self.why})"
        sym = "sym" if self.symmetric else "asym"
        gran = "per-channel" if self.per_channel else "per-tensor"
        return f"{'param' if self.param else 'act'} {self.bits}-bit {sym} {gran}"


@dataclass
class Plan:
    """Every float tensor's rule, and the ops of the view by output (for reasons)."""

    rules: dict[str, TensorRule]
    producers: dict[str, OpNode]

    def quantized(self) -> dict[str, TensorRule]:
        return {t: r for t, r in self.rules.items() if r.quantized}

    def __getitem__(self, tensor: str) -> TensorRule:
        return self.rules[tensor]

    def get(self, tensor: str) -> TensorRule | None:
        return self.rules.get(tensor)


class _Quantizer:
    """A mutable quantizer under construction (AIMET's QcQuantizeOp, reduced to settings)."""

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


def plan(view: GraphView, param_bits: int, activation_bits: int) -> Plan:
    """The HTP rule for every float tensor of ``view`` with ``param_bits``-bit weights and
    ``activation_bits``-bit activations (AIMET's param_type / activation_type)."""
    return _Planner(view, param_bits, activation_bits).run()


class _Planner:
    def __init__(self, view: GraphView, param_bits: int, activation_bits: int) -> None:
        self.view = view
        self.param_bits, self.act_bits = param_bits, activation_bits
        self.producers = view.producers()
        self.consumers = view.consumers()
        self.q: dict[str, _Quantizer] = {}  # tensor -> its quantizer (shared when tied)
        self.order = {op.name: i for i, op in enumerate(view.ops)}
        self.params: dict[str, tuple[OpNode, str]] = {}

    def run(self) -> Plan:
        self._find_params()
        self._create_quantizers()
        self._disable_outputs()
        matched = self._apply_matmul_add() | self._apply_rms_norm()
        self._apply_supergroups(matched)
        self._configure_params()
        self._apply_constraints()
        self._apply_weight_symmetry_to_inputs()
        self._apply_exception_rules()
        self._tie_backward()
        self._tie_forward()
        self._apply_htp_minimums()
        return Plan(self._rules(), self.producers)

    # -- 1. quantizers ---------------------------------------------------------------------

    def _constant(self, tensor: str | None) -> str | None:
        """The constant behind ``tensor`` (itself, or what a Transpose of a constant reads)."""
        if tensor is None:
            return None
        if tensor in self.view.constants:
            return tensor
        return self.view.transposed.get(tensor)

    def _find_params(self) -> None:
        for op in self.view.ops:
            slots = PARAM_INPUTS.get(op.op_type, {})
            for index, role in slots.items():
                if index >= len(op.inputs):
                    continue
                tensor = op.inputs[index]
                const = self._constant(tensor) if op.op_type == "MatMul" else None
                if op.op_type != "MatMul" and tensor in self.view.constants:
                    const = tensor
                if const is not None and const not in self.params:
                    self.params[const] = (op, role)

    def _create_quantizers(self) -> None:
        floats = self.view.floats
        seen: list[str] = []
        for t in self.view.inputs:
            seen.append(t)
        for op in self.view.ops:
            seen.extend(t for t in op.inputs if t is not None)
            seen.extend(op.outputs)
        for t in dict.fromkeys(seen):
            if t not in floats:
                continue
            if t in self.params:
                self.q[t] = _Quantizer(param=True, bits=self.param_bits, symmetric=True)
                continue
            producer = self.producers.get(t)
            if producer is not None and producer.op_type in IGNORED_OUTPUTS:
                continue  # no quantizer at all (quantsim._is_tensor_quantizable)
            if any(c.op_type in ("Resize",) and c.inputs[0] != t for c in self.consumers[t]):
                continue
            self.q[t] = _Quantizer(param=False, bits=self.act_bits, symmetric=False)

    def _disable_outputs(self) -> None:
        float_ops = float_output_ops()
        for op in self.view.ops:
            named = op.op_type in op_config()
            if op.op_type in float_ops:
                why = f"{op.op_type} outputs stay float on HTP"
            elif op.op_type in GRID_PRESERVING and not named:
                why = f"{op.op_type} moves data: its input's encoding holds"
            else:
                continue
            for t in op.outputs:
                if t in self.q:
                    self.q[t].disable(why)

    # -- 2. supergroups --------------------------------------------------------------------

    def _single_consumer(self, tensor: str) -> OpNode | None:
        users = self.consumers.get(tensor, [])
        return users[0] if len(users) == 1 else None

    def _apply_supergroups(self, matched: set[str]) -> None:
        """GraphSearcher: longest patterns first, each over the ops of its first type in graph
        order; matches are disjoint; a depthwise (or 3-D) convolution starts none, nor does an
        op a graph pass (``matched``) already handles."""
        taken: set[str] = set()
        for pattern in sorted(supergroups(), key=len, reverse=True):
            for op in self.view.ops:
                if op.op_type != pattern[0] or op.depthwise or op.name in matched:
                    continue
                chain = self._match(op, pattern)
                if chain is None or any(o.name in taken for o in chain):
                    continue
                taken.update(o.name for o in chain)
                label = "+".join(o.op_type for o in chain)
                for inner in chain[:-1]:
                    for t in inner.outputs:
                        if t in self.q:
                            self.q[t].disable(f"inside the {label} supergroup")

    def _match(self, op: OpNode, pattern: Sequence[str]) -> list[OpNode] | None:
        chain, current = [op], op
        for op_type in pattern[1:]:
            users = self._output_ops(current)
            if len(users) != 1 or users[0].op_type != op_type:
                return None
            current = users[0]
            chain.append(current)
        return chain

    def _output_ops(self, op: OpNode) -> list[OpNode]:
        """The distinct ops reading ``op``'s outputs, in graph order."""
        users = {u.name: u for t in op.outputs for u in self.consumers.get(t, [])}
        return sorted(users.values(), key=lambda u: self.order[u.name])

    def _apply_matmul_add(self) -> set[str]:
        """AIMET's MatmulAdd pass: MatMul(x, W) + b is a linear; its MatMul output and b stay
        float (the bias). Returns the ops it matched."""
        matched: set[str] = set()
        for op in self.view.ops:
            if op.op_type != "MatMul" or self._constant(op.inputs[1]) is None:
                continue
            add = self._single_consumer(op.outputs[0])
            if add is None or add.op_type != "Add":
                continue
            other = [t for t in add.inputs if t != op.outputs[0]]
            if len(other) != 1 or other[0] not in self.view.constants:
                continue
            bias = other[0]
            matched.update((op.name, add.name))
            if op.outputs[0] in self.q:
                self.q[op.outputs[0]].disable("MatMul of a linear: its Add is quantized")
            if bias in self.q:
                self.q[bias] = _Quantizer(param=True, bits=self.param_bits, symmetric=True)
                self.q[bias].disable("bias")
                self.params.setdefault(bias, (add, "bias"))
        return matched

    def _apply_rms_norm(self) -> set[str]:
        """AIMET's RMSNormalization pass: x / sqrt(mean(x * x) + eps) [* w] spelled out keeps
        only its last output (and the weight) quantized. Returns the ops it matched."""
        matched: set[str] = set()
        for op in self.view.ops:
            chain = self._match_rms_norm(op)
            if not chain:
                continue
            affine = False
            tail, casts = chain[-1], []
            users = self._output_ops(tail)
            while len(users) == 1 and users[0].op_type == "Cast":
                tail = users[0]
                casts.append(tail)
                users = self._output_ops(tail)
            if len(users) == 1 and users[0].op_type == "Mul":
                affine = True
                chain = [*chain, *casts, users[0]]
            matched.update(o.name for o in chain)
            inner = chain[:-1]
            for o in inner:
                for t in o.outputs:
                    if t in self.q:
                        self.q[t].disable("inside an RMSNorm (its output is quantized)")
            for o in inner if affine else chain:
                for t in o.inputs:
                    if t in self.view.constants and t in self.q and not self.q[t].param:
                        self.q[t].disable("constant of an RMSNorm")
        return matched

    def _match_rms_norm(self, op: OpNode) -> list[OpNode]:
        if op.op_type == "RMSNormalization":
            return [op]
        x = op.inputs[0] if op.inputs else None
        if len(op.inputs) != 2:
            return []
        squares = (op.op_type == "Mul" and op.inputs[0] == op.inputs[1]) or (
            op.op_type == "Pow" and self._scalar(op.inputs[1]) == 2
        )
        if not squares or x is None or len(self._output_ops(op)) != 1:
            return []
        mean = self._output_ops(op)[0]
        if mean.op_type != "ReduceMean" or len(self._output_ops(mean)) != 1:
            return []
        add = self._output_ops(mean)[0]
        if add.op_type != "Add" or len(self._output_ops(add)) != 1:
            return []
        chain = [op, mean, add]
        nxt = self._output_ops(add)[0]
        if nxt.op_type == "Sqrt" and len(self._output_ops(nxt)) == 1:
            divide = self._a_div_b(x, nxt.outputs[0])
            if divide:
                return [*chain, nxt, *divide]
        if (
            nxt.op_type == "Pow"
            and len(nxt.inputs) == 2
            and self._scalar(nxt.inputs[1]) == -0.5
            and len(self._output_ops(nxt)) == 1
        ):
            mul = self._output_ops(nxt)[0]
            if mul.op_type == "Mul" and x in mul.inputs[:2]:
                return [*chain, nxt, mul]
        return []

    def _a_div_b(self, a: str, b: str) -> list[OpNode]:
        """Div(a, b), Mul(a, Div(1, b)) or Mul(a, Reciprocal(b)) (either Mul order)."""
        readers = self.consumers.get(b, [])
        if len(readers) != 1:
            return []
        op = readers[0]
        if op.op_type == "Div" and op.inputs[:2] == (a, b):
            return [op]
        if len(self._output_ops(op)) != 1:
            return []
        one_over = op.op_type == "Div" and self._scalar(op.inputs[0]) == 1 and op.inputs[1] == b
        if not (one_over or (op.op_type == "Reciprocal" and op.inputs[0] == b)):
            return []
        mul = self._output_ops(op)[0]
        if mul.op_type != "Mul" or a not in mul.inputs[:2]:
            return []
        return [op, mul]

    def _scalar(self, tensor: str | None) -> float | None:
        return self.view.scalars.get(tensor) if tensor is not None else None

    # -- 3. settings -----------------------------------------------------------------------

    def _configure_params(self) -> None:
        for tensor, (op, role) in self.params.items():
            q = self.q.get(tensor)
            if q is None or not q.param:
                continue
            q.role = role
            if not param_quantized(op.op_type, role):
                q.disable(f"{role} of {op.op_type} is not quantized")
                continue
            q.symmetric = param_symmetric(op.op_type, role)
            if role == "weight" and op.op_type in per_channel_ops():
                q.per_channel = not (op.op_type == "ConvTranspose" and op.groups != 1)
            if op.op_type in NORM_OPS:
                self._norm_param(q, op)

    def _norm_param(self, q: _Quantizer, op: OpNode) -> None:
        """QuantizationSimModel._apply_exception_rules for normalization weights."""
        q.bits = max(q.bits, 8)
        if op.op_type in ("GroupNormalization", "InstanceNormalization", "RMSNormalization"):
            out = self.q.get(op.outputs[0])
            q.symmetric = bool(out and out.enabled and out.symmetric)
            if out is not None and out.enabled:
                q.bits = out.bits
        else:
            q.symmetric = q.bits >= 16

    def _apply_constraints(self) -> None:
        for op in self.view.ops:
            fixed = encoding_constraint(op.op_type)
            if fixed is None:
                continue
            for t in op.outputs:
                q = self.q.get(t)
                if q is None:
                    continue
                q.fixed = fixed
                low, high = fixed
                if low is not None and high is not None and low == -high:
                    q.symmetric = True

    def enabled_source(self, tensor: str | None) -> str | None:
        """The tensor whose enabled quantizer is ``tensor``'s effective one: itself, or the
        closest ancestor through grid-preserving ops, float casts and disabled quantizers."""
        seen: set[str] = set()
        while tensor is not None and tensor not in seen:
            seen.add(tensor)
            q = self.q.get(tensor)
            if q is not None and q.enabled:
                return tensor
            producer = self.producers.get(tensor)
            if producer is None or not producer.inputs:
                return None
            passes = producer.op_type in GRID_PRESERVING or (
                producer.op_type == "Cast" and producer.cast_from_float
            )
            if not passes:
                return None
            tensor = producer.inputs[0]
        return None

    def _apply_weight_symmetry_to_inputs(self) -> None:
        """_apply_param_symmetry_to_inputs: a non-constant weight input is symmetric."""
        for op in self.view.ops:
            if op.op_type not in WEIGHTED_OPS or len(op.inputs) < 2:
                continue
            weight = op.inputs[1]
            if weight is None or self._constant(weight) in self.params:
                continue
            source = self.enabled_source(weight)
            if source is not None:
                self.q[source].symmetric = param_symmetric(op.op_type, "weight")

    def _apply_exception_rules(self) -> None:
        """Dynamic MatMul on V73+: a 16-bit second input is symmetric and makes the first
        input 16-bit."""
        for op in self.view.ops:
            if op.op_type != "MatMul" or self._constant(op.inputs[1]) in self.params:
                continue
            first, second = self.enabled_source(op.inputs[0]), self.enabled_source(op.inputs[1])
            if first is None or second is None:
                continue
            if self.q[second].bits == 16:
                self.q[second].symmetric = True
                self.q[first].bits = 16

    # -- 4. ties ---------------------------------------------------------------------------

    def _share(self, tensor: str, quantizer: _Quantizer) -> None:
        old = self.q[tensor]
        for t, q in self.q.items():
            if q is old:
                self.q[t] = quantizer

    def _tie_backward(self) -> None:
        """Concat: inputs with no other reader share the output's quantizer."""
        visited: set[str] = set()
        for op in reversed(self.view.ops):
            if op.op_type not in TIED_BACKWARD or len(op.outputs) != 1:
                continue
            out_q = self.q.get(op.outputs[0])
            if out_q is None:
                continue
            sources: dict[str, _Quantizer | None] = {}
            fixed_ranges: set[Any] = set()
            stack = [op]
            while stack:
                current = stack.pop()
                if current.name in visited:
                    continue
                visited.add(current.name)
                for inp in current.inputs:
                    if inp is None or inp not in self.view.floats:
                        continue
                    src = self.enabled_source(inp)
                    name = src if src is not None else inp
                    if src is not None:
                        fixed_ranges.add(self.q[src].fixed)
                    if len(self._readers(name)) > 1:
                        continue
                    sources[name] = self.q[src] if src is not None else None
                    producer = self.producers.get(inp)
                    if producer is not None and (
                        producer.op_type in TIED_BACKWARD or producer.op_type in GRID_PRESERVING
                    ):
                        stack.append(producer)
            if len(fixed_ranges) == 1:
                out_q.fixed = next(iter(fixed_ranges))
            else:
                sources = {n: q for n, q in sources.items() if q is None or not q.fixed}
            for name, q in sources.items():
                if q is not None:
                    self._share(name, out_q)

    def _readers(self, tensor: str) -> list[OpNode]:
        """The ops that read ``tensor``'s quantized value: its consumers, and the consumers
        of data-movement ops in between (they read the same quantizer)."""
        readers: list[OpNode] = []
        stack = [tensor]
        while stack:
            t = stack.pop()
            for c in self.consumers.get(t, []):
                q = self.q.get(c.outputs[0]) if c.outputs else None
                through = c.op_type in GRID_PRESERVING and (q is None or not q.enabled)
                if through:
                    stack.extend(c.outputs)
                else:
                    readers.append(c)
            if t in self.view.outputs:
                readers.append(OpNode("<output>", "Output", (t,), ()))
        return list({r.name: r for r in readers}.values())

    def _tie_forward(self) -> None:
        """Relu, AveragePool, Resize: the output shares the input's quantizer."""
        for op in self.view.ops:
            if op.op_type not in TIED_FORWARD or not op.inputs:
                continue
            src = self.enabled_source(op.inputs[0])
            if src is None:
                continue
            in_q = self.q[src]
            for t in op.outputs:
                out_q = self.q.get(t)
                if out_q is None or not out_q.enabled:
                    continue
                if out_q.fixed and out_q.fixed != in_q.fixed and len(self._readers(src)) > 1:
                    continue
                if out_q.fixed:
                    in_q.fixed = _merge(in_q.fixed, out_q.fixed)
                self._share(t, in_q)

    def _apply_htp_minimums(self) -> None:
        """The HTP's own rule: a Softmax's input grid no finer than it computes right from."""
        for op in self.view.ops:
            if op.op_type != "Softmax" or not op.inputs:
                continue
            src = self.enabled_source(op.inputs[0])
            if src is not None:
                self.q[src].min_scale = SOFTMAX_MIN_INPUT_SCALE

    # -- result ----------------------------------------------------------------------------

    def _rules(self) -> dict[str, TensorRule]:
        owner: dict[int, str] = {}
        for t, q in self.q.items():  # first tensor (in view order) holding a quantizer owns it
            owner.setdefault(id(q), t)
        rules: dict[str, TensorRule] = {}
        for t in self.view.floats:
            q = self.q.get(t)
            producer = self.producers.get(t)
            op_type = producer.op_type if producer is not None else ""
            if q is None:
                why = (
                    f"{op_type} moves data: its input's encoding holds"
                    if op_type
                    else "not read by any op"
                )
                rules[t] = TensorRule(t, False, op_type=op_type, why=why)
            elif not q.enabled:
                rules[t] = TensorRule(
                    t, False, param=q.param, role=q.role, op_type=op_type, why=q.why
                )
            else:
                rules[t] = TensorRule(
                    t,
                    True,
                    param=q.param,
                    bits=q.bits,
                    symmetric=q.symmetric,
                    per_channel=q.per_channel,
                    fixed=q.fixed,
                    min_scale=q.min_scale,
                    group=owner[id(q)],
                    role=q.role,
                    op_type=op_type,
                )
        return rules


def _merge(
    a: tuple[float | None, float | None] | None, b: tuple[float | None, float | None] | None
) -> tuple[float | None, float | None] | None:
    """Two encoding constraints as one (each end from whichever states it)."""
    if a is None:
        return b
    if b is None:
        return a
    return (a[0] if a[0] is not None else b[0], a[1] if a[1] is not None else b[1])
