"""What goes wrong running a ``qnn/llm`` bundle with onnxruntime-genai."""

from __future__ import annotations

from graphbuild.errors import ConfigError, ExportError

__all__ = [
    "ContextLengthError",
    "GenaiCrashedError",
    "GenaiError",
    "GenaiRefusedError",
    "GenaiRunError",
    "GenaiUnavailableError",
    "IncompleteBundleError",
]


class ContextLengthError(ConfigError):
    """A prompt and the tokens to generate that do not fit the bundle's length (its
    ``max_length``, at most the export's ``context_len``): past it, positions overrun the
    rotary table. Raised before anything runs, by genai's path and graphbuild's runner alike."""


class GenaiError(ExportError):
    """onnxruntime-genai could not run a bundle."""


class GenaiUnavailableError(GenaiError):
    """onnxruntime-genai does not import here (pip install onnxruntime-genai)."""


class IncompleteBundleError(GenaiError, ConfigError):
    """A bundle directory without its genai_config.json, or without a file it names."""


class GenaiRefusedError(GenaiError):
    """onnxruntime-genai refused the bundle's config or models when loading them;
    ``genai_message`` is its own message."""

    def __init__(self, message: str, genai_message: str):
        self.genai_message = genai_message
        super().__init__(message)


class GenaiRunError(GenaiError):
    """onnxruntime-genai loaded the bundle but failed while generating; ``genai_message`` is
    its own message."""

    def __init__(self, message: str, genai_message: str):
        self.genai_message = genai_message
        super().__init__(message)


class GenaiCrashedError(GenaiError):
    """The process running onnxruntime-genai died (a native crash, a signal) or hung."""
