"""Which tensors QNN HTP runs quantized, and how: AIMET's ``htp_v81`` configuration semantics.

QNN quantizes exactly the tensors an encodings file names, so what graphbuild's presets
quantize has to follow what Qualcomm's own tooling expects. This module states those rules
once, over a small graph view (:class:`GraphView`, :mod:`.view`: ONNX op types, tensor
names, which tensors are float, constant or graph inputs). Two adapters build views: the ONNX
one (``coverage``: what an exported model should carry) and the aten one (``preset``: where
the PT2E quantizer puts its observers). The same rules on both is what makes the preset's
encodings match the model.

The op lists come from AIMET's configuration (:mod:`graphbuild.targets.qnn.rules.config`); the
exception rules of AIMET's ``QuantizationSimModel`` (norm weights, activation MatMul) are
restated here; what matches patterns across ops (its graph passes MatmulAdd and
RMSNormalization, supergroups, tied quantizers) in :mod:`.groups`, over the quantizers of
:mod:`.quantizers`. aimet-onnx is never imported: ``tests/test_aimet_interop.py`` checks
that the two agree on the test zoo.

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

Where the HTP backend and AIMET differ, the HTP wins (docs/design.md, invariant 12). One rule is
the HTP's alone: a Softmax's input has a step of at least :data:`SOFTMAX_MIN_INPUT_SCALE`. The
HTP's 16-bit Softmax computes garbage from a finer input grid (a step below about 2^-18.5, a
+-0.06 range: attention scores of a random-initialised transformer; 2,000 output steps off
onnxruntime's CPU), and right from a coarser one (1-3 steps); a step of 2^-17 changes the
Softmax's output by less than half a 16-bit output step.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphbuild.targets.qnn.rules.config import (
    CONFIG_NAME,
    GRID_PRESERVING,
    IGNORED_OUTPUTS,
    NORM_OPS,
    PARAM_INPUTS,
    WEIGHTED_OPS,
    encoding_constraint,
    float_output_ops,
    op_config,
    param_quantized,
    param_symmetric,
    per_channel_ops,
)
from graphbuild.targets.qnn.rules.groups import (
    apply_matmul_add,
    apply_rms_norm,
    apply_supergroups,
    tie_backward,
    tie_forward,
)
from graphbuild.targets.qnn.rules.quantizers import Quantizer, Quantizers
from graphbuild.targets.qnn.rules.view import GraphView, OpNode, ViewWalk

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


def plan(view: GraphView, param_bits: int, activation_bits: int) -> Plan:
    """The HTP rule for every float tensor of ``view`` with ``param_bits``-bit weights and
    ``activation_bits``-bit activations (AIMET's param_type / activation_type)."""
    return _Planner(view, param_bits, activation_bits).run()


class _Planner:
    def __init__(self, view: GraphView, param_bits: int, activation_bits: int) -> None:
        self.view = view
        self.param_bits, self.act_bits = param_bits, activation_bits
        self.walk = ViewWalk(view)
        self.q = Quantizers(self.walk)  # tensor -> its quantizer (shared when tied)
        self.params: dict[str, tuple[OpNode, str]] = {}

    def run(self) -> Plan:
        walk, q = self.walk, self.q
        self._find_params()
        self._create_quantizers()
        self._disable_outputs()
        matched = apply_matmul_add(walk, q, self.params, self.param_bits)
        matched |= apply_rms_norm(walk, q)
        apply_supergroups(walk, q, matched)
        self._configure_params()
        self._apply_constraints()
        self._apply_weight_symmetry_to_inputs()
        self._apply_exception_rules()
        tie_backward(walk, q)
        tie_forward(walk, q)
        self._apply_htp_minimums()
        return Plan(self._rules(), walk.producers)

    # -- 1. quantizers ---------------------------------------------------------------------

    def _find_params(self) -> None:
        for op in self.view.ops:
            slots = PARAM_INPUTS.get(op.op_type, {})
            for index, role in slots.items():
                if index >= len(op.inputs):
                    continue
                tensor = op.inputs[index]
                const = self.walk.constant(tensor) if op.op_type == "MatMul" else None
                if op.op_type != "MatMul" and tensor in self.view.constants:
                    const = tensor
                if const is not None and const not in self.params:
                    self.params[const] = (op, role)

    def _create_quantizers(self) -> None:
        floats = self.view.floats
        seen: list[str] = list(self.view.inputs)
        for op in self.view.ops:
            seen.extend(t for t in op.inputs if t is not None)
            seen.extend(op.outputs)
        for t in dict.fromkeys(seen):
            if t not in floats:
                continue
            if t in self.params:
                self.q[t] = Quantizer(param=True, bits=self.param_bits, symmetric=True)
                continue
            producer = self.walk.producers.get(t)
            if producer is not None and producer.op_type in IGNORED_OUTPUTS:
                continue  # no quantizer at all (quantsim._is_tensor_quantizable)
            if any(c.op_type == "Resize" and c.inputs[0] != t for c in self.walk.consumers[t]):
                continue
            self.q[t] = Quantizer(param=False, bits=self.act_bits, symmetric=False)

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
            self.q.disable_outputs([op], why)

    # -- 2. settings -----------------------------------------------------------------------

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

    def _norm_param(self, q: Quantizer, op: OpNode) -> None:
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

    def _apply_weight_symmetry_to_inputs(self) -> None:
        """_apply_param_symmetry_to_inputs: a non-constant weight input is symmetric."""
        for op in self.view.ops:
            if op.op_type not in WEIGHTED_OPS or len(op.inputs) < 2:
                continue
            weight = op.inputs[1]
            if weight is None or self.walk.constant(weight) in self.params:
                continue
            source = self.q.enabled_source(weight)
            if source is not None:
                self.q[source].symmetric = param_symmetric(op.op_type, "weight")

    def _apply_exception_rules(self) -> None:
        """Dynamic MatMul on V73+: a 16-bit second input is symmetric and makes the first
        input 16-bit."""
        for op in self.view.ops:
            if op.op_type != "MatMul" or self.walk.constant(op.inputs[1]) in self.params:
                continue
            first = self.q.enabled_source(op.inputs[0])
            second = self.q.enabled_source(op.inputs[1])
            if first is None or second is None:
                continue
            if self.q[second].bits == 16:
                self.q[second].symmetric = True
                self.q[first].bits = 16

    def _apply_htp_minimums(self) -> None:
        """The HTP's own rule: a Softmax's input grid no finer than it computes right from."""
        for op in self.view.ops:
            if op.op_type != "Softmax" or not op.inputs:
                continue
            src = self.q.enabled_source(op.inputs[0])
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
            producer = self.walk.producers.get(t)
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
