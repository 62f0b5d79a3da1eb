"""The output directory, checked before anything runs: can the files be placed there?

Placing writes a temporary directory beside the output directory and moves it in, so a
directory that is a file, on a read-only file system or inside one this user may not enter
fails only after every stage ran, with an errno and an internal file name. Checked first, it
is a sentence naming the directory and what to do. Nothing here imports torch: the command
line checks the directory before it loads the model.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from graphbuild.cache.access import why_unwritable
from graphbuild.errors import ExportError

__all__ = ["LOCK_FILE", "check_output_directory"]

LOCK_FILE = "graphbuild.lock.json"


def check_output_directory(out_dir: Path, model_name: str | None = None) -> None:
    """Refuse, before any stage runs, an output directory the files could not be placed in:
    a file, a path through a file, or a place this user cannot write (a read-only file
    system, another user's directory). The files are written into a temporary directory
    beside ``out_dir`` and moved in, so that is what is probed (and ``out_dir`` itself when it
    is a mount point, whose files are then replaced one by one).

    An output directory holds one model: its ``graphbuild.lock.json`` lists that model's
    files. Exporting ``model_name`` into a directory whose lock names another model would
    replace that lock and leave the other model's files unlisted, so it is refused too."""
    _check_lock_owner(out_dir, model_name)
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise ExportError(
                f"the output directory {out_dir} is a file; give a directory (output_dir, "
                "--output-dir) that does not exist yet or holds graphbuild's files"
            )
        existing = out_dir.absolute().parent
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise ExportError(
                f"cannot create the output directory {out_dir}: {existing} is a file, not a "
                "directory"
            )
        mount = out_dir.is_dir() and os.path.ismount(out_dir)
        for where in [existing] + ([out_dir] if mount else []):
            os.rmdir(tempfile.mkdtemp(prefix=".graphbuild-probe.", dir=where))
    except OSError as err:
        raise ExportError(
            f"cannot write the output directory {out_dir}: {why_unwritable(err, out_dir)}; "
            "give a directory you can write (output_dir, --output-dir)"
        ) from None


def _check_lock_owner(out_dir: Path, model_name: str | None) -> None:
    try:
        lock = json.loads((out_dir / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return  # no lock (or an unreadable one, which the export replaces)
    owner = lock.get("model_name") if type(lock) is dict else None
    if model_name is None or type(owner) is not str or owner == model_name:
        return
    shown = owner if len(owner) <= 80 else owner[:77] + "..."
    raise ExportError(
        f"{out_dir} holds the export of model {shown!r} ({LOCK_FILE} lists its files); an "
        f"output directory holds one model's export, and exporting {model_name!r} there would "
        f"leave the files of {shown!r} unlisted. Export {model_name!r} into another directory "
        f"(output_dir, --output-dir), or delete {out_dir / LOCK_FILE} to replace that export"
    )
