"""Incremental re-export: bind recomputes only the tensors whose inputs changed (in parallel,
bit for bit), and a model file is rebuilt from the one it replaces by verified range copies,
byte for byte what a full write gives; an edited output file contributes nothing."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import graphbuild as gb
from graphbuild.errors import FingerprintMismatchError, StageError
from graphbuild.onnx import bind as bind_module
from graphbuild.onnx import files as files_module
from graphbuild.onnx import filesystem
from graphbuild.onnx.bind import BoundModel
from graphbuild.onnx.save import PreviousFile, save_model, write_model
from tests.models import FakeQuantConvNet
from tests.test_bind_save import mixed_bound_model

real_shares_blocks = filesystem.shares_blocks
SAMPLE = (torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(5)),)


@pytest.fixture(autouse=True)
def fresh_memo():
    """Each test starts with no tensors of an earlier bind (other tests bind too)."""
    bind_module._Memo.clear()
    yield
    bind_module._Memo.clear()


@pytest.fixture(autouse=True)
def blocks_shared(monkeypatch):
    """The writer copies from a previous file where the file system shares blocks (btrfs,
    XFS): these tests run it as it runs there, whatever file system holds tmp_path."""
    monkeypatch.setattr(files_module, "shares_blocks", lambda fd: True)


@pytest.fixture
def copies(monkeypatch) -> list[int]:
    """Bytes each ``os.copy_file_range`` call of the writer copied."""
    seen: list[int] = []
    real = os.copy_file_range

    def spy(*args):
        n = real(*args)
        seen.append(n)
        return n

    monkeypatch.setattr(files_module.os, "copy_file_range", spy)
    return seen


def model(seed: int = 0) -> FakeQuantConvNet:
    torch.manual_seed(seed)
    return FakeQuantConvNet().eval()


def export(m, out: Path, cache, **options) -> gb.ExportArtifacts:
    return gb.export(m, SAMPLE, out, "net", options=gb.QnnOnnxOptions(**options), cache=cache)


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if "lock" not in p.name}


def with_tensor(bound: BoundModel, name: str, value: np.ndarray) -> BoundModel:
    return BoundModel(bound.model, {**bound.tensors, name: value})


# --------------------------------------------------------------------------- write_model


@pytest.mark.parametrize("external", [False, True])
def test_a_model_file_rebuilt_from_the_previous_one_is_byte_identical(tmp_path, external, copies):
    first = mixed_bound_model()
    (tmp_path / "a").mkdir()
    old = write_model(first, tmp_path / "a" / "m.onnx", external_data=external)[-1]
    changed = with_tensor(first, "w", first.tensors["w"] + 1)
    new = write_model(
        changed,
        tmp_path / "b" / "m.onnx",
        external_data=external,
        previous=[PreviousFile(old.path, old.ranges)],
    )
    save_model(changed, tmp_path / "c" / "m.onnx", external_data=external)
    assert files(tmp_path / "b") == files(tmp_path / "c")
    w_bytes = first.tensors["w"].nbytes
    unchanged = sum(r.length for r in old.ranges) - w_bytes
    assert new[-1].copied == unchanged == sum(copies) > 0


def test_a_rebuilt_file_reports_its_digest_and_where_each_tensor_lies(tmp_path):
    bound = mixed_bound_model()
    (saved,) = write_model(bound, tmp_path / "m.onnx", external_data=False)
    data = saved.path.read_bytes()
    assert saved.digest == gb.hashing.digest_bytes(data) and saved.size == len(data)
    w = saved.ranges[0]  # the graph's first reference
    assert data[w.offset : w.offset + w.length] == bound.tensors["w"].tobytes()


def test_an_edited_previous_file_never_reaches_the_new_one(tmp_path, copies):
    first = mixed_bound_model()
    (tmp_path / "a").mkdir()
    (old,) = write_model(first, tmp_path / "a" / "m.onnx", external_data=False)
    w = old.ranges[0]
    stat = old.path.stat()
    with open(old.path, "r+b") as f:  # a user's edit, the file's size and mtime kept
        f.seek(w.offset + 3)
        f.write(b"\xff")
    os.utime(old.path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed = with_tensor(first, "f16", first.tensors["f16"] - 1)
    (new,) = write_model(
        changed,
        tmp_path / "b" / "m.onnx",
        external_data=False,
        previous=[PreviousFile(old.path, old.ranges)],
    )
    save_model(changed, tmp_path / "c" / "m.onnx", external_data=False)
    assert files(tmp_path / "b") == files(tmp_path / "c")
    assert new.copied == sum(copies) - w.length  # w was copied, read back, and rewritten


@pytest.mark.parametrize("replace", ["fifo", "symlink", "truncated", "missing"])
def test_a_previous_file_that_cannot_be_trusted_is_not_copied_from(tmp_path, replace):
    first = mixed_bound_model()
    (tmp_path / "a").mkdir()
    (old,) = write_model(first, tmp_path / "a" / "m.onnx", external_data=False)
    kept = tmp_path / "kept.onnx"
    os.replace(old.path, kept)
    if replace == "fifo":  # reading it would block
        os.mkfifo(old.path)
    elif replace == "symlink":  # the same bytes, behind a link: not followed
        os.symlink(kept, old.path)
    elif replace == "truncated":
        old.path.write_bytes(kept.read_bytes()[: old.ranges[-1].offset])
    (new,) = write_model(
        first,
        tmp_path / "b" / "m.onnx",
        external_data=False,
        previous=[PreviousFile(old.path, old.ranges)],
    )
    assert new.path.read_bytes() == kept.read_bytes()
    if replace != "truncated":
        assert new.copied == 0


def test_without_copy_file_range_every_tensor_is_written(tmp_path, monkeypatch):
    def unsupported(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    first = mixed_bound_model()
    (tmp_path / "a").mkdir()
    (old,) = write_model(first, tmp_path / "a" / "m.onnx", external_data=True)[-1:]
    monkeypatch.setattr(files_module.os, "copy_file_range", unsupported)
    (new,) = write_model(
        first,
        tmp_path / "b" / "m.onnx",
        external_data=True,
        previous=[PreviousFile(old.path, old.ranges)],
    )[-1:]
    assert new.copied == 0 and new.path.read_bytes() == old.path.read_bytes()


def test_where_the_file_system_shares_no_blocks_every_tensor_is_written(
    tmp_path, monkeypatch, copies
):
    """On ext4 or tmpfs a range copy moves the bytes as a write does, and the read-back
    check makes it dearer: the tensors, in memory anyway, are written."""
    monkeypatch.setattr(files_module, "shares_blocks", real_shares_blocks)
    monkeypatch.setattr(filesystem, "file_system_type", lambda fd: 0xEF53)  # ext4
    first = mixed_bound_model()
    (tmp_path / "a").mkdir()
    (old,) = write_model(first, tmp_path / "a" / "m.onnx", external_data=False)
    (new,) = write_model(
        first,
        tmp_path / "b" / "m.onnx",
        external_data=False,
        previous=[PreviousFile(old.path, old.ranges)],
    )
    assert copies == [] and new.copied == 0
    assert new.path.read_bytes() == old.path.read_bytes() and new.ranges == old.ranges


@pytest.mark.skipif(shutil.which("stat") is None, reason="needs coreutils' stat")
def test_the_file_system_type_is_the_one_stat_reports(tmp_path):
    with open(tmp_path / "f", "wb") as f:
        found = filesystem.file_system_type(f.fileno())
    if found is None:
        pytest.skip("no fstatfs on this platform")
    shown = subprocess.run(
        ["stat", "-f", "-c", "%t", str(tmp_path / "f")], capture_output=True, text=True
    )
    assert found == int(shown.stdout.strip(), 16)


def test_a_large_file_is_streamed_to_disk_as_it_is_written(tmp_path, monkeypatch):
    """Each range goes to the disk once written, in order, and the one before it is released
    from the page cache; the bytes are those of a file written at once."""
    handed: list[tuple[int, int]] = []
    released: list[tuple[int, int]] = []
    monkeypatch.setattr(filesystem, "start_writeback", lambda fd, a, n: handed.append((a, n)))
    monkeypatch.setattr(filesystem, "release", lambda fd, a, n: released.append((a, n)))
    monkeypatch.setattr(files_module, "_STREAM_BYTES", 64)
    bound = mixed_bound_model()
    (saved,) = write_model(bound, tmp_path / "a" / "m.onnx", external_data=False)
    assert len(handed) > 2 and handed[0][0] == 0 and all(n >= 64 for _, n in handed)
    assert all(a + n == b for (a, n), (b, _) in zip(handed, handed[1:], strict=False))
    assert released == handed[:-1]  # the latest range stays until the next one is written
    monkeypatch.setattr(files_module, "_STREAM_BYTES", 1 << 62)
    (whole,) = write_model(bound, tmp_path / "b" / "m.onnx", external_data=False)
    assert saved.path.read_bytes() == whole.path.read_bytes()


# --------------------------------------------------------------------------- bind


def test_bind_snaps_only_the_weights_whose_inputs_changed(tmp_path, monkeypatch):
    snapped: list[tuple] = []
    real = bind_module.fake_quantize
    monkeypatch.setattr(
        bind_module,
        "fake_quantize",
        lambda x, spec, qp: snapped.append(x.shape) or real(x, spec, qp),
    )
    m = model()
    export(m, tmp_path / "out", tmp_path / "cache")
    assert len(snapped) == 3  # conv1, conv2, fc
    snapped.clear()
    with torch.no_grad():
        m.fc.weight[0, 0] += 0.01
    export(m, tmp_path / "out", tmp_path / "cache")
    assert snapped == [m.fc.weight.shape]
    export(m, tmp_path / "fresh", False)  # no cache, no memo: everything computed
    assert files(tmp_path / "out") == files(tmp_path / "fresh")


def test_a_new_scale_snaps_its_weight_again(tmp_path, monkeypatch):
    m = model()
    export(m, tmp_path / "out", tmp_path / "cache")
    with torch.no_grad():
        m.conv2_w_scale.mul_(1.5)
    export(m, tmp_path / "out", tmp_path / "cache")
    bind_module._Memo.clear()
    export(m, tmp_path / "fresh", False)
    assert files(tmp_path / "out") == files(tmp_path / "fresh")


def test_bind_in_parallel_is_bit_exact_with_one_tensor_at_a_time(tmp_path, monkeypatch):
    m = model(3)
    monkeypatch.setattr(bind_module, "PARALLEL_BIND_BYTES", 0)
    export(m, tmp_path / "parallel", False)
    bind_module._Memo.clear()
    monkeypatch.setattr(bind_module, "PARALLEL_BIND_BYTES", 1 << 62)
    export(m, tmp_path / "serial", False)
    assert files(tmp_path / "parallel") == files(tmp_path / "serial")


def test_check_mode_recomputes_what_bind_would_reuse_and_fails_on_a_wrong_one(tmp_path):
    m = model()
    export(m, tmp_path / "out", tmp_path / "cache")
    entries = bind_module._Memo.entries()
    assert entries and all(not a.flags.writeable for a, _ in entries.values())
    poisoned = {k: (a, "0" * 32) for k, (a, _) in entries.items()}
    bind_module._Memo.keep(poisoned)
    with torch.no_grad():
        m.conv1.bias.add_(0.5)  # bind reruns; its snapped weights would come from the memo
    with pytest.raises(StageError, match="reused digest") as err:
        gb.export(
            m, SAMPLE, tmp_path / "out", "net", cache=tmp_path / "cache", check_fingerprints=True
        )
    assert isinstance(err.value.cause, FingerprintMismatchError)


# --------------------------------------------------------------------------- placement


@pytest.mark.parametrize("external", [False, True])
def test_re_export_copies_unchanged_tensors_and_matches_a_full_write(tmp_path, external, copies):
    m = model()
    export(m, tmp_path / "out", tmp_path / "cache", external_data=external)
    assert copies == []
    with torch.no_grad():
        m.fc.weight.mul_(0.5)
    export(m, tmp_path / "out", tmp_path / "cache", external_data=external)
    assert sum(copies) > 0
    bind_module._Memo.clear()
    export(m, tmp_path / "fresh", False, external_data=external)
    assert files(tmp_path / "out") == files(tmp_path / "fresh")


def test_an_edited_output_file_is_not_copied_into_the_next_export(tmp_path):
    m = model()
    out = tmp_path / "out"
    export(m, out, tmp_path / "cache")
    path = out / "net.onnx"
    data = bytearray(path.read_bytes())
    at = data.find(m.conv1.bias.detach().numpy().tobytes())  # an unchanged tensor's range
    assert at > 0
    data[at] ^= 0xFF
    stat = path.stat()
    with open(path, "r+b") as f:  # in place: same inode, size and mtime
        f.write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with torch.no_grad():
        m.fc.weight.mul_(0.5)  # the model changed: the file is rebuilt from the edited one
    export(m, out, tmp_path / "cache")
    bind_module._Memo.clear()
    export(m, tmp_path / "fresh", False)
    assert files(out) == files(tmp_path / "fresh")


def test_the_files_an_export_replaced_are_removed_after_it_returns(tmp_path):
    m = model()
    (tmp_path / "outs").mkdir()
    export(m, tmp_path / "outs" / "out", tmp_path / "cache")
    with torch.no_grad():
        m.fc.weight.mul_(0.5)
    export(m, tmp_path / "outs" / "out", tmp_path / "cache")
    for thread in threading.enumerate():
        if thread.name == "graphbuild-remove-replaced":
            thread.join()
    assert [p.name for p in (tmp_path / "outs").iterdir()] == ["out"]


# --------------------------------------------------------------------------- cache writes


def test_a_failing_cache_write_fails_the_export(tmp_path, monkeypatch):
    def broken(self, *args):
        raise RuntimeError("the cache writer broke")

    monkeypatch.setattr(gb.Cache, "store", broken)
    with pytest.raises(RuntimeError, match="cache writer broke"):
        export(model(), tmp_path / "out", tmp_path / "cache")


def test_the_cache_holds_every_output_when_export_returns(tmp_path):
    m = model()
    export(m, tmp_path / "out", tmp_path / "cache")
    art = export(m, tmp_path / "other", gb.Cache(tmp_path / "cache"))  # another Cache object
    assert art.report.ran == []


def test_the_cache_keeps_the_digest_of_bound_weights_not_their_bytes(tmp_path):
    m = model()
    first = export(m, tmp_path / "out", tmp_path / "cache")
    cache = gb.Cache(tmp_path / "cache")
    bound = cache.lookup(first.report["bind"].key)
    assert bound["bytes"] == 0 and bound["artifact"]["digest"] == first.report["bind"].digest
    tensors = bound["artifact"]["parts"][1:]  # the skeleton, then one part per tensor
    assert len(tensors) > 3 and not any(cache.blobs.has(d, s) for d, s in tensors)
    bind_module._Memo.clear()  # as in a new process
    again = export(m, tmp_path / "other", cache)
    assert again.report.ran == [] and again.report["bind"].status == "hit"
    assert files(tmp_path / "other") == files(tmp_path / "out")
