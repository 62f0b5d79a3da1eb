"""Recognisers: what a quantizer looks like in an exported program.

A recogniser matches a quantizer pattern (a fake-quant node, a quantize node with its dequantize
users, a custom op) at an anchor node and says what it is: a :class:`Match` with the grid, the
axis and where its values live. :func:`register_recognizer` adds one for a custom quantizer op;
the helpers (``op_name``, ``get_arg``, ``value_ref``, ...) are public for that purpose.
``normalize`` replaces what they match with markers; ``qvalues`` reads the values.

One recogniser family a module: ``aten`` (ATen fake quant), ``qdq`` (quantized_decomposed
q/dq pairs), ``fastforward``, ``aimet``; ``computed`` reads the value subgraphs the last two
compute scales and zero points with; ``registry`` holds :class:`Match`, the protocol and the
registry; ``helpers`` what every recogniser reads arguments with. The built-ins are
registered here, in the order they are tried.
"""

from graphbuild.frontend.recognizers.aimet import AimetQuantizeDequantizeRecognizer
from graphbuild.frontend.recognizers.aten import CachemaskRecognizer, FakeQuantRecognizer
from graphbuild.frontend.recognizers.computed import computed_ref
from graphbuild.frontend.recognizers.fastforward import FastForwardRecognizer
from graphbuild.frontend.recognizers.helpers import (
    VALUE_HELPERS,
    _Layout,
    aten_name,
    get_arg,
    input_spec,
    int_arg,
    op_name,
    op_parts,
    param_of,
    stored_tensor,
    value_ref,
)
from graphbuild.frontend.recognizers.qdq import QDQGroupRecognizer, QDQPairRecognizer
from graphbuild.frontend.recognizers.registry import (
    Match,
    Recognizer,
    _registry,
    grid_bits,
    recognizers,
    register_recognizer,
    unregister_recognizer,
)

__all__ = [
    "AimetQuantizeDequantizeRecognizer",
    "CachemaskRecognizer",
    "FakeQuantRecognizer",
    "FastForwardRecognizer",
    "Match",
    "QDQGroupRecognizer",
    "QDQPairRecognizer",
    "Recognizer",
    "VALUE_HELPERS",
    "aten_name",
    "get_arg",
    "grid_bits",
    "input_spec",
    "int_arg",
    "op_name",
    "op_parts",
    "param_of",
    "computed_ref",
    "recognizers",
    "register_recognizer",
    "stored_tensor",
    "unregister_recognizer",
    "value_ref",
]


def _builtin_recognizers() -> list[Recognizer]:
    per_tensor = _Layout()
    per_channel = _Layout(scale=1, zero_point=2, axis=3, qmin=4, qmax=5)
    qdq_tensor = _Layout(dtype=5)
    qdq_channel = _Layout(axis=3, qmin=4, qmax=5, dtype=6)
    return [
        FakeQuantRecognizer(
            "aten", "fake_quantize_per_tensor_affine", ("default", "tensor_qparams"), per_tensor
        ),
        FakeQuantRecognizer("aten", "fake_quantize_per_channel_affine", ("default",), per_channel),
        FakeQuantRecognizer(
            "aten", "_fake_quantize_learnable_per_tensor_affine", ("default",), per_tensor
        ),
        FakeQuantRecognizer(
            "aten", "_fake_quantize_learnable_per_channel_affine", ("default",), per_channel
        ),
        CachemaskRecognizer(
            "aten", "fake_quantize_per_tensor_affine_cachemask", ("default",), per_tensor
        ),
        CachemaskRecognizer(
            "aten",
            "_fake_quantize_per_tensor_affine_cachemask_tensor_qparams",
            ("default",),
            _Layout(enabled=3, qmin=4, qmax=5),
        ),
        CachemaskRecognizer(
            "aten", "fake_quantize_per_channel_affine_cachemask", ("default",), per_channel
        ),
        QDQPairRecognizer(
            "quantized_decomposed", "quantize_per_tensor", "dequantize_per_tensor", qdq_tensor
        ),
        QDQPairRecognizer(
            "quantized_decomposed", "quantize_per_channel", "dequantize_per_channel", qdq_channel
        ),
        QDQGroupRecognizer(),
        FastForwardRecognizer(),
        AimetQuantizeDequantizeRecognizer(),
    ]


_registry.extend(_builtin_recognizers())
