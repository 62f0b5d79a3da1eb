"""The folder layout is the architecture: imports point down only.

Tiers, bottom to top: errors; engine and cache (the build engine and its store); the torch.export
front end (export) and the ONNX format (onnx, which reads the front end's quant map); targets and
output placement; api and config; the command line. A module may import its own tier or below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import graphbuild

PACKAGE = Path(graphbuild.__file__).parent

TIERS = {
    "errors": 0,
    "compat": 0,
    "engine": 1,
    "cache": 1,
    "frontend": 2,
    "onnx": 3,
    "targets": 4,
    "output": 4,
    "api": 5,
    "config": 5,
    "cli": 6,
    "__init__": 7,
    "__main__": 7,
}


def _part(module: str) -> str:
    """The top-level part of graphbuild a dotted module name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            yield from (n for child in node.orelse for n in ast.walk(child))
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every graphbuild import that runs in ``path``, lazy ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "graphbuild":
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("graphbuild")]
    return found


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts)


def test_every_graphbuild_module_belongs_to_a_tier() -> None:
    unknown = {
        _part(_module_name(p)) for p in PACKAGE.rglob("*.py") if _part(_module_name(p)) not in TIERS
    }
    assert not unknown, f"add these parts of graphbuild to TIERS: {sorted(unknown)}"


def test_imports_point_down_only() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = _part(_module_name(path))
        for line, module in _imports(path):
            if module == "graphbuild":
                continue
            if TIERS[_part(module)] > TIERS[own]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_engine_knows_no_torch_export_onnx_or_target() -> None:
    for path in (PACKAGE / "engine").rglob("*.py"):
        for line, module in _imports(path):
            assert _part(module) in {"engine", "cache", "errors"}, f"{path}:{line} {module}"
