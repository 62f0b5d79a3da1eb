"""The GGUF target's options, formats and presets, and the keys a config file may set."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from graphbuild.errors import ConfigError
from graphbuild.targets.base import BOOL, INT, STR, OptionType

FORMATS = ("llama_cpp",)

#: graphbuild's own GGUF presets: every 2-D weight quantized as llama.cpp's quantizer does.
PRESETS: tuple[str, ...] = ("q8_0", "q4_0")
FLOAT_TYPES = ("f16", "f32")

_METADATA_VALUE = (str, int, float, bool)


@dataclass
class GgufOptions:
    """Options of the GGUF export; each becomes one context key that stages declare.

    ``tokenizer``: the model's ``tokenizer.json`` (a path or its directory, a
    ``tokenizers.Tokenizer`` or a transformers fast tokenizer), whose
    vocabulary the file carries; without one the file has none (llama.cpp then runs token ids
    only). ``quantizer``: ``None`` keeps the model's own quantizers (fake-quant, PT2E,
    FastForward, AIMET; per tensor, per channel or blocks of a multiple of 32) with their
    scales; ``"q8_0"`` or ``"q4_0"`` quantizes every 2-D weight as llama.cpp does.
    ``float_type``: 2-D weights left unquantized (``f16``, as llama.cpp's converter, or
    ``f32``); 1-D tensors are always F32. ``architecture``: an adapter (or its name) in
    place of the one registered for the config's ``model_type``. ``tokenizer_pre``:
    llama.cpp's pre-tokenizer name when the tokenizer does not tell (the adapter's default
    otherwise). ``metadata``: extra ``general.*`` entries (strings, integers, floats,
    booleans). ``check_numerics``: run the file in llama.cpp (``llama-cpp-python``) on the
    sample token ids and compare its logits with the torch model run on the file's weights.
    """

    tokenizer: Any = None
    quantizer: str | None = None
    float_type: str = "f16"
    architecture: Any = None
    tokenizer_pre: str | None = None
    metadata: Mapping[str, Any] | None = None
    alignment: int = 32
    check_numerics: bool = False

    def __post_init__(self) -> None:
        if self.quantizer is not None and self.quantizer not in PRESETS:
            raise ConfigError(
                f"quantizer {self.quantizer!r} is not a GGUF preset; known: "
                f"{', '.join(PRESETS)} (or none, to keep the model's own quantizers)"
            )
        if self.float_type not in FLOAT_TYPES:
            raise ConfigError(
                f"float_type must be one of {', '.join(FLOAT_TYPES)}, not {self.float_type!r}"
            )
        if (
            not isinstance(self.alignment, int)
            or self.alignment < 8
            or self.alignment & (self.alignment - 1)
        ):
            raise ConfigError(f"alignment must be a power of two >= 8, not {self.alignment!r}")
        for key, value in (self.metadata or {}).items():
            if not isinstance(key, str) or not key.startswith("general.") or len(key) <= 8:
                raise ConfigError(f"metadata key {key!r} must be a 'general.<name>' key")
            if not isinstance(value, _METADATA_VALUE):
                raise ConfigError(
                    f"metadata '{key}' must be a string, integer, float or boolean, "
                    f"not {type(value).__name__}"
                )
        self._tokenizer_json = tokenizer_json(self.tokenizer)

    def to_context(self) -> dict[str, Any]:
        ctx = {f.name: getattr(self, f.name) for f in fields(self)}
        ctx["tokenizer"] = self._tokenizer_json  # the file's bytes: its content is the key
        ctx["metadata"] = dict(sorted((self.metadata or {}).items()))
        return ctx


def tokenizer_json(tokenizer: Any) -> bytes | None:
    """The bytes of a ``tokenizer.json``: from a path (a directory holding one), a
    ``tokenizers.Tokenizer``, or a transformers fast tokenizer's backend."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, (bytes, bytearray)):
        return bytes(tokenizer)
    if isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            return path.read_bytes()
        except OSError as err:
            raise ConfigError(
                f"tokenizer {str(tokenizer)!r}: cannot read {path} ({err.strerror or err}); "
                "name the model's tokenizer.json"
            ) from None
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # a transformers fast one
    to_str = getattr(backend, "to_str", None)
    if callable(to_str):  # a tokenizers.Tokenizer
        return str(to_str()).encode()
    raise ConfigError(
        "tokenizer must be a tokenizer.json path (or its directory), a tokenizers.Tokenizer "
        f"or a transformers fast tokenizer, not {type(tokenizer).__name__}"
    )


#: A config file's ``[options] metadata`` table: ``general.*`` keys and plain values.
METADATA = OptionType(
    "a table of general.* keys with string, number or boolean values",
    lambda v: isinstance(v, dict) and all(isinstance(x, _METADATA_VALUE) for x in v.values()),
)

#: What a config file's ``[options]`` table may set for the gguf target.
CONFIG_SCHEMA: dict[str, OptionType] = {
    "tokenizer": STR,
    "float_type": STR,
    "architecture": STR,
    "tokenizer_pre": STR,
    "metadata": METADATA,
    "alignment": INT,
    "check_numerics": BOOL,
}
