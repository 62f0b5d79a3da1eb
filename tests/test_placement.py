"""Placing outputs: several exports into one new output directory at once all succeed, and
the directory holds one whole export."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

import graphbuild as gb
from examples import convnet
from graphbuild.output import placement
from graphbuild.output.placement import LOCK_FILE, _commit

EXPORTS = 4


def prepared(base: Path, i: int) -> Path:
    """An export's temporary directory, ready to become the output directory."""
    tmp = base / f".out.{i}.tmp"
    tmp.mkdir()
    (tmp / "net.onnx").write_text(f"model of export {i}")
    (tmp / "net.encodings").write_text(f"encodings of export {i}")
    (tmp / LOCK_FILE).write_text(f"lock of export {i}")
    return tmp


def test_exports_creating_the_same_new_output_directory_at_once_all_succeed(tmp_path):
    ours = {"net.onnx", "net.encodings", LOCK_FILE}
    for attempt in range(10):  # each attempt a new directory: the race is at its creation
        base = tmp_path / str(attempt)
        base.mkdir()
        out = base / "out"
        temps = [prepared(base, i) for i in range(EXPORTS)]
        start = threading.Barrier(EXPORTS)
        errors: list[BaseException] = []

        def place(tmp: Path, out: Path, start: threading.Barrier, errors: list) -> None:
            start.wait()
            try:
                _commit(tmp, out, ours, set())
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=place, args=(t, out, start, errors)) for t in temps]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        assert errors == [], attempt
        contents = {p.name: p.read_text() for p in out.iterdir()}
        assert set(contents) == ours
        assert len({text.rsplit(" ", 1)[1] for text in contents.values()}) == 1  # one export


# --------------------------------------------------------------------------- re-exports


def _export(out: Path, fmt: str, cache: Any) -> gb.ExportArtifacts:
    model, samples = convnet.build()
    return gb.export(
        model,
        samples,
        out,
        "net",
        format=fmt,
        options=gb.QnnOnnxOptions(quantizer="w8a8", calibration=convnet.calibration()),
        cache=cache,
    )


def _listed(out: Path) -> set[str]:
    """The files of the output directory, folders' files as ``folder/name``."""
    return {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}


def _htp_unavailable() -> str:
    """Why QNN's HTP backend cannot prepare a context here (the ``context`` format's), or ""."""
    from graphbuild.targets.qnn.htp_runtime import availability

    found = availability()
    return "" if found.available else found.reason


@pytest.mark.skipif(bool(_htp_unavailable()), reason=_htp_unavailable() or "available")
@pytest.mark.parametrize("cached", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize(("first", "then"), [("context", "onnx")])
def test_a_re_export_in_another_format_leaves_only_the_current_export(
    tmp_path, cached, first, then
):
    """The output directory holds exactly the current export: the files an earlier export
    of it placed (its lock lists them) and this one does not are removed as the new files
    are placed (a stale ``_ctx_qnn.bin`` beside an ``onnx`` export is easy to ship), with
    or without the cache's placement stamp; a file graphbuild never wrote is left alone."""
    out = tmp_path / "out"
    cache = tmp_path / "cache" if cached else False
    before = _export(out, first, cache)
    (out / "NOTES.txt").write_text("the user's own file")
    old = set(json.loads((out / LOCK_FILE).read_text())["files"])
    after = _export(out, then, cache)
    new = set(json.loads((out / LOCK_FILE).read_text())["files"])
    assert old - new, f"{first} and {then} place the same files: the test shows nothing"
    assert _listed(out) == new | {LOCK_FILE, "NOTES.txt"}
    assert (out / "NOTES.txt").read_text() == "the user's own file"
    assert set(after.files) - {"lock"} and before.files


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "file-by-file"])
def test_a_folder_of_the_new_export_replaces_the_old_whole_and_stale_entries_go(
    tmp_path, monkeypatch, exchange
):
    """Placing, atomically (``renameat2``) or entry by entry: the export's folder is
    replaced whole, the earlier export's files it does not place go, others stay."""
    if not exchange:
        monkeypatch.setattr(placement, "_exchange", None)
    elif placement._exchange is None:
        pytest.skip("no renameat2 on this platform")
    out = tmp_path / "out"
    (out / "cpu").mkdir(parents=True)
    (out / "cpu" / "a.onnx").write_text("old a")
    (out / "cpu" / "b.onnx").write_text("old b of another split")
    (out / "old_ctx_qnn.bin").write_text("an earlier format's file")
    (out / "NOTES.txt").write_text("the user's")
    tmp = tmp_path / ".out.1.tmp"
    (tmp / "cpu").mkdir(parents=True)
    (tmp / "cpu" / "a.onnx").write_text("new a")
    (tmp / LOCK_FILE).write_text("lock")
    _commit(tmp, out, {"cpu/a.onnx", LOCK_FILE}, {"cpu/b.onnx", "old_ctx_qnn.bin"})
    assert _listed(out) == {"cpu/a.onnx", LOCK_FILE, "NOTES.txt"}
    assert (out / "cpu" / "a.onnx").read_text() == "new a"
