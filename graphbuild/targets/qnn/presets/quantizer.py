"""QNN presets for torchao PT2E: quantize what QNN HTP runs quantized, as AIMET would.

``QnnQuantizer("w8a16")`` annotates an aten graph (``torch.export.export(...).module()``) so
that after calibration every tensor the HTP rules (:mod:`graphbuild.targets.qnn.rules.plan`, AIMET's
``htp_v81`` semantics) quantize carries exactly one quantizer, on the tensor rather than on
an edge: all readers read the quantized value. Before annotating, the graph is rewritten so
each such tensor exists in aten (:mod:`graphbuild.targets.qnn.rewrites.aten`). Weights are
symmetric on the full signed grid (per output channel for Conv, ConvTranspose, Gemm and MatMul
weights), activations asymmetric on the unsigned grid, with AIMET's exceptions (symmetric
second input of an activation MatMul, fixed Softmax/Sigmoid/Tanh ranges, 8-bit asymmetric
LayerNorm weights, tied Concat/Relu/AveragePool encodings).

``w4a16_lpbq`` is ``w4a16`` with a linear layer's weight in LPBQ blocks of 64 input channels
(:mod:`graphbuild.targets.qnn.presets.lpbq_weights`): int4 values, 4-bit integer block scales
under a float scale per output channel, as AIMET's ``set_lpbq_for_params`` and QNN's HTP run LLM
weights; a weight whose input channels do not divide into blocks stays per channel.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.observer import ObserverBase
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpecBase,
    Quantizer,
    SharedQuantizationSpec,
)

from graphbuild.errors import ConfigError, ExportError
from graphbuild.frontend.quantize import register_preset, resolve_attr
from graphbuild.targets.qnn.options import LPBQ_PRESETS
from graphbuild.targets.qnn.presets.lpbq_weights import SCALE_BITS, lpbq_spec, takes_lpbq
from graphbuild.targets.qnn.presets.observers import quantization_spec
from graphbuild.targets.qnn.presets.overrides import (
    apply_layer_overrides,
    parse_layer_overrides,
    tensor_modules,
)
from graphbuild.targets.qnn.rewrites.aten import rewrite_for_htp
from graphbuild.targets.qnn.rules.aten_view import AtenView, aten_view
from graphbuild.targets.qnn.rules.plan import Plan, TensorRule, plan

__all__ = [
    "PRESETS",
    "QnnQuantizer",
    "activation_spec",
    "is_preset_quantizer",
    "lpbq_block_scale_bits",
    "observed_tensors",
    "observer_rules",
    "placed_tensors",
    "preset_bits",
    "weight_spec",
    "with_layer_overrides",
]

_ANNOTATION_KEY = "quantization_annotation"


@dataclass(frozen=True)
class _Bits:
    weight: int
    activation: int


_PRESET_BITS: dict[str, _Bits] = {
    "w8a8": _Bits(weight=8, activation=8),
    "w8a16": _Bits(weight=8, activation=16),
    "w4a16": _Bits(weight=4, activation=16),
    "w4a16_lpbq": _Bits(weight=4, activation=16),
}
#: presets whose linear weights are LPBQ (block scale bits)
_LPBQ_PRESETS: dict[str, int] = dict.fromkeys(LPBQ_PRESETS, SCALE_BITS)

PRESETS: tuple[str, ...] = tuple(_PRESET_BITS)


def preset_bits(preset: str) -> tuple[int, int]:
    """(weight bits, activation bits) of a preset name."""
    if preset not in _PRESET_BITS:
        known = ", ".join(PRESETS)
        raise ConfigError(f"unknown quantizer preset '{preset}'; known presets: {known}")
    bits = _PRESET_BITS[preset]
    return bits.weight, bits.activation


def weight_spec(bits: int, axis: int = 0):
    """Symmetric per-output-channel weights on the full signed grid (int8 [-128, 127], int4
    [-8, 7] in an int8 container), AIMET's scale."""
    if bits not in (4, 8):
        raise ConfigError(f"weight bit-width must be 4 or 8, got {bits}")
    return quantization_spec(bits, symmetric=True, axis=axis)


def activation_spec(bits: int):
    """Asymmetric per-tensor activations on the unsigned grid [0, 2^b - 1]."""
    if bits not in (8, 16):
        raise ConfigError(f"activation bit-width must be 8 or 16, got {bits}")
    return quantization_spec(bits, symmetric=False)


class QnnQuantizer(Quantizer):
    """torchao PT2E quantizer with QNN presets: ``w8a8``, ``w8a16``, ``w4a16``, ``w4a16_lpbq``.

    ``layer_overrides`` (module pattern -> ``"float"``, ``"w4"``, ``"a8"``, ...: see
    :mod:`~graphbuild.targets.qnn.presets.overrides`) is a hook applied after the HTP rules: it
    changes the bits of, or removes, the quantizers the rules placed in the matched modules
    (the coverage report applies the same hook to the rules it expects)."""

    def __init__(self, preset: str = "w8a8", layer_overrides: Any = None) -> None:
        self.weight_bits, self.activation_bits = preset_bits(preset)
        self.preset = preset
        self.layer_overrides = parse_layer_overrides(layer_overrides)
        self.lpbq = preset in _LPBQ_PRESETS

    def __repr__(self) -> str:
        if self.layer_overrides:
            shown = {p: s.text for p, s in sorted(self.layer_overrides.items())}
            return f"QnnQuantizer(preset={self.preset!r}, layer_overrides={shown!r})"
        return f"QnnQuantizer(preset={self.preset!r})"

    def transform_before_prepare(self, model: GraphModule) -> GraphModule:
        """The rewrites, before torchao folds BatchNorm into convolutions (it refuses one
        whose bias is computed, which the rewrites take out of the convolution)."""
        return rewrite_for_htp(model)

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        """One aten op per ONNX op that QNN quantizes (see ``rewrite``; a second pass over a
        rewritten graph changes nothing)."""
        return rewrite_for_htp(model)

    def plan(self, model: GraphModule) -> tuple[AtenView, Plan]:
        """The HTP rule of every float tensor of ``model`` (after the rewrite)."""
        view = aten_view(model)
        rules = plan(view.view, self.weight_bits, self.activation_bits)
        if self.layer_overrides:
            rules, _, _ = apply_layer_overrides(
                rules,
                tensor_modules(view),
                self.layer_overrides,
                (self.weight_bits, self.activation_bits),
            )
        return view, rules

    def annotate(self, model: GraphModule) -> GraphModule:
        """Attach one quantizer to every tensor the HTP rules quantize. What was placed where
        is kept (``placed``), so that the rules of the other presets can be read for the
        same observers (``observer_rules``)."""
        view, rules = self.plan(model)
        annotator = _Annotator(model, view, rules, lpbq=self.lpbq)
        annotator.run()
        self.placed = _Placed(view, rules, dict(annotator.placed), annotator.lpbq_ready())
        return model

    def validate(self, model: GraphModule) -> None:
        """Nothing to check: every annotation follows the HTP rules."""


class _Annotator:
    """Turns the plan into PT2E annotations: outputs of ops get an output spec; model inputs
    and constants (weights, scalars) get the spec on every edge to their readers, shared."""

    def __init__(self, gm: GraphModule, view: AtenView, rules: Plan, lpbq: bool = False) -> None:
        self.gm, self.view, self.rules, self.lpbq = gm, view, rules, lpbq
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.inputs: dict[Node, dict[Node, QuantizationSpecBase]] = defaultdict(dict)
        self.output: dict[Node, QuantizationSpecBase] = {}
        self.anchors: dict[str, object] = {}
        #: (observed node, first reader or "" for an output) -> the tensor quantized there
        self.placed: dict[tuple[str, str], str] = {}
        self.skipped = self._unsupported_tensors()
        self.readers: dict[str, list[Node]] = defaultdict(list)
        for op in view.view.ops:  # the fx nodes that read each tensor, as the view has it
            node = view.nodes[op.name]
            for t in dict.fromkeys(i for i in op.inputs if i is not None):
                if node.op == "call_function" and node not in self.readers[t]:
                    self.readers[t].append(node)

    def _unsupported_tensors(self) -> set[str]:
        """Outputs and parameters of ops the preset does not support (left float)."""
        skipped: set[str] = set()
        for op in self.view.view.ops:
            if op.name in self.view.unsupported:
                skipped.update(op.outputs)
                skipped.update(t for t in op.inputs if t in self.view.view.constants)
        return skipped

    def run(self) -> None:
        quantized = self.rules.quantized()
        owners = [t for t, r in quantized.items() if r.group == t]
        members = [t for t, r in quantized.items() if r.group != t]
        for tensor in owners:
            self._place(tensor, self._spec(tensor, quantized[tensor]))
        for tensor in members:
            anchor = self.anchors.get(quantized[tensor].group)
            if anchor is not None:
                self._place(tensor, SharedQuantizationSpec(anchor))
        for node in set(self.inputs) | set(self.output):
            node.meta[_ANNOTATION_KEY] = QuantizationAnnotation(
                input_qspec_map=dict(self.inputs.get(node, {})),
                output_qspec=self.output.get(node),
                _annotated=True,
            )

    def lpbq_ready(self) -> frozenset[str]:
        """The quantized weights an LPBQ preset gives LPBQ blocks where they are int4."""
        rules = self.rules.quantized()
        return frozenset(t for t, r in rules.items() if r.group == t and self._takes_lpbq(t, r))

    def _takes_lpbq(self, tensor: str, rule: TensorRule) -> bool:
        axis = self._axis(tensor) if rule.per_channel else None
        return (
            axis is not None and takes_lpbq(self._shape(tensor), axis) and not self._biased(tensor)
        )

    def _spec(self, tensor: str, rule: TensorRule) -> QuantizationSpecBase:
        axis = self._axis(tensor) if rule.per_channel else None
        # LPBQ weights are int4 (a layer override to w8 is not LPBQ)
        if self.lpbq and rule.bits == 4 and self._takes_lpbq(tensor, rule):
            return lpbq_spec()
        if rule.per_channel and axis is None:
            return quantization_spec(rule.bits, symmetric=rule.symmetric)
        return quantization_spec(
            rule.bits,
            symmetric=rule.symmetric,
            axis=axis,
            fixed=rule.fixed,
            min_scale=rule.min_scale,
        )

    def _shape(self, tensor: str) -> tuple[int, ...]:
        """The shape of a weight (a constant the graph reads), or () if unknown."""
        source, _ = self.view.edges.get(tensor, (tensor, ""))
        node = self.nodes.get(source)
        value = resolve_attr(self.gm, str(node.target)) if node is not None else None
        return tuple(value.shape) if isinstance(value, torch.Tensor) else ()

    def _biased(self, tensor: str) -> bool:
        """Whether a weight is read by a linear layer with a bias. QNN's HTP (onnxruntime-qnn
        2.7, v81) computes an LPBQ MatMul followed by its bias Add wrong (thousands of output
        steps from onnxruntime's CPU on the same file; per channel, or without the bias, a
        few), so the LPBQ preset leaves such a weight per channel."""
        consumers = [c for (w, c), _ in self.view.weight_axes.items() if w == tensor]
        for name in consumers:
            node = self.nodes.get(name)
            bias = node.args[2] if node is not None and len(node.args) > 2 else None
            if bias is None and node is not None:
                bias = node.kwargs.get("bias")
            if bias is not None:
                return True
        return False

    def _axis(self, tensor: str) -> int | None:
        """The output-channel axis of a weight in the op that reads it as one."""
        axes = [axis for (weight, _), axis in self.view.weight_axes.items() if weight == tensor]
        return axes[0] if axes else None

    def _place(self, tensor: str, spec: QuantizationSpecBase) -> None:
        source, _ = self.view.edges.get(tensor, (tensor, ""))
        node = self.nodes.get(source)
        if node is None or tensor in self.skipped:
            return  # a tensor of the view alone (inside a lowered op): nothing to annotate
        if node.op == "call_function" and tensor not in self.view.edges:
            self.output[node] = spec
            self.anchors.setdefault(tensor, node)
            self.placed.setdefault((node.name, ""), tensor)
            return
        readers = self.readers.get(tensor, [])
        if not readers:
            return
        first = (node, readers[0])
        self.placed.setdefault((node.name, readers[0].name), tensor)
        self.inputs[readers[0]][node] = spec
        for reader in readers[1:]:
            self.inputs[reader][node] = SharedQuantizationSpec(first)
        self.anchors.setdefault(tensor, first)


def with_layer_overrides(quantizer: Any, overrides: Any) -> Any:
    """``quantizer`` (a preset name or a QnnQuantizer) with ``layer_overrides`` applied;
    as it is when there are none."""
    if not overrides:
        return quantizer
    preset = quantizer if isinstance(quantizer, str) else getattr(quantizer, "preset", None)
    if preset not in _PRESET_BITS:
        raise ConfigError(f"layer_overrides apply to a QNN preset, not to {quantizer!r}")
    return QnnQuantizer(preset, overrides)


def lpbq_block_scale_bits(quantizer: object) -> int | None:
    """The block scales' bit-width of a preset (a name or an instance) whose weights are LPBQ,
    else None."""
    preset = quantizer.preset if isinstance(quantizer, QnnQuantizer) else quantizer
    return _LPBQ_PRESETS.get(preset) if isinstance(preset, str) else None


@dataclass(frozen=True)
class _Placed:
    """The plan one annotation followed, and the tensor placed at each observed spot."""

    view: AtenView
    rules: Plan
    spots: dict[tuple[str, str], str]
    lpbq: frozenset[str] = frozenset()


def observer_rules(
    quantizer: QnnQuantizer, prepared: GraphModule, presets: tuple[str, ...] = PRESETS
) -> dict[str, dict[str, TensorRule]]:
    """For every observer module of ``prepared`` (``prepare_pt2e`` with ``quantizer``), the
    HTP rule of the tensor it observes under each of ``presets``: the presets quantize the
    same tensors with other bit-widths and symmetries, so one placement serves them all and
    a preset change recomputes values only (docs/design.md, invariant 13). An
    :class:`ExportError` names a tensor the presets would place differently."""
    placed = _placed(quantizer)
    plans = {}
    for name in presets:
        weight_bits, activation_bits = preset_bits(name)
        plans[name] = plan(placed.view.view, weight_bits, activation_bits)
    _check_same_placement(placed.rules, plans)
    out: dict[str, dict[str, TensorRule]] = {}
    for observer, tensor in observed_tensors(quantizer, prepared).items():
        owner = placed.rules[tensor].group
        out[observer] = {name: p[owner] for name, p in plans.items()}
    return out


def observed_tensors(quantizer: QnnQuantizer, prepared: GraphModule) -> dict[str, str]:
    """For every observer module of ``prepared`` (``prepare_pt2e`` with ``quantizer``), the
    tensor of the HTP rules it quantizes: what a layer override matches it by."""
    placed = _placed(quantizer)
    modules = dict(prepared.named_modules(remove_duplicate=False))
    out: dict[str, str] = {}
    for node in prepared.graph.nodes:
        if node.op != "call_module" or not isinstance(modules[node.target], ObserverBase):
            continue
        source = node.args[0]
        spots = [(source.name, ""), *((source.name, u.name) for u in node.users)]
        tensor = next((placed.spots[s] for s in spots if s in placed.spots), None)
        if tensor is None:
            raise ExportError(f"observer_rules: no tensor was placed at '{source.name}'")
        out.setdefault(str(node.target), tensor)
    return out


def placed_tensors(quantizer: QnnQuantizer) -> dict[str, Any]:
    """What the values of a placement need to apply ``layer_overrides`` and LPBQ without
    placing again: every tensor the rules quantize with its modules, whether it is a weight
    and the tensor whose encoding it shares (``tensors``), and the weights that take LPBQ
    blocks in an LPBQ preset (``lpbq``)."""
    placed = _placed(quantizer)
    modules = tensor_modules(placed.view)
    tensors = {
        tensor: {
            "modules": sorted(modules.get(tensor, ())),
            "param": rule.param,
            "group": rule.group,
        }
        for tensor, rule in sorted(placed.rules.quantized().items())
    }
    return {"tensors": tensors, "lpbq": sorted(placed.lpbq)}


def _placed(quantizer: QnnQuantizer) -> _Placed:
    placed: _Placed | None = getattr(quantizer, "placed", None)
    if placed is None:
        raise ExportError("observer_rules: the quantizer has not annotated a graph yet")
    return placed


def _check_same_placement(reference: Plan, plans: dict[str, Plan]) -> None:
    want = {t: r.group for t, r in reference.quantized().items()}
    for name, other in plans.items():
        got = {t: r.group for t, r in other.quantized().items()}
        if got != want:
            differ = sorted(set(got.items()) ^ set(want.items()))[:5]
            raise ExportError(
                f"preset '{name}' quantizes other tensors than the placement it shares "
                f"({', '.join(t for t, _ in differ)}): give it a placement of its own in "
                "graphbuild.targets.qnn.options.PRESET_PLACEMENTS"
            )


def is_preset_quantizer(quantizer: object) -> bool:
    """Whether ``quantizer`` (a name or an instance) is one of the QNN presets."""
    if isinstance(quantizer, str):
        return quantizer in _PRESET_BITS
    return isinstance(quantizer, QnnQuantizer)


for _name in PRESETS:
    register_preset(_name, lambda _name=_name: QnnQuantizer(_name))
