"""Artifact codecs: every built-in output type round-trips through the cache unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.codecs import FileArtifact, encode
from graphbuild.engine.pipeline import Pipeline
from graphbuild.engine.scheduler import EventKind
from graphbuild.errors import CodecError, StageError
from tests.engine_helpers import Recorder


def assert_same(actual, expected):
    """Equal values of equal types; tensors equal in dtype, shape and bits."""
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype
        assert actual.shape == expected.shape
        assert torch.equal(actual, expected)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
    elif isinstance(expected, dict):
        assert set(actual) == set(expected)
        for k in expected:
            assert_same(actual[k], expected[k])
    else:
        assert actual == expected


def round_trip(value, cache_dir):
    """Run a stage returning ``value``, then read it back from the cache in a second run."""

    def produce(inputs, samples, ctx):
        return value

    p = Pipeline(name="codec")
    p.register_stage(produce, "produce", reads=())
    cache = Cache(cache_dir)
    try:
        first = p.run(None, cache=cache)
        assert first.report["produce"].status == "ran"
        rec = Recorder()
        second = p.run(None, cache=cache, listeners=[rec])
        assert second.report["produce"].status == "hit"
        loaded = second.outputs["produce"]
        assert rec.of(EventKind.LOADED) == ["produce"]
        assert second.report["produce"].digest == first.report["produce"].digest
        return loaded
    finally:
        cache.close()


VALUES = {
    "json": {"opset": 18, "names": ["x", "y"], "scale": 0.125, "nested": {"ok": True, "n": None}},
    "json-list": [1, 2.5, "three", None, False],
    "json-scalar": 42,
    "bytes": b"\x00\x01binary\xff",
    "tensor": torch.randn(3, 4),
    "tensor-non-contiguous": torch.arange(12.0).reshape(3, 4).t(),
    "tensor-int64": torch.arange(-5, 5),
    "tensors": {
        "weight.bf16": torch.randn(4, 3).to(torch.bfloat16),
        "scale.0dim": torch.tensor(0.0625),
        "zero_point": torch.tensor([0, -3, 7], dtype=torch.int8),
        "mask": torch.tensor([True, False]),
        "empty": torch.empty(0, 5),
    },
    "tuple-mixed": (
        7,
        "text",
        torch.ones(2, 2, dtype=torch.float16),
        b"raw",
        {"w": torch.zeros(3)},
        FileArtifact("a.txt", b"hello"),
        [1, 2],
        (None, 1.5),
    ),
    "mapping-mixed": {
        "graph": b"\x08\x01",
        "meta": {"inputs": ["x"]},
        "weights": {"fc.weight": torch.randn(2, 2)},
    },
    "file": FileArtifact("model.encodings", b'{"version": "1.0.0"}'),
}


@pytest.mark.parametrize("name", list(VALUES))
def test_builtin_codec_output_round_trips_through_the_cache(tmp_path, name):
    value = VALUES[name]

    assert_same(round_trip(value, tmp_path / "cache"), value)


def test_a_bfloat16_tensor_keeps_its_bits(tmp_path):
    value = torch.tensor([1.0, -0.0, float("inf"), 3.140625], dtype=torch.bfloat16)

    loaded = round_trip(value, tmp_path / "cache")

    assert torch.equal(loaded.view(torch.int16), value.view(torch.int16))


def test_the_digest_covers_dtype_and_shape_not_only_bytes():
    t = torch.zeros(4, dtype=torch.float32)

    digests = {
        encode(t).digest,
        encode(t.view(torch.int32)).digest,
        encode(t.reshape(2, 2)).digest,
    }

    assert len(digests) == 3


def test_equal_values_have_equal_digests():
    assert encode({"b": 1, "a": [1, 2]}).digest == encode({"a": [1, 2], "b": 1}).digest
    assert (
        encode(torch.arange(6.0).reshape(2, 3).t()).digest
        == encode(torch.arange(6.0).reshape(2, 3).t().contiguous()).digest
    )


class Opaque:
    pass


def test_an_output_of_an_unregistered_type_fails_naming_the_type(tmp_path):
    p = Pipeline(name="codec")
    p.register_stage(lambda inputs, samples, ctx: Opaque(), "opaque", reads=())
    cache = Cache(tmp_path / "cache")

    with pytest.raises(StageError, match="stage 'opaque' failed") as err:
        p.run(None, cache=cache)

    assert isinstance(err.value.cause, CodecError)
    assert "tests.test_codecs.Opaque" in str(err.value)
    assert "register_codec" in str(err.value)
    cache.close()


def test_a_dict_with_non_string_keys_is_refused_rather_than_changed(tmp_path):
    # JSON would turn the keys into strings: a warm run would see {"1": ...}, a cold one {1: ...}
    with pytest.raises(CodecError, match="dict"):
        encode({1: "one", 2: "two"})


def test_a_tuple_inside_a_list_stays_a_tuple(tmp_path):
    value = [1, (2, 3), {"pair": (4, 5)}]

    assert_same(round_trip(value, tmp_path / "cache"), value)


ROOT = Path(__file__).resolve().parent.parent

DECLARED = textwrap.dedent(
    """
    import json, sys

    import onnx
    from onnx import TensorProto, helper

    import graphbuild  # declares the codecs of the parts above the engine, imports none
    from graphbuild.engine.codecs import Encoded, Part, decode, encode
    from graphbuild.engine.toolchain import codec_version

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph)
    data = model.SerializeToString(deterministic=True)
    out = {"loaded_at_start": "graphbuild.onnx.codecs" in sys.modules,
           "version_before": codec_version("onnx")}
    if sys.argv[1] == "decode":  # an entry in the cache, read by a process that never wrote one
        entry = Encoded("onnx", None, [Part(data)]).describe()
        value = decode(entry, lambda digest, size: data)
    else:  # a stage's output of a type no registered codec takes yet
        value = model
        out["codec"] = encode(model).codec
    out["same_model"] = isinstance(value, onnx.ModelProto) and value == model
    out["loaded"] = "graphbuild.onnx.codecs" in sys.modules
    out["version_after"] = codec_version("onnx")
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("how", ["decode", "encode"])
def test_a_declared_codec_is_registered_when_first_needed_and_keeps_its_version(how):
    """onnx/codecs.py registers the ONNX codecs; graphbuild's top declares where they are,
    and the engine imports that module (named by the declaration, never by the engine)
    when a cache entry or a stage output first needs it. Its version is the same before
    and after, so an entry it wrote is a hit in a process that has not loaded it yet (a
    warm export, whose stages import ONNX lazily)."""
    proc = subprocess.run(
        [sys.executable, "-c", DECLARED, how],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    assert out["loaded_at_start"] is False
    assert out["loaded"] is True and out["same_model"] is True
    assert out["version_before"] == out["version_after"] != "unknown"
    assert out.get("codec", "onnx") == "onnx"


def test_a_blob_an_artifact_names_twice_is_read_once_and_shared():
    """An LLM part's context binary is placed in two folders: loading that output reads the
    binary's blob once, not once per file (which held two copies of it at once)."""
    from graphbuild.engine.codecs import decode

    data = bytes(range(256)) * 64
    value = {
        "htp/part.bin": FileArtifact("part.bin", data),
        "genie/part.bin": FileArtifact("part.bin", data),
    }
    encoded = encode(value)
    blobs = {p.digest: bytes(p.data) for p in encoded.all_parts()}
    reads: list[str] = []

    def read(digest: str, size: int) -> bytes:
        reads.append(digest)
        return blobs[digest]

    loaded = decode(encoded.describe(), read)
    assert loaded["htp/part.bin"].data is loaded["genie/part.bin"].data
    assert loaded["htp/part.bin"].data == data
    assert len(reads) == len(set(reads))
