"""The encodings text, written from arrays: byte for byte what the JSON encoder writes, every
value parsing back to the exact float the document holds, and unchanged scales not formatted
again."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from graphbuild.quant.quantmap import QParams, QuantMap, QuantSpec, QuantValues
from graphbuild.targets.qnn.encodings import build_encodings, dumps_encodings
from graphbuild.targets.qnn.encodings import text as text_module

VERSIONS = ["1.0.0", "0.6.1", "2.0.0"]


def awkward_scales(n: int, seed: int) -> torch.Tensor:
    """float32 scales of every kind: random, tiny, subnormal, huge, powers of two, ties."""
    g = torch.Generator().manual_seed(seed)
    s = torch.exp(torch.empty(n).uniform_(-30, 10, generator=g)).float()
    special = torch.tensor([1e-45, 1.4e-45, 1e-38, 3.4e38, 0.5, 2.0**-20, 0.1, 1 / 3, 1e-5, 7e-5])
    s[: min(n, len(special))] = special[: min(n, len(special))]
    return s


def quant(seed: int = 0, channels: int = 300, scale: torch.Tensor | None = None):
    """An activation quantizer, a per-channel weight quantizer and a blocked one."""
    w = awkward_scales(channels, seed) if scale is None else scale
    g = torch.Generator().manual_seed(seed + 1)
    specs = (
        QuantSpec(0, 8, False, 0, 255),
        QuantSpec(1, 8, True, -127, 127, axis=0, param="w", symmetric=True),
        QuantSpec(2, 4, True, -8, 7, axis=0, block_size=4, param="b"),
    )
    values = {
        0: QParams(torch.tensor([0.0123]), torch.tensor([131])),
        1: QParams(w, torch.zeros(channels, dtype=torch.int64)),
        2: QParams(
            awkward_scales(12, seed + 2).reshape(3, 4), torch.randint(-8, 8, (3, 4), generator=g)
        ),
    }
    return QuantMap(specs), QuantValues(values), {0: "act", 1: "w", 2: "b"}


def documents(version: str, **kw) -> list[tuple[dict, str]]:
    qmap, values, names = quant(**kw)
    if version == "0.6.1":  # 0.6.1 has no blocked quantizers
        qmap = QuantMap(qmap.specs[:2])
    return build_encodings(qmap, values, names, version)


def reference_dumps(doc: dict) -> str:
    """The writer as it was: every entry through the C JSON encoder (the document made plain
    first, so nothing but json's own formatting applies)."""
    compact = json.JSONEncoder(separators=(", ", ": ")).encode
    plain = json.loads(json.dumps(doc))

    def block(value, depth):
        pad, inner = "  " * depth, "  " * (depth + 1)
        if (isinstance(value, dict) and depth == 0) or (
            isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values())
        ):
            items = [f"{inner}{compact(k)}: {block(v, depth + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}" if items else "{}"
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            return "[\n" + ",\n".join(inner + compact(v) for v in value) + f"\n{pad}]"
        return compact(value)

    return block(plain, 0) + "\n"


@pytest.fixture(autouse=True)
def no_remembered_texts():
    text_module._TEXTS.keep({})


@pytest.mark.parametrize("version", VERSIONS)
def test_the_text_is_what_the_json_encoder_writes(version):
    doc = documents(version)
    assert dumps_encodings(doc) == reference_dumps(doc)
    assert dumps_encodings(doc) == reference_dumps(doc)  # and so is the remembered text


@pytest.mark.parametrize("version", VERSIONS)
def test_every_scale_parses_back_to_its_exact_float(version):
    scale = awkward_scales(300, 7)
    doc = documents(version, scale=scale)
    parsed = json.loads(dumps_encodings(doc))
    assert parsed == json.loads(json.dumps(doc)) == doc
    exact = [float(v) for v in scale.numpy()]
    if version == "1.0.0":
        got = next(e for e in parsed["param_encodings"] if e["name"] == "w")["scale"]
    elif version == "2.0.0":
        got = next(e for e in parsed["encodings"] if e["name"] == "w")["y_scale"]
    else:
        got = [c["scale"] for c in parsed["param_encodings"]["w"]]
        offset = parsed["param_encodings"]["w"][0]["offset"]
        assert [c["min"] for c in parsed["param_encodings"]["w"]] == [s * offset for s in exact]
    assert np.array_equal(np.array(got).view(np.int64), np.array(exact).view(np.int64))


def test_non_finite_values_are_written_as_json_writes_them():
    """Scales are finite (build_encodings refuses others); the writer still spells what it
    is given as json does."""
    values = [0.5, float("inf"), float("-inf"), float("nan"), 1e-45]
    text = text_module._float_text(text_module._FloatList(np.array(values)))
    assert text == json.dumps(values)


@pytest.mark.parametrize("version", VERSIONS)
def test_unchanged_scales_are_not_formatted_again_and_changed_ones_are(version, monkeypatch):
    formatted: list[int] = []
    for name in ("_float_text", "_channel_lines"):
        real = getattr(text_module, name)
        monkeypatch.setattr(
            text_module, name, lambda *a, real=real: formatted.append(len(a[0])) or real(*a)
        )
    scale = awkward_scales(300, 1)
    dumps_encodings(documents(version, scale=scale))
    first = len(formatted)
    assert first >= 1
    formatted.clear()
    assert dumps_encodings(documents(version, scale=scale)) == reference_dumps(
        documents(version, scale=scale)
    )
    assert formatted == []
    scale = scale.clone()
    scale[17] *= 3
    changed = documents(version, scale=scale)
    assert dumps_encodings(changed) == reference_dumps(changed)
    assert formatted == [300]
