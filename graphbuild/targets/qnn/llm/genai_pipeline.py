"""The typed description of an onnxruntime-genai ``decoder-pipeline``: what the runtime must
know of the model (:class:`LlmFacts`), the pipeline's entries (:class:`PipelineEntry`) and
where each runs (:class:`Session`), and the names genai feeds and reads (:class:`GenaiNames`).
:mod:`.genai_config` builds the entries of a bundle's files and writes the config from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphbuild.errors import ConfigError
from graphbuild.targets.qnn.arch.targets import HtpTarget

__all__ = ["GenaiNames", "LlmFacts", "PipelineEntry", "Session"]


@dataclass(frozen=True)
class LlmFacts:
    """What the runtime must know of the model: token ids, sizes, and the context
    (``context_len`` slots) and prompt window (``prompt_len`` tokens per prompt run)."""

    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    context_len: int
    prompt_len: int
    bos_token_id: int
    eos_token_id: int | tuple[int, ...]
    pad_token_id: int

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_hidden_layers",
            "context_len",
            "prompt_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"LlmFacts.{name} must be a positive int, got {value!r}")
        if self.prompt_len < 2:
            raise ConfigError(
                f"LlmFacts.prompt_len must be at least 2 (onnxruntime-genai's windowed cache), "
                f"got {self.prompt_len}"
            )
        if self.context_len < 2 * self.prompt_len:
            raise ConfigError(
                f"LlmFacts.context_len ({self.context_len}) must be at least 2 * prompt_len "
                f"({self.prompt_len}): onnxruntime-genai's windowed cache refuses less"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        eos = self.eos_tokens
        if not eos:
            raise ConfigError("LlmFacts.eos_token_id names no token")
        for token in (self.bos_token_id, self.pad_token_id, *eos):
            if not 0 <= token < self.vocab_size:
                raise ConfigError(
                    f"token id {token} is outside the vocabulary [0, {self.vocab_size})"
                )

    @property
    def eos_tokens(self) -> tuple[int, ...]:
        """The end-of-sequence ids as a tuple."""
        eos = self.eos_token_id
        return (eos,) if isinstance(eos, int) else tuple(eos)


@dataclass(frozen=True)
class Session:
    """Where a pipeline entry runs: onnxruntime's CPU (``provider="cpu"``) or the QNN
    execution provider (``provider="qnn"``) with its provider options (``backend_path`` and
    the HTP options, strings as onnxruntime takes them)."""

    provider: str = "cpu"
    options: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.provider not in ("cpu", "qnn"):
            raise ConfigError(f"Session.provider must be 'cpu' or 'qnn', got {self.provider!r}")
        if self.provider == "cpu" and self.options:
            raise ConfigError(
                "onnxruntime-genai refuses provider options for the CPU: "
                f"drop {sorted(self.options)}"
            )
        if self.provider == "qnn" and "backend_path" not in self.options:
            raise ConfigError(
                "a QNN session needs backend_path (QnnHtp's library: QnnHtp.dll on Windows, "
                "libQnnHtp.so on Linux; onnxruntime_qnn.get_qnn_htp_path() where installed)"
            )
        for key, value in self.options.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ConfigError(f"provider options are strings: {key!r}: {value!r}")

    @classmethod
    def cpu(cls) -> Session:
        return cls("cpu")

    @classmethod
    def qnn(cls, backend_path: str, **options: str) -> Session:
        """The QNN execution provider on ``backend_path`` with ``options`` (``htp_arch``,
        ``soc_model``, ``htp_performance_mode``, ``enable_htp_shared_memory_allocator``...)."""
        return cls("qnn", {"backend_path": backend_path, **options})

    @classmethod
    def qnn_htp(cls, target: HtpTarget, **options: str) -> Session:
        """The QNN execution provider on HTP ``target`` with the installed onnxruntime-qnn's
        HTP backend (graphbuild's HTP runtime locates it: run here, on the simulator or a
        Snapdragon device); ``options`` add to or override its provider options. A bundle
        for a device with its own QNN libraries takes :meth:`qnn` with their name
        (``QnnHtp.dll`` on Windows on ARM)."""
        from graphbuild.targets.qnn.htp_runtime.backend import ep_options_for

        return cls("qnn", {**ep_options_for(target), **options})

    def to_json(self) -> dict[str, Any]:
        providers = [] if self.provider == "cpu" else [{"qnn": dict(self.options)}]
        return {"log_id": "onnxruntime-genai", "provider_options": providers}


@dataclass(frozen=True)
class PipelineEntry:
    """One ONNX model of the pipeline: its file (relative to the bundle directory), the
    input and output names genai wires by name, and when it runs."""

    name: str
    filename: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    run_on_prompt: bool = True
    run_on_token_gen: bool = True
    session: Session = field(default_factory=Session)

    def __post_init__(self) -> None:
        if not self.name or not self.filename:
            raise ConfigError(f"a pipeline entry needs a name and a filename: {self!r}")
        if Path(self.filename).is_absolute() or ".." in Path(self.filename).parts:
            raise ConfigError(
                f"pipeline entry {self.name!r}: filename {self.filename!r} must be relative "
                "to the bundle directory"
            )
        if not (self.run_on_prompt or self.run_on_token_gen):
            raise ConfigError(f"pipeline entry {self.name!r} runs neither on prompt nor token")
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))

    def to_json(self) -> dict[str, Any]:
        return {
            "filename": self.filename,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "session_options": self.session.to_json(),
            "run_on_prompt": self.run_on_prompt,
            "run_on_token_gen": self.run_on_token_gen,
        }


@dataclass(frozen=True)
class GenaiNames:
    """The names genai feeds and reads. ``attention_mask`` and ``position_ids`` are the
    position processor's inputs; ``past_key``... hold ``%d`` for the 0-based layer."""

    input_ids: str = "input_ids"
    attention_mask: str = "attention_mask_before_processor"
    position_ids: str = "position_ids"
    past_key: str = "past_key_%d_in"
    past_value: str = "past_value_%d_in"
    logits: str = "logits"
    present_key: str = "past_key_%d_out"
    present_value: str = "past_value_%d_out"
