"""The GGUF target: a ``.gguf`` file for llama.cpp (``llama_cpp``), built from a transformers
Llama, Qwen2 or Qwen3 model (or any architecture a registered adapter describes).

Importing this package declares the target and nothing more: the pipeline (torch, the front
end) is imported when a pipeline is built. Checking a file in llama.cpp needs the optional
``llama-cpp`` extra (``llama-cpp-python``); reading one back, the ``gguf`` extra.
"""

from __future__ import annotations

from typing import Any

from graphbuild.targets.base import Target, lazy_builder
from graphbuild.targets.gguf.options import CONFIG_SCHEMA, FORMATS, PRESETS, GgufOptions

build_gguf_pipeline = lazy_builder("graphbuild.targets.gguf.pipeline", "build_gguf_pipeline")

TARGET = Target(
    name="gguf",
    description="GGUF for llama.cpp: Q8_0/Q4_0 weights with the model's own or preset scales",
    formats=FORMATS,
    options_type=GgufOptions,
    build_pipeline=build_gguf_pipeline,
    config_schema=CONFIG_SCHEMA,
    presets=PRESETS,
    numerics_option="check_numerics",
)


def __getattr__(name: str) -> Any:
    # the adapters module registers its registry with the fingerprint engine (torch): not
    # imported to declare the target
    if name in ("ArchAdapter", "register_adapter", "unregister_adapter", "LLAMA", "QWEN2", "QWEN3"):
        from graphbuild.targets.gguf import adapters

        return getattr(adapters, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMATS",
    "LLAMA",
    "PRESETS",
    "QWEN2",
    "QWEN3",
    "TARGET",
    "ArchAdapter",
    "GgufOptions",
    "register_adapter",
    "unregister_adapter",
    "build_gguf_pipeline",
]
