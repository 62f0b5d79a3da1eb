"""AIMET's ``htp_v81`` quantization configuration, and what AIMET keeps in code about it.

``htp_v81.json`` is AIMET's ``htp_quantsim_config_v81.json`` as shipped in aimet-onnx 2.42.0
(BSD-3-Clause, Qualcomm Innovation Center; see ``htp_v81.LICENSE``): op types whose outputs
stay float, per-channel op types, parameter overrides, encoding constraints and supergroups.
What AIMET keeps in code rather than in the file is restated here with its source: the ops
whose outputs are never quantized (``aimet_onnx.quantsim.op_outputs_to_ignore``), the
grid-preserving ops (``aimet_onnx.common.onnx._utils._is_grid_preserving_op``), the ops whose
quantizers are tied and the parameter inputs of each op (``aimet_onnx.meta.connectedgraph``).
aimet-onnx is never imported: it is a test-only dependency.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

__all__ = [
    "CONFIG_NAME",
    "GRID_PRESERVING",
    "IGNORED_OUTPUTS",
    "NORM_OPS",
    "PARAM_INPUTS",
    "TIED_BACKWARD",
    "TIED_FORWARD",
    "WEIGHTED_OPS",
    "config",
    "encoding_constraint",
    "float_output_ops",
    "op_config",
    "param_quantized",
    "param_symmetric",
    "per_channel_ops",
    "supergroups",
]

CONFIG_NAME = "htp_v81"

#: aimet_onnx.quantsim.op_outputs_to_ignore: outputs never given a quantizer.
IGNORED_OUTPUTS = frozenset(
    {
        "Flatten",
        "Gather",
        "Reshape",
        "Shape",
        "Unsqueeze",
        "Squeeze",
        "Split",
        "Compress",
        "Tile",
        "Transpose",
        "Identity",
    }
)

#: aimet_onnx.common.onnx._utils._is_grid_preserving_op: q(f(x)) == f(q(x)); outputs stay
#: unquantized unless the config names the op, and quantizer lookups walk through them.
GRID_PRESERVING = frozenset(
    {
        "Col2Im",
        "Compress",
        "DepthToSpace",
        "Dropout",
        "Expand",
        "Flatten",
        "Gather",
        "GatherElements",
        "GatherND",
        "Identity",
        "MaxPool",
        "MaxRoiPool",
        "NonZero",
        "Pad",
        "ReduceMax",
        "ReduceMin",
        "Reshape",
        "Slice",
        "SpaceToDepth",
        "Split",
        "SplitToSequence",
        "Squeeze",
        "Tile",
        "TopK",
        "Transpose",
        "Unsqueeze",
    }
)

#: op_types_to_tie_qtzrs (+ HTP interpolation ops): the output inherits the input's quantizer.
TIED_FORWARD = frozenset({"Relu", "AveragePool", "Resize", "Upsample"})
#: multi-input grid-equivariant ops: the inputs inherit the output's quantizer.
TIED_BACKWARD = frozenset({"Concat", "Scatter", "ScatterElements", "ScatterND"})

#: aimet_onnx.meta.connectedgraph.find_all_node_info: which inputs of an op are parameters
#: (when they are constants). MatMul's weight is its second input, also through a Transpose.
PARAM_INPUTS: Mapping[str, Mapping[int, str]] = {
    "Conv": {1: "weight", 2: "bias"},
    "ConvTranspose": {1: "weight", 2: "bias"},
    "Gemm": {1: "weight", 2: "bias"},
    "MatMul": {1: "weight"},
    "BatchNormalization": {1: "weight", 2: "bias", 3: "running_mean", 4: "running_var"},
    "InstanceNormalization": {1: "weight", 2: "bias"},
    "LayerNormalization": {1: "weight", 2: "bias"},
    "GroupNormalization": {1: "weight", 2: "bias"},
    "RMSNormalization": {1: "weight"},
    "LSTM": {1: "weight", 2: "weight_r", 3: "bias"},
    "GRU": {1: "weight", 2: "weight_r", 3: "bias"},
    "RNN": {1: "weight", 2: "weight_r", 3: "bias"},
}

#: Ops whose weight input, when not a constant, is quantized as a weight would be (symmetric).
WEIGHTED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
NORM_OPS = frozenset(
    {
        "BatchNormalization",
        "GroupNormalization",
        "InstanceNormalization",
        "LayerNormalization",
        "RMSNormalization",
    }
)


@cache
def config() -> dict[str, Any]:
    """AIMET's htp_v81 quantsim configuration (read once)."""
    text = resources.files(__package__).joinpath(f"{CONFIG_NAME}.json").read_text()
    return json.loads(text)


def _true(value: Any) -> bool:
    return str(value) == "True"


@cache
def op_config() -> Mapping[str, Mapping[str, Any]]:
    return config().get("op_type", {})


@cache
def float_output_ops() -> frozenset[str]:
    """Op types whose outputs the config leaves float (is_output_quantized False)."""
    return frozenset(
        op
        for op, c in op_config().items()
        if "is_output_quantized" in c and not _true(c["is_output_quantized"])
    )


@cache
def per_channel_ops() -> frozenset[str]:
    """Op types whose weights are quantized per output channel."""
    return frozenset(
        op for op, c in op_config().items() if _true(c.get("per_channel_quantization"))
    )


@cache
def supergroups() -> tuple[tuple[str, ...], ...]:
    """Op-type chains whose inner outputs are not quantized (only the last op's output is)."""
    return tuple(tuple(g["op_list"]) for g in config().get("supergroups", []))


def encoding_constraint(op_type: str) -> tuple[float | None, float | None] | None:
    """The (min, max) an op's output encoding is fixed to, if any (None: free)."""
    c = op_config().get(op_type, {}).get("encoding_constraints")
    if c is None:
        return None
    return c.get("min"), c.get("max")


def _param_setting(op_type: str, role: str, key: str) -> Any:
    """A parameter setting by specificity: op type, then param type, then defaults."""
    op = op_config().get(op_type, {}).get("params", {}).get(role, {})
    if key in op:
        return op[key]
    by_role = config().get("params", {}).get(role, {})
    if key in by_role:
        return by_role[key]
    return config()["defaults"]["params"].get(key)


def param_quantized(op_type: str, role: str) -> bool:
    """Whether a parameter (``weight``, ``bias``, ``running_mean``...) of ``op_type`` is."""
    return _true(_param_setting(op_type, role, "is_quantized"))


def param_symmetric(op_type: str, role: str) -> bool:
    """Whether a quantized parameter of ``op_type`` is symmetric."""
    return _true(_param_setting(op_type, role, "is_symmetric"))
