"""Code counts by its syntax tree, not its text: an edited comment or docstring keeps every key
(the engine's own files, the files a stage reaches, the stage function itself), while an edited
line of code changes them."""

from __future__ import annotations

import importlib
import importlib.machinery
import shutil
import sys
from pathlib import Path

import pytest

import graphbuild
from graphbuild.engine import toolchain
from graphbuild.engine.fingerprint import function_files, stage_code_version
from graphbuild.engine.keying import Keys
from graphbuild.engine.pipeline import Pipeline
from graphbuild.engine.sources import source_code_digest

PACKAGE = Path(graphbuild.__file__).parent


@pytest.fixture
def engine_copy(tmp_path: Path) -> Path:
    """The engine's sources (and hashing.py beside them) under ``tmp_path/graphbuild``."""
    root = tmp_path / "graphbuild"
    shutil.copytree(PACKAGE / "engine", root / "engine", ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copy(PACKAGE / "hashing.py", root / "hashing.py")
    return root / "engine"


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} in {path}"
    path.write_text(text.replace(old, new))


def stage_key_under(engine: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The key of a one-stage pipeline when the engine's code is the one at ``engine``."""
    monkeypatch.setattr(toolchain, "_engine_digest", lambda: toolchain.engine_digest(engine))
    toolchain._tool_versions.cache_clear()
    try:
        pipeline = Pipeline(name="digest")
        pipeline.register_stage(constant, "constant", reads=())
        keys = Keys(pipeline, None, None, {}, None, "digest")
        keys.begin("constant")
        key = keys.compute_key("constant")
    finally:
        toolchain._tool_versions.cache_clear()
    assert key is not None
    return key


def constant(inputs, samples, ctx):
    return 1


def test_an_edited_comment_or_docstring_in_the_engine_keeps_every_key(engine_copy, monkeypatch):
    digest = toolchain.engine_digest(engine_copy)
    key = stage_key_under(engine_copy, monkeypatch)
    assert digest == toolchain.engine_digest(PACKAGE / "engine")  # the same code

    edit(engine_copy / "key.py", "one pure function of everything", "a pure function of all")
    edit(engine_copy / "scheduler.py", "# a hit: now, or once", "# hit (now, or once")
    edit(engine_copy / "rebuild.py", "\n\n__all__", "\n\n# reworded, then re-laid out\n__all__")

    assert toolchain.engine_digest(engine_copy) == digest
    assert stage_key_under(engine_copy, monkeypatch) == key

    edit(engine_copy / "key.py", "KEY_SCHEMA = 1", "KEY_SCHEMA = 2")

    assert toolchain.engine_digest(engine_copy) != digest
    assert stage_key_under(engine_copy, monkeypatch) != key


def test_an_edit_to_hashing_beside_the_engine_changes_its_digest(engine_copy):
    digest = toolchain.engine_digest(engine_copy)
    hashing = engine_copy.parent / "hashing.py"
    hashing.write_text(hashing.read_text() + "\n# a note\n")
    assert toolchain.engine_digest(engine_copy) == digest

    hashing.write_text(hashing.read_text() + "\nEXTRA = 1\n")
    assert toolchain.engine_digest(engine_copy) != digest


HELPER = '''"""A helper of a stage."""


def scale():
    """How much."""
    return 2  # the factor
'''

STAGE = '''from gb_digest_helper import scale


def stage(inputs, samples, ctx):
    """A stage."""
    # what it returns
    return scale()
'''


def test_a_stage_keys_on_the_code_of_what_it_reaches_not_its_comments(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    helper, stage = tmp_path / "gb_digest_helper.py", tmp_path / "gb_digest_stage.py"
    helper.write_text(HELPER)
    stage.write_text(STAGE)
    importlib.invalidate_caches()
    module = importlib.import_module("gb_digest_stage")
    monkeypatch.setitem(sys.modules, "gb_digest_stage", module)
    monkeypatch.setitem(sys.modules, "gb_digest_helper", sys.modules["gb_digest_helper"])
    files, version = function_files(module.stage), stage_code_version(module.stage)

    helper.write_text(HELPER.replace('"""How much."""', '"""The factor."""').replace("#", "# ~"))
    stage.write_text(STAGE.replace("# what it returns", "# its result").replace("A stage", "One"))
    module = importlib.reload(module)

    assert function_files(module.stage) == files
    assert stage_code_version(module.stage) == version

    helper.write_text(HELPER.replace("return 2", "return 3"))

    assert function_files(module.stage) != files
    assert stage_code_version(module.stage) != version

    stage.write_text(STAGE.replace("return scale()", "return -scale()"))
    module = importlib.reload(module)
    helper.write_text(HELPER)

    assert function_files(module.stage) != files
    assert stage_code_version(module.stage) != version


def test_code_digest_is_of_the_tree_without_docstrings():
    base = source_code_digest('"""Doc."""\nX = 1\n\n\ndef f():\n    """Doc."""\n    return X\n')

    assert source_code_digest("X = 1\ndef f():\n    return X  # no doc\n") == base
    assert source_code_digest("X = 1\ndef f():\n    return (X)\n") == base  # layout
    assert source_code_digest("X = 2\ndef f():\n    return X\n") != base
    assert source_code_digest("X = 1\ndef f():\n    'a value, not a docstring'\n") != base
    assert source_code_digest("X = 1\ndef f():\n    return X\n    'dead'\n") != base
    assert source_code_digest("X = '1'\ndef f():\n    return X\n") != base
    assert source_code_digest("def f(:\n") == source_code_digest(b"def f(:\n")  # its bytes


def _native_module(folder) -> Path:
    """A package outside site-packages (``pip install --target``, a vendored folder) whose
    ``native`` submodule is a compiled extension: the file only, never imported here."""
    package = folder / "gb_vendored"
    package.mkdir()
    (package / "__init__.py").write_text("from gb_vendored.native import scale\n")
    native = package / f"native{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    native.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(57))  # a shared object's header
    (folder / "gb_uses_vendored.py").write_text(
        "def stage():\n    import gb_vendored\n\n    return gb_vendored.scale\n"
    )
    return native


def test_a_compiled_module_outside_site_packages_keys_by_its_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    native = _native_module(tmp_path)
    importlib.invalidate_caches()
    module = importlib.import_module("gb_uses_vendored")
    monkeypatch.setitem(sys.modules, "gb_uses_vendored", module)
    monkeypatch.delitem(sys.modules, "gb_vendored", raising=False)

    files = function_files(module.stage)  # not parsed as Python source
    assert "gb_vendored.native" in files

    native.write_bytes(native.read_bytes() + b"\0")
    assert function_files(module.stage) != files
