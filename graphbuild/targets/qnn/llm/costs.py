"""What the LLM export's stages hold while they run, for a build with ``jobs`` > 1.

A part graph's stages each declare the bytes of the part's own weights as they are held in
memory (what they read and what they make of them: the captured program, the bound graph),
so a memory budget admits as many parts at once as fit. The stages that trace run alone:
``capture`` traces the part module with ``torch.export``, which swaps fake tensors into that
module (and the layers it shares with the causal LM) while it runs, so no other stage may read
the model meanwhile; ``quantize`` and ``place_quantizers`` trace again, and ``to_onnx``'s
decompositions register Python kernels process-wide (two at once fail: "Trying to override a
python impl ... on operator aten::fft_ifft2"). A part's HTP context preparation, the HTP
check and the generation check declare what they were measured to hold (below).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graphbuild.engine.pipeline import Pipeline

#: The part graph's stages that trace (sub-pipeline names): torch.export and torch.onnx are
#: not safe to run in two threads at once.
TRACING = frozenset({"capture", "quantize", "place_quantizers", "to_onnx"})


def part_bytes(module: Any) -> int:
    """Bytes of ``module``'s parameters and buffers as they are held now."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def declare_part_costs(p: Pipeline, names: Mapping[str, str], weight_bytes: int) -> None:
    """Declare the costs of one part graph's stages (``names``: sub-pipeline name -> name)."""
    for sub_name, name in names.items():
        p.declare_cost(name, memory=weight_bytes, exclusive=sub_name in TRACING)


#: What preparing a part's HTP context holds, in its child process, per byte of the part's fp32
#: weights, and beside them (Python, onnxruntime and QNN's libraries): measured on bench_llm's
#: Qwen2.5-0.5B-shaped parts, w8a16, context 256, peaks of 2786 MiB for the embedding's part
#: (519 MiB of weights), 2800 MiB for the LM head's with two layers (633 MiB) and 909 MiB for
#: three layers (171 MiB).
CONTEXT_BYTES_PER_WEIGHT_BYTE = 4.5
CONTEXT_FIXED_BYTES = 512 * 2**20


def context_bytes(weight_bytes: int) -> int:
    """Bytes preparing the context of a part whose fp32 weights are ``weight_bytes`` holds."""
    return int(CONTEXT_BYTES_PER_WEIGHT_BYTE * weight_bytes) + CONTEXT_FIXED_BYTES


def declare_context_cost(p: Pipeline, name: str, weight_bytes: int) -> None:
    """Declare what preparing one part's HTP context holds (:func:`context_bytes`) and its one
    core: QNN's offline preparer, in a child process, computes on one thread; it reads the
    part's bound graphs, never the model, so it runs beside a part's tracing (``apart``)."""
    p.declare_cost(name, memory=context_bytes(weight_bytes), apart=True)


#: What the llm HTP check (``check_htp_<label>``) holds in this process, per byte of the fp32
#: weights of every part, and beside them: it runs every part's prompt and token graphs on
#: onnxruntime's CPU, then compiles each graph on its own on QNN's HTP simulator (no weight
#: sharing there) and generates on both, with the model itself as the float reference.
#: Measured (the stage's resident-memory growth, Llama-shaped, 2 layers, 3 parts, w8a16,
#: context 64): 246 MB for 16 MB of weights, 473 MB for 65 MB, 741 MB for 171 MB, the first
#: loading QNN's libraries into the process.
HTP_CHECK_BYTES_PER_WEIGHT_BYTE = 4.5
HTP_CHECK_FIXED_BYTES = 256 * 2**20


def htp_check_bytes(weight_bytes: int) -> int:
    """Bytes the llm HTP check of a model whose parts' fp32 weights are ``weight_bytes`` in all
    holds."""
    return int(HTP_CHECK_BYTES_PER_WEIGHT_BYTE * weight_bytes) + HTP_CHECK_FIXED_BYTES


def declare_htp_check_cost(p: Pipeline, name: str, weight_bytes: int) -> None:
    """Declare what the llm HTP check holds (:func:`htp_check_bytes`). Its work is in this
    process (onnxruntime and QNN's HTP backend load here, and it runs the model for its
    reference), so it is not ``apart``: it runs beside no stage that must run alone."""
    p.declare_cost(name, memory=htp_check_bytes(weight_bytes))


#: What the generation check (``check_generation``) holds, per byte of the fp32 weights of every
#: part, and beside them: onnxruntime-genai runs the CPU bundle in a child process (a w8a16
#: bundle's grows faster with the weights than a float one's), and the model generates here as
#: the reference. Measured (the process tree's growth, Llama-shaped, 2 parts, context 64): float
#: bundles 984, 1095 and 1446 MiB for 99, 336 and 634 MiB of weights; w8a16 1015, 1628 and
#: 2465 MiB.
GENERATION_CHECK_BYTES_PER_WEIGHT_BYTE = 3.0
GENERATION_CHECK_FIXED_BYTES = 768 * 2**20


def generation_check_bytes(weight_bytes: int) -> int:
    """Bytes the generation check of a model whose parts' fp32 weights are ``weight_bytes`` in
    all holds, its onnxruntime-genai process included."""
    return int(GENERATION_CHECK_BYTES_PER_WEIGHT_BYTE * weight_bytes) + GENERATION_CHECK_FIXED_BYTES


def declare_generation_check_cost(p: Pipeline, name: str, weight_bytes: int) -> None:
    """Declare what the generation check holds (:func:`generation_check_bytes`). It runs the
    model in this process, so it is not ``apart``."""
    p.declare_cost(name, memory=generation_check_bytes(weight_bytes))
