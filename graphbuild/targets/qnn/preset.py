"""QNN-style preset quantizer for torchao PT2E.

Weights are signed, symmetric, per output channel; activations are unsigned, asymmetric, per
tensor, which is how QNN HTP expects a model to be quantized. The quantizer annotates an
aten-level graph (``torch.export.export(...).module()``): every annotated op gets its float
tensor inputs and its output quantized, so that each annotated op runs between quantizers.
Biases, scalars and integer tensors (token ids, indices) stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.observer import MinMaxObserver, PerChannelMinMaxObserver
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
)

from graphbuild.errors import ConfigError
from graphbuild.frontend.quantize import register_preset, resolve_attr

__all__ = ["PRESETS", "QnnQuantizer", "activation_spec", "weight_spec"]

aten = torch.ops.aten

_ANNOTATION_KEY = "quantization_annotation"


@dataclass(frozen=True)
class _Bits:
    weight: int
    activation: int


_PRESET_BITS: dict[str, _Bits] = {
    "w8a8": _Bits(weight=8, activation=8),
    "w8a16": _Bits(weight=8, activation=16),
    "w4a16": _Bits(weight=4, activation=16),
}

PRESETS: tuple[str, ...] = tuple(_PRESET_BITS)

# Unsigned activation containers that quantized_decomposed and torchao's observers accept.
_ACTIVATION_DTYPES: dict[int, torch.dtype] = {8: torch.uint8, 16: torch.uint16}


def weight_spec(bits: int) -> QuantizationSpec:
    """Signed symmetric per-output-channel weight spec: grid [-(2^(b-1)-1), 2^(b-1)-1] in int8.

    The narrow grid (-127 rather than -128) keeps zero point 0 exact, as QNN's symmetric
    weights require; 4-bit weights live in an int8 container with grid [-7, 7].
    """
    if bits not in (4, 8):
        raise ConfigError(f"weight bit-width must be 4 or 8, got {bits}")
    qmax = 2 ** (bits - 1) - 1
    return QuantizationSpec(
        dtype=torch.int8,
        observer_or_fake_quant_ctr=PerChannelMinMaxObserver,
        quant_min=-qmax,
        quant_max=qmax,
        qscheme=torch.per_channel_symmetric,
        ch_axis=0,
    )


def activation_spec(bits: int) -> QuantizationSpec:
    """Unsigned asymmetric per-tensor activation spec: grid [0, 2^b - 1] in uint8 or uint16."""
    if bits not in _ACTIVATION_DTYPES:
        raise ConfigError(f"activation bit-width must be 8 or 16, got {bits}")
    return QuantizationSpec(
        dtype=_ACTIVATION_DTYPES[bits],
        observer_or_fake_quant_ctr=MinMaxObserver,
        quant_min=0,
        quant_max=2**bits - 1,
        qscheme=torch.per_tensor_affine,
    )


# ---------------------------------------------------------------------------------------------
# Graph helpers


def _value(model: GraphModule, arg: object) -> object:
    """The example value (fake or real tensor) an fx argument stands for."""
    if not isinstance(arg, Node):
        return None
    if arg.op == "get_attr" and isinstance(arg.target, str):
        return resolve_attr(model, arg.target)
    return arg.meta.get("val")


def _is_float(model: GraphModule, arg: object) -> bool:
    """True for a Node that carries a floating-point tensor."""
    value = _value(model, arg)
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _is_annotated(node: Node) -> bool:
    annotation = node.meta.get(_ANNOTATION_KEY)
    return bool(annotation is not None and annotation._annotated)


def _packet(node: Node) -> object:
    """The OpOverloadPacket of a call_function node (aten.linear for aten.linear.default)."""
    return getattr(node.target, "overloadpacket", None)


# ---------------------------------------------------------------------------------------------
# The quantizer


class QnnQuantizer(Quantizer):
    """torchao PT2E quantizer with QNN presets: ``w8a8``, ``w8a16``, ``w4a16``."""

    def __init__(self, preset: str = "w8a8") -> None:
        if preset not in _PRESET_BITS:
            known = ", ".join(PRESETS)
            raise ConfigError(f"unknown quantizer preset '{preset}'; known presets: {known}")
        bits = _PRESET_BITS[preset]
        self.preset = preset
        self.weight_bits = bits.weight
        self.activation_bits = bits.activation
        self.weight_qspec = weight_spec(bits.weight)
        self.activation_qspec = activation_spec(bits.activation)

    def __repr__(self) -> str:
        return f"QnnQuantizer(preset={self.preset!r})"

    def annotate(self, model: GraphModule) -> GraphModule:
        """Attach quantization annotations to every supported float op in ``model``."""
        model.meta["graphbuild.dynamic"] = _depends_on_inputs(model)
        for node in model.graph.nodes:
            if node.op != "call_function" or _is_annotated(node):
                continue
            handler = _HANDLERS.get(_packet(node))
            if handler is not None and _is_float(model, node):
                handler(self, model, node)
        return model

    def validate(self, model: GraphModule) -> None:
        """Nothing to check: every annotation this quantizer makes is supported by QNN."""

    # -- per op family -------------------------------------------------------------------------

    def _annotate(self, node: Node, inputs: dict[Node, QuantizationSpec]) -> None:
        node.meta[_ANNOTATION_KEY] = QuantizationAnnotation(
            input_qspec_map=inputs,
            output_qspec=self.activation_qspec,
            _annotated=True,
        )

    def _activations(self, model: GraphModule, args: list[object]) -> dict[Node, QuantizationSpec]:
        """Activation specs for the float tensor Nodes among ``args`` (scalars stay as they are)."""
        return {
            a: self.activation_qspec for a in args if isinstance(a, Node) and _is_float(model, a)
        }

    def _weighted(self, model: GraphModule, node: Node) -> None:
        """conv / linear: input per tensor, weight per output channel, bias left float."""
        x, weight = node.args[0], node.args[1]
        if not (isinstance(x, Node) and isinstance(weight, Node)):
            return
        if not (_is_float(model, x) and _is_float(model, weight)):
            return
        if _packet(node) is aten.convolution and _transposed(node):
            return  # transposed conv keeps output channels on axis 1: not a preset shape
        self._annotate(node, {x: self.activation_qspec, weight: self.weight_qspec})

    def _elementwise(self, model: GraphModule, node: Node) -> None:
        """add / mul / matmul family: every float tensor operand and the output. An op with a
        constant tensor operand (an attention mask, a norm's weight) stays float: a mask's
        -inf or finfo.min would leave the output quantizer no usable range."""
        inputs = self._activations(model, list(node.args[:2]))
        if any(a not in model.meta["graphbuild.dynamic"] for a in inputs):
            return
        if inputs:
            self._annotate(node, inputs)

    def _unary(self, model: GraphModule, node: Node) -> None:
        """relu, gelu, silu, sigmoid, tanh, softmax: input and output; skipped when the
        input comes from an op that was deliberately left float (e.g. a masked add)."""
        x = node.args[0] if node.args else None
        if isinstance(x, Node) and _packet(x) in _HANDLERS and not _is_annotated(x):
            return
        inputs = self._activations(model, list(node.args[:1]))
        if inputs:
            self._annotate(node, inputs)

    def _attention(self, model: GraphModule, node: Node) -> None:
        """scaled_dot_product_attention: query, key, value and output; the mask stays float."""
        qkv = list(node.args[:3])
        if all(_is_float(model, a) for a in qkv):
            self._annotate(node, self._activations(model, qkv))


def _depends_on_inputs(model: GraphModule) -> set[Node]:
    """Nodes whose value depends on a user input (placeholders of the unlifted module)."""
    dynamic: set[Node] = set()
    for node in model.graph.nodes:
        if node.op == "placeholder" or any(a in dynamic for a in node.all_input_nodes):
            dynamic.add(node)
    return dynamic


def _transposed(node: Node) -> bool:
    """Whether an aten.convolution node is a transposed convolution."""
    args = node.args
    return bool(args[6]) if len(args) > 6 else bool(node.kwargs.get("transposed", False))


_Handler = Callable[[QnnQuantizer, GraphModule, Node], None]

_HANDLERS: dict[object, _Handler] = {
    **dict.fromkeys(
        (aten.conv1d, aten.conv2d, aten.convolution, aten.linear), QnnQuantizer._weighted
    ),
    **dict.fromkeys(
        (aten.add, aten.mul, aten.matmul, aten.bmm, aten.mm), QnnQuantizer._elementwise
    ),
    **dict.fromkeys(
        (
            aten.relu,
            aten.gelu,
            aten.silu,
            aten.sigmoid,
            aten.tanh,
            aten.softmax,
            aten._softmax,
        ),
        QnnQuantizer._unary,
    ),
    aten.scaled_dot_product_attention: QnnQuantizer._attention,
}


for _name in PRESETS:
    register_preset(_name, lambda _name=_name: QnnQuantizer(_name))
