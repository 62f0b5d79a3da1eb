"""The README's two commands pass in a fresh virtual environment: after ``pip install -e
".[dev]"``, a test that needs an optional extra skips and says which one.

Read from the test files themselves: every ``pytest.importorskip`` gives its reason, and no
test module imports an optional extra at module level before skipping without it. (Tests that
reach an extra through graphbuild, as the key-stability zoo reaches ExecuTorch, check
``importlib.util.find_spec`` themselves.)
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

TESTS = Path(__file__).resolve().parent

#: Top-level packages of the optional extras (pyproject.toml) and other tools tests may use;
#: the dev extra (transformers, redis, hypothesis, gguf, tokenizers) is installed with pytest.
OPTIONAL = {
    "executorch",  # executorch, vgf
    "tosa_tools",  # vgf
    "aimet_onnx",  # interop
    "aimet_common",
    "aimet_torch",
    "onnxruntime_qnn",  # htp
    "llama_cpp",  # llama-cpp
    "fastforward",
}


@functools.cache
def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), filename=str(p))) for p in sorted(TESTS.glob("*.py"))]


def _importorskips(tree: ast.AST) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "importorskip"
    ]


def test_every_importorskip_gives_its_reason():
    silent = [
        f"{path.name}:{call.lineno}"
        for path, tree in _modules()
        for call in _importorskips(tree)
        if not any(k.arg == "reason" for k in call.keywords)
    ]
    assert silent == []


def test_no_test_module_imports_an_optional_extra_before_skipping_without_it():
    unguarded = []
    for path, tree in _modules():
        skipped: set[str] = set()
        for statement in tree.body:  # module level, in order
            for call in _importorskips(statement):
                if call.args and isinstance(call.args[0], ast.Constant):
                    skipped.add(str(call.args[0].value).split(".")[0])
            names = []
            if isinstance(statement, ast.Import):
                names = [alias.name for alias in statement.names]
            elif isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
                names = [statement.module]
            for name in names:
                top = name.split(".")[0]
                if top in OPTIONAL and top not in skipped:
                    unguarded.append(f"{path.name}:{statement.lineno} imports {name}")
    assert unguarded == []
