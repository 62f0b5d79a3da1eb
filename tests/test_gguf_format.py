"""GGUF's building blocks against the ``gguf`` package (llama.cpp's own Python reader and
reference quantizers): block layouts, preset quantization bit for bit, the container, the
RoPE row order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphbuild.errors import ExportError
from graphbuild.targets.gguf import blocks, container, vocab
from graphbuild.targets.gguf.tensors import rope_order

gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install gguf")


def weights(rows: int = 16, cols: int = 96, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: d = 0
    x[1, :32] = np.linspace(-1, 1, 32, dtype=np.float32)  # ties in magnitude at both ends
    x[2, 5] = -40.0  # a negative extreme
    x[3, :32] = np.float32(0.5) * np.arange(32, dtype=np.float32) / 31 * 127  # halfway codes
    return x


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (blocks.quantize_q8_0, gguf.GGMLQuantizationType.Q8_0),
        (blocks.quantize_q4_0, gguf.GGMLQuantizationType.Q4_0),
    ],
)
def test_presets_give_llama_cpps_blocks_bit_for_bit(ours, theirs):
    x = weights()
    ggml = blocks.GGML_TYPES[theirs.name]
    packed = blocks.pack(ggml, *ours(x))
    expected = gguf.quants.quantize(x, theirs)  # bit-exact with ggml-quants.c's reference
    assert packed.tobytes() == expected.tobytes()


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_unpack_is_llama_cpps_dequantization(name):
    ggml = blocks.GGML_TYPES[name]
    x = weights(seed=1)
    codes, d = (blocks.quantize_q8_0 if name == "Q8_0" else blocks.quantize_q4_0)(x)
    data = blocks.pack(ggml, codes, d)
    theirs = gguf.quants.dequantize(data.reshape(x.shape[0], -1), gguf.GGMLQuantizationType[name])
    np.testing.assert_array_equal(blocks.unpack(ggml, data, x.shape), theirs)
    np.testing.assert_array_equal(blocks.dequantize(codes, d), theirs)


def test_codes_outside_the_types_range_are_refused():
    codes = np.zeros((1, 32), dtype=np.int8)
    codes[0, 3] = 8
    with pytest.raises(ExportError, match=r"Q4_0 codes outside \[-8, 7\]"):
        blocks.pack(blocks.Q4_0, codes, np.ones(1, dtype=np.float16))


def test_rows_that_are_not_whole_blocks_are_named():
    with pytest.raises(ExportError, match="'w'.*not a multiple of 32"):
        blocks.check_blockable("w", (4, 40), blocks.Q8_0)


def test_type_ids_and_sizes_are_ggmls():
    for name, ggml in blocks.GGML_TYPES.items():
        theirs = gguf.GGMLQuantizationType[name]
        assert ggml.id == int(theirs)
        assert (ggml.block_size, ggml.type_size) == gguf.GGML_QUANT_SIZES[theirs]
    for name, ftype in blocks.FILE_TYPES.items():
        expected = "ALL_F32" if name == "F32" else f"MOSTLY_{name}"
        assert ftype == int(gguf.LlamaFileType[expected])
    for kind, (type_id, _) in container.VALUE_TYPES.items():
        assert type_id == int(gguf.GGUFValueType[kind.upper()])
    assert (vocab.NORMAL, vocab.CONTROL, vocab.USER_DEFINED, vocab.UNUSED) == (
        gguf.TokenType.NORMAL,
        gguf.TokenType.CONTROL,
        gguf.TokenType.USER_DEFINED,
        gguf.TokenType.UNUSED,
    )


def test_the_container_reads_back_with_ggufs_reader(tmp_path):
    entries = [
        ("general.architecture", "string", "llama"),
        ("t.u8", "uint8", 200),
        ("t.i32", "int32", -5),
        ("t.f32", "float32", 0.25),
        ("t.b", "bool", True),
        ("t.u64", "uint64", 2**40),
        ("t.f64", "float64", 1e-300),
        ("t.strs", "array[string]", ["a b", "Ġx", "é"]),
        ("t.ints", "array[int32]", [1, -2, 3]),
    ]
    rng = np.random.default_rng(0)
    q = blocks.pack(blocks.Q8_0, *blocks.quantize_q8_0(rng.standard_normal((3, 64))))
    f = blocks.float_bytes(blocks.F32, rng.standard_normal(5))
    infos = [
        container.TensorInfo("q", (3, 64), blocks.Q8_0.id, q.nbytes),
        container.TensorInfo("f", (5,), blocks.F32.id, f.nbytes),
    ]
    head, offsets = container.header(entries, infos, 32)
    assert len(head) % 32 == 0 and offsets == [0, q.nbytes + container.pad(q.nbytes, 32)]
    body = q.tobytes() + bytes(container.pad(q.nbytes, 32)) + f.tobytes()
    (tmp_path / "t.gguf").write_bytes(head + body)
    reader = gguf.GGUFReader(tmp_path / "t.gguf")
    assert {k: reader.fields[k].contents() for k, _, _ in entries} == {
        "general.architecture": "llama",
        "t.u8": 200,
        "t.i32": -5,
        "t.f32": 0.25,
        "t.b": True,
        "t.u64": 2**40,
        "t.f64": 1e-300,
        "t.strs": ["a b", "Ġx", "é"],
        "t.ints": [1, -2, 3],
    }
    by_name = {t.name: t for t in reader.tensors}
    assert [int(n) for n in by_name["q"].shape] == [64, 3]  # ne[0] innermost
    assert by_name["q"].data.tobytes() == q.tobytes()
    assert by_name["f"].data.tobytes() == f.tobytes()


def test_repeated_keys_and_tensor_names_are_refused():
    with pytest.raises(ExportError, match="keys given twice: a"):
        container.header([("a", "uint32", 1), ("a", "uint32", 2)], [], 32)
    info = container.TensorInfo("t", (4,), 0, 16)
    with pytest.raises(ExportError, match="tensor names given twice: t"):
        container.header([], [info, info], 32)
    with pytest.raises(ExportError, match="not a valid uint32"):
        container.header([("a", "uint32", -1)], [], 32)
    with pytest.raises(ExportError, match="longer than llama.cpp's 63 bytes"):
        container.header([], [container.TensorInfo("x" * 64, (4,), 0, 16)], 32)


def test_rope_order_is_llama_cpps_permutation():
    """convert_hf_to_gguf's ``LlamaModel.permute``, applied to the data, against the row
    order applied by index."""

    def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = torch.arange(48 * 5, dtype=torch.float32).reshape(48, 5)
    for heads in (1, 2, 4, 6):
        assert torch.equal(w[torch.from_numpy(rope_order(48, heads))], permute(w, heads))
