"""Exports of the zoo models shared by the zoo and interop tests: each (model, preset, format,
encodings version) is exported once per test session, through one cache."""

from __future__ import annotations

from pathlib import Path

import graphbuild as gb
from tests import zoo

PRESETS = ("w8a16", "w8a8", "w4a16")

#: (model, preset) pairs in the default suite; the others are marked slow
DEFAULT_CASES = frozenset(
    {
        ("resnet", "w8a16"),
        ("resnet", "w8a8"),
        ("resnet", "w4a16"),
        ("mobilenetv3", "w8a8"),
        ("mobilenetv3", "w4a16"),
        ("bert", "w8a16"),
        ("gpt2", "w8a8"),
        ("llama", "w8a16"),
        ("vit", "w4a16"),
    }
)

_DONE: dict[tuple, gb.ExportArtifacts] = {}


def export_zoo(
    name: str,
    preset: str,
    fmt: str,
    cache: gb.Cache,
    version: str = "1.0.0",
    int32_bias: bool | None = None,
    check_htp: bool = False,
    matmul_int16_requantize: bool = True,
) -> gb.ExportArtifacts:
    """Export zoo model ``name`` with ``preset`` (numerics checked; with ``check_htp``, on
    Qualcomm's HTP backend too) into a directory of its own beside the cache; the second call
    with the same arguments returns the first's result."""
    key = (name, preset, fmt, version) + (() if int32_bias is None else (f"bias{int32_bias}",))
    key += ("htp",) if check_htp else ()
    key += () if matmul_int16_requantize else ("no-int16-requantize",)
    if key not in _DONE:
        model, sample = zoo.build(name)
        out = Path(cache.path).parent / "zoo-out" / "-".join(key)
        _DONE[key] = gb.export(
            model,
            sample,
            out,
            name,
            format=fmt,
            options=gb.QnnOnnxOptions(
                quantizer=preset,
                calibration=zoo.calibration(name),
                encodings_version=version,
                int32_bias=int32_bias,
                check_numerics=True,
                check_htp=check_htp,
                matmul_int16_requantize=matmul_int16_requantize,
            ),
            cache=cache,
        )
    return _DONE[key]
