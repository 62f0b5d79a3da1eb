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
    "hashing": 0,
    "version": 0,
    "cache": 1,
    "quant": 1,
    "engine": 2,
    "frontend": 3,
    "onnx": 4,
    "targets": 5,
    "output": 5,
    "api": 6,
    "config": 6,
    "cli": 7,
    "__init__": 8,
    "__main__": 8,
}


def _part(module: str) -> str:
    """The top-level part of graphbuild a dotted module name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every graphbuild import in ``path``: lazy ones and those for type
    annotations only (``if TYPE_CHECKING:``) included, since both are dependencies."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
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
            assert _part(module) in {"engine", "cache", "errors", "hashing"}, (
                f"{path}:{line} {module}"
            )


# Where a target's names may appear: its own package, the registry that lists the built-ins,
# and the package's lazy re-exports.
_TARGET_HOMES = {
    "qnn": ("targets/qnn/", "targets/registry.py", "__init__.py"),
    "executorch": ("targets/executorch/", "targets/registry.py", "__init__.py"),
}


def _code_strings_and_names(tree: ast.AST):
    """Identifiers and string constants of ``tree``, docstrings left out (prose may say QNN)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.alias):
            yield node.lineno, node.name
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            yield node.lineno, node.value


def test_no_target_names_outside_the_targets_own_package() -> None:
    """config, api, CLI and the engine take everything target-specific from the Target."""
    found = []
    for target, homes in _TARGET_HOMES.items():
        for path in sorted(PACKAGE.rglob("*.py")):
            rel = path.relative_to(PACKAGE).as_posix()
            if rel.startswith(homes):
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, text in _code_strings_and_names(tree):
                lower = text.lower()
                if (
                    lower == target
                    or lower.startswith((f"{target}_", f"{target}/", f"{target}:"))
                    or (text[:1].isupper() and lower.startswith(target))  # QnnX, ExecuTorchX
                    or f"targets.{target}" in text
                ):
                    found.append(f"{rel}:{line}: {text!r}")
    assert not found, "target names outside their package:\n" + "\n".join(found)
