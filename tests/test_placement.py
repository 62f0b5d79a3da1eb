"""Placing outputs: several exports into one new output directory at once all succeed, and
the directory holds one whole export."""

from __future__ import annotations

import threading
from pathlib import Path

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
