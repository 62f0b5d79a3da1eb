"""The GGUF target's rerun table (docs/gguf.md, "What reruns"): after each kind of change exactly
these stages rerun, and the new file is built from the one it replaces: changed tensors
written, the others copied by verified range copies, byte for byte a fresh export."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import graphbuild as gb
from graphbuild.engine.scheduler import EventKind
from graphbuild.onnx import files as files_module
from graphbuild.targets.gguf import tensors as tensors_module
from tests import gguf_models as gm

README = Path(__file__).resolve().parents[1] / "docs" / "gguf.md"


def readme_table() -> dict[str, str]:
    """The README's GGUF rerun table: change -> what reruns."""
    text = README.read_text()
    section = text[text.index("## What reruns") :]
    lines = section[section.index("| change | reruns |") :].splitlines()[2:]
    rows = {}
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1]
    return rows


TABLE = readme_table()


def assert_row(art, change: str) -> None:
    """The stages that ran are the README's for ``change``: the named stages, and one or
    every packing shard where it says so."""
    cell = TABLE[change]
    names = set() if cell == "nothing" else set(re.findall(r"`([a-z_0-9]+)`", cell))
    shards = 4 if "every `pack_<k>`" in cell else 1 if "one `pack_<k>`" in cell else 0
    assert (ran(art), packed_shards(art)) == (names, shards), change


def test_the_readme_table_is_read():
    assert len(TABLE) >= 9 and TABLE["nothing"] == "nothing"


@pytest.fixture(autouse=True)
def fresh_memo():
    """Each test starts with no packed tensors of an earlier export in this process."""
    tensors_module._Memo.clear()
    yield
    tensors_module._Memo.clear()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> tuple[Path, Path]:
    """The tokenizer, and one trained with another vocabulary size."""
    root = tmp_path_factory.mktemp("tok")
    gm.tokenizer(root / "a.json")
    gm.tokenizer(root / "b.json", vocab_size=gm.VOCAB - 10)
    return root / "a.json", root / "b.json"


@pytest.fixture
def copies(monkeypatch) -> list[int]:
    """Bytes each ``os.copy_file_range`` call of the writer copied, on a file system that
    shares blocks (btrfs, XFS), where the writer copies, whatever holds tmp_path."""
    monkeypatch.setattr(files_module, "shares_blocks", lambda fd: True)
    seen: list[int] = []
    real = os.copy_file_range

    def spy(*args):
        n = real(*args)
        seen.append(n)
        return n

    monkeypatch.setattr(files_module.os, "copy_file_range", spy)
    return seen


def build(model, out, cache, tokenizer, events=None, **options):
    options.setdefault("quantizer", "q8_0")
    return gb.export(
        model,
        (gm.token_ids(),),
        out,
        "m",
        target="gguf",
        options=gb.GgufOptions(tokenizer=tokenizer, **options),
        cache=cache,
        listeners=[events.append] if events is not None else (),
    )


def ran(art) -> set[str]:
    """The stages that ran, the per-shard projections (``weight_digests_<k>``,
    ``qparams_<k>``: they rerun with their upstream, and cut off what did not change) and
    packing shards (``pack_<k>``) left out: :func:`packed_shards` counts those."""
    return {
        name
        for name, status in art.report.statuses.items()
        if status == "ran" and not re.fullmatch(r"(weight_digests|qparams|pack)_\d+", name)
    }


def packed_shards(art) -> int:
    """How many packing shards reran (the others were cut off: their tensors unchanged)."""
    statuses = art.report.statuses
    return sum(1 for n, s in statuses.items() if re.fullmatch(r"pack_\d+", n) and s == "ran")


def tensor_bytes(art, names=None) -> int:
    """Bytes of the file's tensors (those named), as the reader finds them."""
    gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files")
    reader = gguf.GGUFReader(art.files["gguf"])
    return sum(int(t.n_bytes) for t in reader.tensors if names is None or t.name in names)


def fresh(model, tmp_path, tokenizer, **options) -> bytes:
    tensors_module._Memo.clear()
    art = build(model, tmp_path / "fresh", False, tokenizer, **options)
    return art.files["gguf"].read_bytes()


@pytest.fixture
def warm(tmp_path, tokenizers):
    model = gm.decoder("llama")
    cache = gb.Cache(tmp_path / "cache")
    build(model, tmp_path / "out", cache, tokenizers[0])
    return model, tmp_path / "out", cache


def test_nothing_changed_reruns_nothing_and_loads_only_the_report(warm, tokenizers):
    model, out, cache = warm
    before = (out / "m.gguf").stat()
    events = []
    art = build(model, out, cache, tokenizers[0], events=events)
    assert set(art.report.statuses.values()) == {"hit"}
    assert_row(art, "nothing")
    assert {e.stage for e in events if e.kind is EventKind.LOADED} <= {"report"}
    after = (out / "m.gguf").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_weights_only_repack_the_changed_tensor_and_copy_the_rest(
    warm, tokenizers, copies, tmp_path
):
    model, out, cache = warm
    build(model, out, cache, tokenizers[0])  # packs in this process: the memo holds them
    copies.clear()
    with torch.no_grad():
        model.model.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    art = build(model, out, cache, tokenizers[0])
    assert_row(art, "weights only")  # one shard: the one holding the changed tensor
    unchanged = tensor_bytes(art) - tensor_bytes(art, {"blk.1.ffn_down.weight"})
    assert sum(copies) == unchanged > 0
    assert (out / "m.gguf").read_bytes() == fresh(model, tmp_path, tokenizers[0])


def test_weights_only_repack_only_the_changed_tensor(warm, tokenizers, monkeypatch):
    """Within a process the shard's previous call gives its unchanged tensors (in a new
    process the shard repacks them all: the other shards come from the cache)."""
    model, out, cache = warm
    build(model, out, cache, tokenizers[0])
    packed = []
    real = tensors_module._Job.run
    monkeypatch.setattr(
        tensors_module._Job, "run", lambda job: packed.append(job.name) or real(job)
    )
    with torch.no_grad():
        model.model.model.layers[0].self_attn.k_proj.weight.add_(0.01)
    build(model, out, cache, tokenizers[0])
    assert packed == ["blk.0.attn_k.weight"]


def test_a_tokenizer_change_rewrites_the_header_and_copies_every_tensor(
    warm, tokenizers, copies, tmp_path
):
    model, out, cache = warm
    copies.clear()
    art = build(model, out, cache, tokenizers[1])
    assert_row(art, "tokenizer")
    assert sum(copies) == tensor_bytes(art)
    assert (out / "m.gguf").read_bytes() == fresh(model, tmp_path, tokenizers[1])


def test_a_metadata_change_reruns_the_file_only(warm, tokenizers, copies, tmp_path):
    model, out, cache = warm
    copies.clear()
    art = build(model, out, cache, tokenizers[0], metadata={"general.author": "someone"})
    assert_row(art, "`metadata`")
    assert sum(copies) == tensor_bytes(art)
    expected = fresh(model, tmp_path, tokenizers[0], metadata={"general.author": "someone"})
    assert (out / "m.gguf").read_bytes() == expected


def test_a_preset_change_repacks_and_keeps_the_plan(warm, tokenizers):
    model, out, cache = warm
    art = build(model, out, cache, tokenizers[0], quantizer="q4_0")
    assert_row(art, "preset")


def test_the_model_name_reruns_the_file_only(warm, tokenizers, tmp_path):
    model, _, cache = warm
    art = gb.export(
        model,
        (gm.token_ids(),),
        tmp_path / "renamed",
        "other",
        target="gguf",
        options=gb.GgufOptions(tokenizer=tokenizers[0], quantizer="q8_0"),
        cache=cache,
    )
    assert_row(art, "model name (`general.name`)")  # general.name is in the file
    assert art.files["gguf"].name == "other.gguf"


def test_a_structure_change_reruns_the_plan(warm, tokenizers):
    model, out, cache = warm
    model.model.config.rms_norm_eps = 1e-5  # llama.cpp reads it: the header changes
    art = build(model, out, cache, tokenizers[0])
    assert "input.structure" in art.report["plan"].reason
    assert_row(art, "a hyperparameter llama.cpp reads (`rms_norm_eps`)")
    assert art.report.statuses["pack"] == "cutoff"  # the same tensors: tensor_plan cut it off


def test_an_edited_output_file_contributes_nothing_to_the_next(warm, tokenizers, tmp_path):
    model, out, cache = warm
    path = out / "m.gguf"
    data = bytearray(path.read_bytes())
    stat = path.stat()
    data[-40] ^= 0xFF  # inside the last tensor, which stays unchanged below
    with open(path, "r+b") as f:  # in place: same inode, size and mtime
        f.write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with torch.no_grad():
        model.model.model.layers[0].mlp.up_proj.weight.mul_(0.5)
    build(model, out, cache, tokenizers[0])
    assert path.read_bytes() == fresh(model, tmp_path, tokenizers[0])


def test_an_output_file_edited_by_hand_is_placed_again_from_the_cache(warm, tokenizers):
    model, out, cache = warm
    original = (out / "m.gguf").read_bytes()
    (out / "m.gguf").write_bytes(b"edited")
    art = build(model, out, cache, tokenizers[0])
    assert set(art.report.statuses.values()) == {"hit"}
    assert (out / "m.gguf").read_bytes() == original


# --------------------------------------------------------------------------- the model's own quantizers


@pytest.fixture
def warm_quantized(tmp_path, tokenizers):
    model = gm.quantize_linears(gm.decoder("llama"), lambda lin: gm.BlockQuantLinear(lin, 4, 32))
    cache = gb.Cache(tmp_path / "cache")
    build(model, tmp_path / "out", cache, tokenizers[0], quantizer=None)
    return model, tmp_path / "out", cache


def test_own_quantizers_weights_only_never_retrace(warm_quantized, tokenizers, tmp_path):
    model, out, cache = warm_quantized
    with torch.no_grad():
        model.model.model.layers[0].mlp.gate_proj.weight.mul_(0.9)
    art = build(model, out, cache, tokenizers[0], quantizer=None)
    assert_row(art, "weights only, own quantizers")  # qparams: the same values, no effect
    assert art.report.statuses["capture"] == art.report.statuses["normalize"] == "hit"
    expected = fresh(model, tmp_path, tokenizers[0], quantizer=None)
    assert (out / "m.gguf").read_bytes() == expected


def test_own_quantizers_scales_only_repack_without_retracing(warm_quantized, tokenizers):
    model, out, cache = warm_quantized
    digests = build(model, out, cache, tokenizers[0], quantizer=None).report["weight_digests"]
    with torch.no_grad():
        model.model.model.layers[1].self_attn.o_proj.weight_quantizer.scale.mul_(1.25)
    art = build(model, out, cache, tokenizers[0], quantizer=None)
    assert_row(art, "quantizer scales only")  # the shard holding o_proj
    assert art.report["weight_digests"].digest == digests.digest  # a scale is no weight
    assert art.report.statuses["capture"] == art.report.statuses["normalize"] == "hit"


def test_without_copy_file_range_every_tensor_is_written(warm, tokenizers, monkeypatch, tmp_path):
    """macOS has no ``os.copy_file_range``: the file is written whole, the same bytes."""
    model, out, cache = warm
    monkeypatch.delattr(files_module.os, "copy_file_range")
    with torch.no_grad():
        model.model.model.layers[0].mlp.up_proj.weight.mul_(0.5)
    build(model, out, cache, tokenizers[0])
    assert (out / "m.gguf").read_bytes() == fresh(model, tmp_path, tokenizers[0])
