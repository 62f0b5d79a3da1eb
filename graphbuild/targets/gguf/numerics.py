"""The numerics check of the GGUF target: llama.cpp's logits against torch's.

The reference is the torch model run on the weights the file holds, dequantized as llama.cpp
dequantizes them (``d * q``; F16 and F32 as stored), with the RoPE row permutation undone,
each tensor under each of its names (a tied embedding and output projection the file holds
apart get their own values). A model with its own weight quantizers runs them on those
weights, which maps them back onto their grid: the model's own codes and float32 scales. So
the comparison measures what llama.cpp computes differently from torch (its matrix products
quantize activations to Q8_0 blocks for quantized weights; its float16 KV cache is set to
float32 here), not what quantizing the weights costs. Activation quantizers of the model
(which a GGUF file does not hold: llama.cpp runs activations in float) count as a
difference.

llama.cpp is ``llama-cpp-python`` (the optional ``llama-cpp`` extra): it loads the file from
disk and evaluates the sample token ids of each batch row, every position's logits kept.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphbuild.errors import ExportError
from graphbuild.frontend.capture import as_args
from graphbuild.frontend.reference import output_errors, outputs_dict
from graphbuild.targets.gguf import blocks
from graphbuild.targets.gguf.artifacts import GgufFile, PackedTensors
from graphbuild.targets.gguf.tensors import rope_order

#: llama.cpp's GGML_TYPE_F32, for its KV cache.
_F32 = 0


def file_state(planned: Mapping[str, Any], packed: PackedTensors) -> dict[str, torch.Tensor]:
    """Each planned parameter's value as llama.cpp reads it from the file (float32, in the
    model's own row order), by its name in the model."""
    by_name = packed.by_name()
    fallback = planned.get("output_fallback")
    out = {}
    for entry in planned["tensors"]:
        tensor = by_name.get(entry["name"])
        if tensor is None and fallback is not None and entry["name"] == fallback[0]:
            tensor = by_name.get(fallback[1])
        if tensor is None:
            raise ExportError(f"the file has no tensor '{entry['name']}'")
        values = blocks.unpack(tensor.type, tensor.data, tensor.shape)
        heads = entry["rope_heads"]
        if heads is not None:
            values = values[np.argsort(rope_order(values.shape[0], heads))]
        value = torch.from_numpy(np.ascontiguousarray(values))
        for name in entry["aliases"]:
            out.setdefault(name, value)  # a name the file holds itself comes first
        out[entry["source"]] = value
    return out


def reference_logits(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], args: tuple
) -> torch.Tensor:
    """The logits (first output) of the model on ``args`` with ``state`` in place of those
    parameters (tied ones each under its own name)."""
    own = dict(model.named_parameters(remove_duplicate=False))
    values = {k: v.to(own[k].dtype) for k, v in state.items()}
    with torch.no_grad():
        out = torch.func.functional_call(model, values, args, tie_weights=False)
    (first, *_) = outputs_dict(out).values()
    return first


def llama_cpp_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits ``[len(tokens), vocab]`` for ``tokens`` (one sequence)."""
    try:
        from llama_cpp import Llama
    except ImportError as err:
        raise ExportError(
            f"check_numerics needs llama.cpp's Python binding (llama-cpp-python): {err}; "
            "install it with pip install 'graphbuild[llama-cpp]'"
        ) from None
    n = len(tokens)
    llm = Llama(
        model_path=str(path),
        n_ctx=max(n, 16),
        n_batch=max(n, 16),
        n_ubatch=max(n, 16),
        logits_all=True,
        verbose=False,
        n_threads=max(1, min(4, os.cpu_count() or 1)),
        type_k=_F32,
        type_v=_F32,
        flash_attn=False,
    )
    try:
        llm.eval(tokens)
        return np.array(llm.scores[:n], dtype=np.float32)
    finally:
        llm.close()


def compare_with_llama_cpp(
    gguf: GgufFile,
    planned: Mapping[str, Any],
    packed: PackedTensors,
    model: torch.nn.Module,
    samples: Any,
) -> dict[str, Any]:
    """Max abs error, SQNR and top-1 agreement of llama.cpp's logits against the reference,
    per sample row; ``relative_error`` is the max abs error over the reference's largest
    magnitude."""
    args = as_args(samples)
    ids = args[0] if args else None
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise ExportError(
            "check_numerics runs the sample inputs in llama.cpp: the first one must be a tensor "
            f"of token ids, not {type(ids).__name__}"
        )
    rows = ids.reshape(-1, ids.shape[-1])
    reference = reference_logits(model, file_state(planned, packed), args)
    reference = reference.reshape(rows.shape[0], rows.shape[1], -1).numpy()
    outputs = []
    with tempfile.TemporaryDirectory(prefix="graphbuild-gguf-") as tmp:
        path = Path(tmp) / gguf.name
        path.write_bytes(gguf.tobytes())
        for i, row in enumerate(rows.tolist()):
            actual = llama_cpp_logits(path, row)
            ref = reference[i]
            errors = output_errors(ref, actual)
            scale = float(np.abs(ref).max()) or 1.0
            outputs.append(
                {
                    "name": f"logits[{i}]" if rows.shape[0] > 1 else "logits",
                    **errors,
                    "relative_error": errors["max_abs_error"] / scale,
                    "top1_agreement": float(np.mean(ref.argmax(-1) == actual.argmax(-1))),
                }
            )
    return {"reference": "torch model on the file's weights", "outputs": outputs}
