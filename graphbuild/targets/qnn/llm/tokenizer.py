"""The model's tokenizer in every bundle folder, when the model carries one.

The contract: the exported model (what the factory returns) has an attribute ``tokenizer``,
a ``tokenizers.Tokenizer`` or a transformers fast tokenizer (one with ``backend_tokenizer``).
Every bundle folder then holds ``tokenizer.json`` (the tokenizer, as ``tokenizers`` saves it)
and ``tokenizer_config.json`` (a transformers tokenizer's own; ``{"tokenizer_class":
"PreTrainedTokenizerFast"}`` for a plain one), which is what onnxruntime-genai's ``Tokenizer``
and Genie load. The tokenizer is part of the model's structure fingerprint by the files it
places (registered below; a transformers tokenizer's class once a model holds one, so that
importing this module does not import transformers), so changing it (its chat template, its
special tokens) re-places the files and nothing else.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from graphbuild.engine.codecs import FileArtifact
from graphbuild.engine.fingerprint import fingerprint_type
from graphbuild.errors import ConfigError

__all__ = ["TOKENIZER", "TOKENIZER_CONFIG", "decode", "encode", "model_tokenizer"]

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
_PLAIN_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast"}

try:  # the tokenizer's content is what a stage reading the model's structure keys on
    from tokenizers import Tokenizer as _Tokenizer

    @fingerprint_type.register(_Tokenizer)
    def _(value: Any, walk: Any) -> Any:
        return {"tokenizers.Tokenizer": value.to_str()}

except ImportError:  # pragma: no cover - tokenizers comes with transformers
    pass


def model_tokenizer(model: Any) -> Any | None:
    """The model's ``tokenizer`` attribute, or None; a ConfigError for one of another kind."""
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return None
    if not (hasattr(tok, "to_str") or hasattr(tok, "backend_tokenizer")):
        raise ConfigError(
            f"the model's tokenizer is a {type(tok).__name__}: the llm format places a "
            "tokenizers.Tokenizer or a transformers fast tokenizer (with backend_tokenizer)"
        )
    if hasattr(tok, "backend_tokenizer") and fingerprint_type.dispatch(type(tok)) is not _placed:
        fingerprint_type.register(type(tok), _placed)
    return tok


def _placed(value: Any, walk: Any) -> Any:
    """A transformers fast tokenizer as the files it places: keyed on what the bundle gets,
    not on the object's attributes (which hold state of its own, such as warnings given)."""
    text, config = _files(value)
    return {"tokenizer files": [text, _config_text(config)]}


def _config_text(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def _files(tok: Any) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json content) of ``tok``."""
    if hasattr(tok, "backend_tokenizer"):
        with tempfile.TemporaryDirectory(prefix="graphbuild-tokenizer-") as tmp:
            tok.save_pretrained(tmp)
            config = json.loads((Path(tmp) / TOKENIZER_CONFIG).read_text())
        template = getattr(tok, "chat_template", None)  # transformers 5 saves it on its own
        if isinstance(template, dict):
            template = [{"name": k, "template": v} for k, v in sorted(template.items())]
        if template and "chat_template" not in config:  # where genai and Genie read it
            config["chat_template"] = template
        return tok.backend_tokenizer.to_str(), config
    return tok.to_str(), dict(_PLAIN_CONFIG)


def tokenizer_files(folders: Iterable[str], model: Any, samples: Any, context: Any) -> dict:
    """``<folder>/tokenizer.json`` and ``<folder>/tokenizer_config.json`` for each folder."""
    text, config = _files(model_tokenizer(model))
    config_text = _config_text(config)
    out = {}
    for folder in folders:
        out[f"{folder}/{TOKENIZER}"] = FileArtifact(f"{folder}/{TOKENIZER}", text.encode())
        out[f"{folder}/{TOKENIZER_CONFIG}"] = FileArtifact(
            f"{folder}/{TOKENIZER_CONFIG}", config_text.encode()
        )
    return out


def _load(bundle: str | Path) -> Any:
    from tokenizers import Tokenizer

    path = Path(bundle) / TOKENIZER
    if not path.is_file():
        raise ConfigError(
            f"{Path(bundle)} holds no {TOKENIZER}: give the prompt as token ids, or export a "
            "model that carries its tokenizer (docs/qnn-llm.md)"
        )
    return Tokenizer.from_file(str(path))


def encode(bundle: str | Path, text: str) -> list[int]:
    """``text`` as token ids by the bundle's tokenizer (no special tokens added)."""
    ids = _load(bundle).encode(text, add_special_tokens=False).ids
    if not ids:
        raise ConfigError(f"the bundle's tokenizer makes no token of {text!r}")
    return list(ids)


def decode(bundle: str | Path, ids: list[int]) -> str:
    """``ids`` as text by the bundle's tokenizer."""
    return _load(bundle).decode(ids)
