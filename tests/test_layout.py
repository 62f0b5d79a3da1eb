"""The folder layout is the architecture: imports point down only.

Tiers, bottom to top: errors, compat, hashing (byte digests) and version; cache (bytes and
manifests) and quant (the quant map and marker, the interface between front ends and
formats); engine (the build engine: keys, codecs, the scheduler, the artifact-aware Cache);
the torch.export front end (frontend) and the ONNX format (onnx), which know nothing of each
other; targets and output placement; api (the export request); config (a file that describes
one, and the one function that turns it into a request); sweeps (many exports as one build);
the command line; the package's top. A
module imports its own part of graphbuild or a lower tier, never a peer of its own tier.
"""

from __future__ import annotations

import ast
import functools
import itertools
from pathlib import Path

import networkx as nx
import pytest

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
    "onnx": 3,
    "targets": 4,
    "output": 4,
    "api": 5,
    "config": 6,
    "sweeps": 7,
    "cli": 8,
    "__init__": 9,
    "__main__": 9,
}

#: Modules may be longer than this only when their docstring has a line starting with
#: ``Size:`` that says why.
MAX_LINES = 600
SIZE_REASON = "Size:"

#: Modules over MAX_LINES without a stated reason that another change is already reworking:
#: each entry names the change. An entry for a module that no longer needs it fails.
SIZE_PENDING: dict[str, str] = {}


def _part(module: str) -> str:
    """The top-level part of graphbuild a dotted module name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@functools.cache
def _imports(path: Path) -> tuple[tuple[int, str], ...]:
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
    return tuple(found)


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts)


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _cross_imports() -> list[tuple[str, str, str]]:
    """(importing part, imported part, where) for every import between two parts."""
    found = []
    for path in _modules():
        own = _part(_module_name(path))
        for line, module in _imports(path):
            if module != "graphbuild" and _part(module) != own:
                where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
                found.append((own, _part(module), where))
    return found


def test_every_graphbuild_module_belongs_to_a_tier() -> None:
    unknown = {_part(_module_name(p)) for p in _modules() if _part(_module_name(p)) not in TIERS}
    assert not unknown, f"add these parts of graphbuild to TIERS: {sorted(unknown)}"


_UPWARD_PAIRS = [
    (low, high)
    for low, high in itertools.permutations(TIERS, 2)
    if TIERS[low] <= TIERS[high] and not {low, high} <= {"__init__", "__main__"}
]


@pytest.mark.parametrize(
    ("part", "other"), _UPWARD_PAIRS, ids=[f"{a}-{b}" for a, b in _UPWARD_PAIRS]
)
def test_a_part_imports_nothing_from_its_own_tier_or_above(part: str, other: str) -> None:
    """For every pair of parts (cache and engine included): the lower one, or either of two
    peers, imports nothing from the other."""
    upward = [
        where for own, imported, where in _cross_imports() if (own, imported) == (part, other)
    ]
    assert not upward, f"{part} (tier {TIERS[part]}) imports {other} (tier {TIERS[other]}):\n" + (
        "\n".join(upward)
    )


def test_the_package_import_graph_has_no_cycle() -> None:
    graph = nx.DiGraph()
    graph.add_nodes_from(TIERS)
    for own, imported, _ in _cross_imports():
        graph.add_edge(own, imported)
    cycles = list(itertools.islice(nx.simple_cycles(graph), 5))
    assert not cycles, f"import cycles between parts of graphbuild: {cycles}"


def test_the_cache_holds_bytes_and_knows_no_artifact() -> None:
    """cache/ stores bytes and manifests: nothing there decodes an artifact or knows who
    made it."""
    found = [
        where
        for own, imported, where in _cross_imports()
        if own == "cache" and imported in {"engine", "frontend", "onnx", "targets", "quant"}
    ]
    assert not found, "cache/ imports what makes or reads artifacts:\n" + "\n".join(found)


def test_engine_knows_no_torch_export_onnx_or_target() -> None:
    for path in (PACKAGE / "engine").rglob("*.py"):
        for line, module in _imports(path):
            assert _part(module) in {"engine", "cache", "errors", "hashing"}, (
                f"{path}:{line} {module}"
            )


def _over_the_limit() -> dict[str, int]:
    """Modules longer than MAX_LINES, by path under the package, with their lengths."""
    out = {}
    for path in _modules():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            out[path.relative_to(PACKAGE).as_posix()] = lines
    return out


def test_no_module_is_over_the_size_limit_without_a_stated_reason() -> None:
    unexplained = []
    for rel, lines in _over_the_limit().items():
        doc = ast.get_docstring(ast.parse((PACKAGE / rel).read_text())) or ""
        stated = any(line.strip().startswith(SIZE_REASON) for line in doc.splitlines())
        if not stated and rel not in SIZE_PENDING:
            unexplained.append(f"{rel}: {lines} lines")
    assert not unexplained, (
        f"modules over {MAX_LINES} lines: split them by job, or say why not in a docstring "
        f"line starting '{SIZE_REASON}':\n" + "\n".join(unexplained)
    )


def test_the_size_exemptions_are_still_needed() -> None:
    over = _over_the_limit()
    stale = [rel for rel in SIZE_PENDING if rel not in over]
    assert not stale, f"remove from SIZE_PENDING (no longer over {MAX_LINES} lines): {stale}"


# Where a target's names may appear: its own package, the registry that lists the built-ins,
# and the package's lazy re-exports.
_TARGET_HOMES = {
    "qnn": ("targets/qnn/", "targets/registry.py", "__init__.py"),
    "executorch": ("targets/executorch/", "targets/registry.py", "__init__.py"),
    "gguf": ("targets/gguf/", "targets/registry.py", "__init__.py"),
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


def test_no_target_flag_outside_the_targets_own_package() -> None:
    """A target declares its ``graphbuild export`` flags (``Target.export_flags``): the
    command line reads them from there and spells none (no ``--check-htp``, ``check_htp``)."""
    from graphbuild.targets.registry import get_target

    found = []
    for target, homes in _TARGET_HOMES.items():
        flags = get_target(target).export_flags
        spelled = {f"--{f.name}" for f in flags} | {f.option for f in flags}
        spelled |= {f.name for f in flags} | {f"options.{f.option}" for f in flags}
        for path in sorted(PACKAGE.rglob("*.py")):
            rel = path.relative_to(PACKAGE).as_posix()
            if rel.startswith(homes):
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, text in _code_strings_and_names(tree):
                if any(word in text for word in spelled):
                    found.append(f"{rel}:{line}: {text!r}")
    assert not found, "target flags outside their target's package:\n" + "\n".join(found)


# The QNN target's package: its modules in folders by concern, each short enough to read whole,
# and no import cycle among the targets' modules.
QNN = PACKAGE / "targets" / "qnn"
#: ``__init__.py`` and ``options.py`` at the top of targets/qnn, everything else in folders
QNN_TOP_LEVEL_MODULES = 10
#: No exemption here: a longer module of targets/qnn is split by job.
QNN_MAX_LINES = 400


def test_the_qnn_target_keeps_its_modules_in_folders() -> None:
    top = sorted(p.name for p in QNN.glob("*.py"))
    assert len(top) <= QNN_TOP_LEVEL_MODULES, (
        f"targets/qnn holds {len(top)} modules at its top level (at most "
        f"{QNN_TOP_LEVEL_MODULES}): move them into the folder of their concern: {top}"
    )


def test_no_qnn_module_is_over_its_line_limit() -> None:
    long = {
        path.relative_to(PACKAGE).as_posix(): n
        for path in sorted(QNN.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > QNN_MAX_LINES
    }
    assert not long, f"targets/qnn modules over {QNN_MAX_LINES} lines: split them by job: {long}"


def _targets_import_graph() -> nx.DiGraph:
    """Modules under targets/ and the edges of every import statement between them: lazy ones
    in functions and ``if TYPE_CHECKING:`` ones included. ``from pkg import name`` points at
    the module ``pkg.name`` where there is one, else at ``pkg``."""
    modules = {}
    for path in sorted((PACKAGE / "targets").rglob("*.py")):
        name = _module_name(path)
        modules[name.removesuffix(".__init__")] = path
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                imported = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            else:
                continue
            graph.add_edges_from((name, m) for m in imported if m in modules and m != name)
    return graph


def test_no_import_cycle_between_the_targets_modules() -> None:
    cycles = list(itertools.islice(nx.simple_cycles(_targets_import_graph()), 5))
    assert not cycles, (
        "import cycles between modules under targets/ (imports in functions and for type "
        "checking count): move the shared code to the module it belongs to:\n"
        + "\n".join(" -> ".join([*c, c[0]]) for c in cycles)
    )


def test_no_part_names_a_module_above_it_in_a_string() -> None:
    """An import by a dotted string is an import: a lower part that names a higher part's
    module in code (``import_module("graphbuild.onnx.codecs")``) depends on it as much as
    an import statement would. Codecs a layer loads lazily are declared by that layer."""
    found = []
    for path in _modules():
        own = _part(_module_name(path))
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, text in _code_strings_and_names(tree):
            if not text.startswith("graphbuild."):
                continue
            other = _part(text)
            if other in TIERS and other != own and TIERS[other] >= TIERS[own]:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {text!r}")
    assert not found, "modules named by string from below:\n" + "\n".join(found)
