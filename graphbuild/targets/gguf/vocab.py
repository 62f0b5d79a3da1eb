"""The vocabulary: a Hugging Face ``tokenizer.json`` as llama.cpp's ``tokenizer.ggml.*`` keys.

llama.cpp runs a byte-level BPE tokenizer (``tokenizer.ggml.model = "gpt2"``, the kind Llama 3,
Qwen2 and Qwen3 ship) from its token list, token types, merges, pre-tokenizer name and special
token ids. The ``tokenizers`` library reads the file (its vocabulary and added tokens, as the
model's users run it); the merges and the post-processor's template, which the library does
not expose, come from the file's JSON. llama.cpp's name for the pre-tokenizer comes from the
options, from the file's own pre-tokenizer where it is plain GPT-2 byte-level, or from the
architecture's adapter.

Token ids the tokenizer does not use up to the model's vocabulary size become ``[PAD<id>]``
entries of type UNUSED, as llama.cpp's converter writes them.
"""

from __future__ import annotations

import json
from typing import Any

from graphbuild.errors import ExportError

#: llama.cpp's token types (``llama_token_type``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

Entry = tuple[str, str, Any]


def vocab_entries(
    tokenizer_json: bytes | None,
    vocab_size: int,
    pre: str | None,
    default_pre: str,
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> list[Entry]:
    """The ``tokenizer.ggml.*`` entries for ``tokenizer_json`` (the file's bytes), padded to
    the model's ``vocab_size``. No tokenizer: ``tokenizer.ggml.model = "none"`` (llama.cpp
    then runs token ids, not text). ``bos_id``/``eos_id``: the model config's, used where the
    tokenizer's post-processor names none."""
    if tokenizer_json is None:
        return [("tokenizer.ggml.model", "string", "none")]
    doc = _parse(tokenizer_json)
    tokenizer = _load(tokenizer_json)
    model = doc.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = model.get("type", "unknown")
        raise ExportError(
            f"tokenizer.json holds a {kind} tokenizer"
            + (" with byte fallback (SentencePiece-style)" if model.get("byte_fallback") else "")
            + "; the GGUF target writes byte-level BPE tokenizers (llama.cpp's 'gpt2' model, "
            "as Llama 3, Qwen2 and Qwen3 use)"
        )
    tokens, types = _tokens(tokenizer, vocab_size)
    entries: list[Entry] = [
        ("tokenizer.ggml.model", "string", "gpt2"),
        ("tokenizer.ggml.pre", "string", pre or _pre_tokenizer(doc) or default_pre),
        ("tokenizer.ggml.tokens", "array[string]", tokens),
        ("tokenizer.ggml.token_type", "array[int32]", types),
        ("tokenizer.ggml.merges", "array[string]", _merges(model)),
    ]
    first, last = _template_specials(doc)
    bos = first if first is not None else bos_id
    eos = last if last is not None else eos_id
    for key, value in (("bos", bos), ("eos", eos)):
        if value is not None:
            if not 0 <= value < vocab_size:
                raise ExportError(
                    f"the {key} token id {value} is outside the model's vocabulary ({vocab_size})"
                )
            entries.append((f"tokenizer.ggml.{key}_token_id", "uint32", int(value)))
    entries += [
        ("tokenizer.ggml.add_bos_token", "bool", first is not None),
        ("tokenizer.ggml.add_eos_token", "bool", last is not None),
    ]
    return entries


def _parse(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ExportError(f"the tokenizer is not a tokenizer.json file: {err}") from None
    if not isinstance(doc, dict):
        raise ExportError("the tokenizer is not a tokenizer.json file (not a JSON object)")
    return doc


def _load(data: bytes) -> Any:
    """The tokenizer as the ``tokenizers`` library reads it (what the model's users run)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise ExportError(
            f"reading a tokenizer needs the tokenizers library ({err}): pip install "
            "'graphbuild[gguf]'"
        ) from None
    try:
        return Tokenizer.from_str(data.decode())
    except Exception as err:  # the library raises its own Exception for a bad file
        raise ExportError(f"the tokenizers library cannot read the tokenizer: {err}") from None


def _tokens(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id's token and llama.cpp token type, up to ``vocab_size``."""
    by_id = {int(i): t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    over = sorted(i for i in by_id if not 0 <= i < vocab_size)
    if over:
        raise ExportError(
            f"the tokenizer has token ids up to {over[-1]}, outside the model's vocabulary of "
            f"{vocab_size} (config.vocab_size): this tokenizer does not belong to this model"
        )
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [NORMAL if i in by_id else UNUSED for i in range(vocab_size)]
    for i, added in tokenizer.get_added_tokens_decoder().items():
        types[int(i)] = CONTROL if added.special else USER_DEFINED
    return tokens, types


def _merges(model: dict[str, Any]) -> list[str]:
    out = []
    for merge in model.get("merges") or []:
        pair = merge.split(" ", 1) if isinstance(merge, str) else list(merge)
        if len(pair) != 2 or any(" " in part for part in pair):
            raise ExportError(
                f"BPE merge {merge!r} cannot be written for llama.cpp (its merges are 'a b' "
                "strings: neither side may hold a space)"
            )
        out.append(f"{pair[0]} {pair[1]}")
    return out


def _pre_tokenizer(doc: dict[str, Any]) -> str | None:
    """llama.cpp's name for the file's pre-tokenizer where it is unambiguous: GPT-2's
    byte-level split (``ByteLevel`` with its regex)."""
    pre = doc.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    return None


def _template_specials(doc: dict[str, Any]) -> tuple[int | None, int | None]:
    """The ids of the special tokens the post-processor puts before and after a single
    sequence (BOS, EOS), or None."""
    post = doc.get("post_processor") or {}
    processors = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for proc in processors:
        single = proc.get("single") or [] if proc.get("type") == "TemplateProcessing" else []
        if single:
            specials = proc.get("special_tokens") or {}
            return _special_id(single[0], specials), _special_id(single[-1], specials)
    return None, None


def _special_id(item: dict[str, Any], specials: dict[str, Any]) -> int | None:
    name = (item.get("SpecialToken") or {}).get("id")
    ids = (specials.get(name) or {}).get("ids") if name is not None else None
    return int(ids[0]) if ids else None
