"""The text of an encodings document (:func:`dumps_encodings`): one entry per line, the lists of
scales :func:`~.write.build_encodings` made written from their arrays, and each text
remembered by its values for the next document.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from graphbuild.hashing import digest_bytes, digest_json

__all__ = ["dumps_encodings"]


class _FloatList(list):
    """A list of floats (what ``json`` reads and compares) that keeps the float64 array it
    came from, so :func:`dumps_encodings` writes it without formatting one float at a time
    from Python (:func:`_float_text`)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = np.ascontiguousarray(array, dtype=np.float64).reshape(-1)
        super().__init__(self.array.tolist())


class _ChannelList(list):
    """0.6.1's per-channel entries (dicts, as the document holds them) and the arrays they
    were made from, for :func:`dumps_encodings`."""

    __slots__ = ("bits", "symmetric", "columns")

    def __init__(self, bits: int, symmetric: str, columns: dict[str, np.ndarray]):
        self.bits, self.symmetric, self.columns = bits, symmetric, columns
        lists = {k: v.tolist() for k, v in columns.items()}
        super().__init__(
            {
                "bitwidth": bits,
                "dtype": "int",
                "is_symmetric": symmetric,
                "min": mn,
                "max": mx,
                "offset": o,
                "scale": sc,
            }
            for mn, mx, o, sc in zip(
                lists["min"], lists["max"], lists["offset"], lists["scale"], strict=True
            )
        )


def dumps_encodings(doc: Mapping[str, Any]) -> str:
    """The encodings document as text: one entry per line, so the file stays readable and
    diffable while large models are written by the C JSON encoder (``indent`` would switch
    to the slow pure-Python one). The lists of scales (and 0.6.1's per-channel entries) that
    :func:`~.write.build_encodings` made are written from their arrays (:func:`_float_text`),
    and the text of each is remembered by its values for the next document."""
    compact = json.JSONEncoder(separators=(", ", ": ")).encode
    used: dict[tuple, str] = {}

    def render(value: Any) -> str:
        if isinstance(value, _FloatList):
            return _remembered(("floats", value.array), lambda: _float_text(value), used)
        if type(value) is dict and any(isinstance(v, _FloatList) for v in value.values()):
            return "{" + ", ".join(f"{compact(k)}: {render(v)}" for k, v in value.items()) + "}"
        return compact(value)

    def block(value: Any, depth: int) -> str:
        pad, inner = "  " * depth, "  " * (depth + 1)
        if (
            isinstance(value, dict)
            and depth == 0
            or (
                isinstance(value, dict)
                and value
                and all(isinstance(v, list) for v in value.values())
            )
        ):
            items = [f"{inner}{compact(k)}: {block(v, depth + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}" if items else "{}"
        if isinstance(value, _ChannelList) and value:
            key = ("channels", depth, value.bits, value.symmetric, *value.columns.values())
            lines = _remembered(key, lambda: _channel_lines(value, inner, compact), used)
            return "[\n" + lines + f"\n{pad}]"
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            return "[\n" + ",\n".join(inner + render(v) for v in value) + f"\n{pad}]"
        return render(value)

    text = block(dict(doc), 0) + "\n"
    _TEXTS.keep(used)
    return text


def _float_text(values: _FloatList) -> str:
    """``json.dumps(values)``, bytes for bytes: finite floats are written with
    ``float.__repr__`` (what the JSON encoder calls) over the list in C, not element by
    element in Python."""
    if not np.isfinite(values.array).all():
        return json.dumps(list(values))  # Infinity / NaN as json spells them
    return "[" + ", ".join(map(float.__repr__, values)) + "]"


def _channel_lines(value: _ChannelList, inner: str, compact: Callable[[Any], str]) -> str:
    """0.6.1's per-channel entries, one line each, as ``compact`` writes each dict."""
    c = value.columns
    if not all(np.isfinite(c[k]).all() for k in ("min", "max", "scale")):
        return ",\n".join(inner + compact(v) for v in value)
    head = (
        f'{inner}{{"bitwidth": {value.bits}, "dtype": "int", '
        f'"is_symmetric": {compact(value.symmetric)}, "min": '
    )
    mins, maxs = map(float.__repr__, c["min"].tolist()), map(float.__repr__, c["max"].tolist())
    scales = map(float.__repr__, c["scale"].tolist())
    return ",\n".join(
        f'{head}{mn}, "max": {mx}, "offset": {o}, "scale": {sc}}}'
        for mn, mx, o, sc in zip(mins, maxs, c["offset"].tolist(), scales, strict=True)
    )


def _remembered(key: tuple, make: Callable[[], str], used: dict[tuple, str]) -> str:
    """The text of ``key`` (arrays by their bytes), from the last document if it was there."""
    digest = digest_json(
        [
            [str(k.dtype), digest_bytes(memoryview(np.ascontiguousarray(k)).cast("B"))]
            if isinstance(k, np.ndarray)
            else k
            for k in key
        ]
    )
    text = used.get(digest) or _TEXTS.get(digest)
    if text is None:
        text = make()
    used[digest] = text
    return text


class _TextMemo:
    """The texts of the last :func:`dumps_encodings` call, by the digest of their values: a
    re-export whose weight scales did not change formats none of them again. Keeps one
    document's worth (the next call keeps what it used)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._texts: dict[str, str] = {}

    def get(self, digest: str) -> str | None:
        with self._lock:
            return self._texts.get(digest)

    def keep(self, texts: dict[str, str]) -> None:
        with self._lock:
            self._texts = dict(texts)


_TEXTS = _TextMemo()
