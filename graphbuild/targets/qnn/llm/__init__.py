"""The ``llm`` format of the qnn target: a causal LM as the HTP runs it in deployment.

Prompt (AR-N) and token (AR-1) graphs with a quantized KV cache at their boundary, split
between decoder layers into parts (the embedding alone, the LM head in the last), each part
graph a cached build of its own (:mod:`.pipeline`).
"""

from __future__ import annotations

from graphbuild.targets.qnn.llm.adapters import LlmAdapter, find_causal_lm, register_adapter

__all__ = ["LlmAdapter", "find_causal_lm", "register_adapter"]
