"""The position processor: the small CPU ONNX model first in onnxruntime-genai's pipeline.

onnxruntime-genai's windowed decoder pipeline hands the model two integer inputs:

- ``attention_mask_before_processor`` int32 ``[1, CL]``: 1 where a key slot holds a valid
  token. Slots ``0..CL-S-1`` are the past (the uint8 KV cache inputs), ``CL-S..CL-1`` the
  ``S`` tokens of this run (``S`` = the prompt window ``N``, or 1 per generated token). The ones
  are one contiguous block ending at ``CL-1``: the valid tokens so far, oldest leftmost; the
  prompt's left padding (pad token id) and the never-written slots are 0.
- ``position_ids`` int32 ``[1, S]``: each token's position (0 for the left padding).

The part graphs take no integer positions: they want an additive float mask and the rotary
tables. This model computes them, as AI Hub's position processors do
(``AttentionMaskConverter(is_causal=True).to_4d(mask, query_length=S, key_value_length=CL)``
clipped, and the rotary embedding of the positions), in plain ONNX ops:

- ``attention_mask`` float ``[1, 1, S, CL]``: 0 where query ``i`` may attend key ``j`` (the
  slot is valid and ``j <= i + CL - S``, causal over the new tokens), ``mask_value`` elsewhere;
- ``position_ids_cos`` / ``position_ids_sin`` float ``[1, 1, S, D/2]``:
  ``cos(p * inv_freq) * attention_scaling`` and likewise ``sin`` (the first half of the
  rotary table: the graphs rotate halves).

``S`` is symbolic so one model serves the prompt and the token runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphbuild.errors import ConfigError

__all__ = [
    "ATTENTION_MASK_IN",
    "DEFAULT_MASK_VALUE",
    "POSITION_IDS_IN",
    "PROCESSOR_OUTPUTS",
    "build_float_position_processor",
    "build_position_processor",
    "write_position_processor",
]

#: The input onnxruntime-genai feeds its windowed attention mask to (``inputs.attention_mask``
#: in ``genai_config.json`` names it; the part graphs' own ``attention_mask`` is the float one).
ATTENTION_MASK_IN = "attention_mask_before_processor"
#: The input onnxruntime-genai feeds the positions of this run's tokens to.
POSITION_IDS_IN = "position_ids"
#: The processor's outputs, inputs of every decoder part graph.
PROCESSOR_OUTPUTS = ("attention_mask", "position_ids_cos", "position_ids_sin")
#: AI Hub's clip of the additive mask: -50 is "never attended" after softmax and quantizes
#: well, where a float's minimum would wreck a uint16 mask encoding.
DEFAULT_MASK_VALUE = -50.0

_OPSET = 21
_IR_VERSION = 10


def build_position_processor(
    inv_freq: Sequence[float] | np.ndarray,
    *,
    context_len: int,
    prompt_len: int,
    attention_scaling: float = 1.0,
    mask_value: float = DEFAULT_MASK_VALUE,
) -> onnx.ModelProto:
    """The position processor for a model whose rotary frequencies are ``inv_freq`` (``D/2``
    floats, the model's ``rotary_emb.inv_freq`` with any RoPE scaling already applied) and
    whose rotary tables are scaled by ``attention_scaling`` (transformers'
    ``rotary_emb.attention_scaling``: 1 but for YaRN and LongRoPE), for a context of
    ``context_len`` slots fed ``prompt_len`` tokens per prompt run.

    ``mask_value`` is the additive mask of a slot not attended (negative)."""
    freqs = _frequencies(inv_freq)
    if prompt_len < 1 or context_len < 2 * prompt_len:
        raise ConfigError(
            f"context_len ({context_len}) must be at least 2 * prompt_len ({prompt_len}): "
            "onnxruntime-genai's windowed cache needs a full window of past slots"
        )
    if not mask_value < 0:
        raise ConfigError(f"mask_value must be negative (the mask is additive), got {mask_value}")

    return _processor(freqs, attention_scaling, mask_value, context_len)


def build_float_position_processor(
    inv_freq: Sequence[float] | np.ndarray,
    *,
    attention_scaling: float = 1.0,
    mask_value: float = DEFAULT_MASK_VALUE,
) -> onnx.ModelProto:
    """The position processor of the float bundle, which onnxruntime-genai runs with its
    default (unwindowed) KV cache: ``attention_mask_before_processor`` is [1, T] (the ``T``
    tokens so far, this run's ``S`` last) and the mask [1, 1, S, T]; otherwise as
    :func:`build_position_processor`."""
    freqs = _frequencies(inv_freq)
    if not mask_value < 0:
        raise ConfigError(f"mask_value must be negative (the mask is additive), got {mask_value}")
    return _processor(freqs, attention_scaling, mask_value, None)


def _frequencies(inv_freq: Sequence[float] | np.ndarray) -> np.ndarray:
    freqs = np.asarray(inv_freq, dtype=np.float32).reshape(-1)
    if freqs.size == 0 or not np.all(np.isfinite(freqs)):
        raise ConfigError(f"inv_freq must be a non-empty finite float array, got {freqs!r}")
    return freqs


def _processor(
    freqs: np.ndarray, attention_scaling: float, mask_value: float, context_len: int | None
) -> onnx.ModelProto:
    """The processor's graph: ``context_len`` key slots, or as many as genai's mask has
    (None)."""
    inits = [
        numpy_helper.from_array(freqs.reshape(1, 1, -1), "inv_freq"),
        numpy_helper.from_array(np.array(attention_scaling, np.float32), "attention_scaling"),
        numpy_helper.from_array(np.array(0, np.int64), "zero_i64"),
        numpy_helper.from_array(np.array(1, np.int64), "one_i64"),
        numpy_helper.from_array(np.array([1], np.int64), "axis_1"),
        numpy_helper.from_array(np.array([0, 1], np.int64), "axes_0_1"),
        numpy_helper.from_array(np.array([2], np.int64), "axis_2"),
        numpy_helper.from_array(np.array(0.0, np.float32), "attended"),
        numpy_helper.from_array(np.array(mask_value, np.float32), "masked"),
    ]
    node = helper.make_node
    if context_len is None:  # genai's default cache: the mask covers every key so far
        slots = [
            node("Shape", [ATTENTION_MASK_IN], ["mask_shape"], start=1, end=2),
            node("Squeeze", ["mask_shape"], ["context_len"]),  # T, a scalar
            node("Range", ["zero_i64", "context_len", "one_i64"], ["key_slots"]),
        ]
        keys: int | str = "keys"
    else:
        inits += [
            numpy_helper.from_array(np.arange(context_len, dtype=np.int64), "key_slots"),
            numpy_helper.from_array(np.array(context_len, np.int64), "context_len"),
        ]
        slots, keys = [], context_len
    nodes = [
        *slots,
        # Rotary tables: angle[0, s, f] = position[s] * inv_freq[f], as transformers' rotary
        # embedding computes it in float32 (one product per entry).
        node("Cast", [POSITION_IDS_IN], ["positions_f"], to=TensorProto.FLOAT),
        node("Unsqueeze", ["positions_f", "axis_2"], ["positions_col"]),  # [1, S, 1]
        node("Mul", ["positions_col", "inv_freq"], ["angles"]),  # [1, S, D/2]
        node("Cos", ["angles"], ["cos_raw"]),
        node("Sin", ["angles"], ["sin_raw"]),
        node("Mul", ["cos_raw", "attention_scaling"], ["cos_scaled"]),
        node("Mul", ["sin_raw", "attention_scaling"], ["sin_scaled"]),
        node("Unsqueeze", ["cos_scaled", "axis_1"], [PROCESSOR_OUTPUTS[1]]),  # [1, 1, S, D/2]
        node("Unsqueeze", ["sin_scaled", "axis_1"], [PROCESSOR_OUTPUTS[2]]),
        # Causal part: query i (0..S-1) sits in slot CL-S+i and may see slots j <= CL-S+i.
        node("Shape", [POSITION_IDS_IN], ["ids_shape"], start=1, end=2),
        node("Squeeze", ["ids_shape"], ["queries"]),  # S, a scalar
        node("Sub", ["context_len", "queries"], ["first_new_slot"]),  # CL - S
        node("Range", ["zero_i64", "queries", "one_i64"], ["query_index"]),  # [S]
        node("Add", ["query_index", "first_new_slot"], ["query_slot"]),
        node("Unsqueeze", ["query_slot", "axis_1"], ["query_slot_col"]),  # [S, 1]
        node("LessOrEqual", ["key_slots", "query_slot_col"], ["causal"]),  # [S, CL]
        # Padding part: a slot genai marks 0 (left padding, never written) is never seen.
        node("Cast", [ATTENTION_MASK_IN], ["valid"], to=TensorProto.BOOL),  # [1, CL]
        node("And", ["causal", "valid"], ["allowed"]),  # [S, CL]
        node("Where", ["allowed", "attended", "masked"], ["mask_2d"]),
        node("Unsqueeze", ["mask_2d", "axes_0_1"], [PROCESSOR_OUTPUTS[0]]),  # [1, 1, S, CL]
    ]
    half = int(freqs.size)
    graph = helper.make_graph(
        nodes,
        "position_processor",
        [
            helper.make_tensor_value_info(ATTENTION_MASK_IN, TensorProto.INT32, [1, keys]),
            helper.make_tensor_value_info(POSITION_IDS_IN, TensorProto.INT32, [1, "sequence"]),
        ],
        [
            helper.make_tensor_value_info(
                PROCESSOR_OUTPUTS[0], TensorProto.FLOAT, [1, 1, "sequence", keys]
            ),
            helper.make_tensor_value_info(
                PROCESSOR_OUTPUTS[1], TensorProto.FLOAT, [1, 1, "sequence", half]
            ),
            helper.make_tensor_value_info(
                PROCESSOR_OUTPUTS[2], TensorProto.FLOAT, [1, 1, "sequence", half]
            ),
        ],
        inits,
    )
    model = helper.make_model(
        graph,
        producer_name="graphbuild",
        opset_imports=[helper.make_opsetid("", _OPSET)],
        ir_version=_IR_VERSION,
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def write_position_processor(
    path: str | Path,
    inv_freq: Sequence[float] | np.ndarray,
    *,
    context_len: int,
    prompt_len: int,
    attention_scaling: float = 1.0,
    mask_value: float = DEFAULT_MASK_VALUE,
) -> Path:
    """Build the position processor (:func:`build_position_processor`) and save it to
    ``path``; returns the path."""
    model = build_position_processor(
        inv_freq,
        context_len=context_len,
        prompt_len=prompt_len,
        attention_scaling=attention_scaling,
        mask_value=mask_value,
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, out)
    return out
