"""Every example in the README and the manual runs as written, or says why it cannot.

Each ```python, ```bash and ```console block of ``README.md``, ``docs/*.md`` and
``bench/README.md`` is one test:

- a Python block is run as a script in a scratch copy of the repository's ``graphbuild.toml``
  and ``examples/``, with this checkout's graphbuild on ``PYTHONPATH`` and a cache of its own;
- a shell block (a ``bash`` block's lines, a ``console`` block's ``$`` lines) must consist of
  ``graphbuild ...`` commands, which run there one after another, each exiting 0;
- a block that cannot run in a test (it installs packages, needs an optional extra, a server
  or root, or continues another block) carries an HTML comment on the line above it,
  ``<!-- not run: why -->``; one that runs but takes minutes, ``<!-- slow: why -->``, and runs
  under ``pytest -m slow`` only.

A ```toml block must parse. The output lines of a transcript are not compared (they hold
timings); the commands must succeed in the state the page describes.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "bench" / "README.md",
]

#: The languages whose blocks are run, and the shell ones among them.
RUN_LANGUAGES = {"python", "bash", "console", "sh", "shell"}
SHELL_LANGUAGES = RUN_LANGUAGES - {"python"}

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not run|slow)\s*:\s*(?P<reason>.*?)\s*-->\s*$")

#: Seconds one block may take (a slow one runs several fresh processes that import torch).
TIMEOUT = 900


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None  # "not run", "slow" or None
    reason: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the marker on the line above it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, start = len(fence.group("indent")), i
        body = []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            i += 1
        i += 1  # the closing fence
        above = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        marker = _MARKER.match(above)
        found.append(
            Block(
                path,
                start + 1,
                fence.group("lang").lower(),
                "\n".join(body) + "\n",
                marker.group("kind") if marker else None,
                marker.group("reason") if marker else "",
            )
        )
    return found


def _all_blocks() -> list[Block]:
    return [b for path in DOCUMENTS if path.is_file() for b in _blocks(path)]


def shell_commands(block: Block) -> list[list[str]]:
    """The commands of a shell block as argument lists: a ``console`` block's ``$`` lines, a
    ``bash`` block's lines; backslash continuations joined, comments dropped."""
    raw: list[str | None] = list(block.text.splitlines())
    if block.lang == "console":  # a command is a "$ " line and the lines its backslashes join
        continued = False
        for i, line in enumerate(raw):
            if line.startswith("$ "):
                raw[i] = line[2:]
            elif not continued:
                raw[i] = None  # an output line of the transcript
            continued = raw[i] is not None and raw[i].rstrip().endswith("\\")
    commands, pending = [], ""
    for line in raw:
        if line is None:
            continue
        if pending:
            line = pending + " " + line.strip()
            pending = ""
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1]
            continue
        argv = shlex.split(line, comments=True)
        if argv:
            commands.append(argv)
    return commands


def _why_not_runnable(block: Block) -> str | None:
    """Why an unmarked block cannot be run as this module runs blocks (None: it can)."""
    if block.lang == "python":
        return None
    commands = shell_commands(block)
    if not commands:
        return "it holds no command, only output"
    others = sorted({argv[0] for argv in commands if argv[0] != "graphbuild"})
    if others or any(op in argv for argv in commands for op in ("&&", "||", "|", ";")):
        return f"it runs more than graphbuild commands ({', '.join(others) or 'a shell operator'})"
    return None


BLOCKS = [b for b in _all_blocks() if b.lang in RUN_LANGUAGES]


def test_the_documents_hold_runnable_blocks() -> None:
    """The parser finds the blocks: a pattern gone wrong would make every test below vacuous."""
    assert len(BLOCKS) >= 30
    assert any(b.marker is None and b.lang == "python" for b in BLOCKS)
    assert any(b.marker is None and b.lang in SHELL_LANGUAGES for b in BLOCKS)
    assert any(b.marker == "not run" for b in BLOCKS)


def test_every_block_that_does_not_run_says_why() -> None:
    """An unmarked block must be runnable here; a marker must give its reason."""
    problems = []
    for block in BLOCKS:
        if block.marker is None:
            why = _why_not_runnable(block)
            if why:
                problems.append(
                    f"{block.name}: the ```{block.lang} block cannot run here: {why}. Put "
                    "'<!-- not run: REASON -->' on the line above it (or make it a block of "
                    "graphbuild commands)"
                )
        elif len(block.reason.split()) < 2:
            problems.append(f"{block.name}: the marker '{block.marker}:' gives no reason")
        elif block.marker == "slow" and _why_not_runnable(block):
            problems.append(
                f"{block.name}: marked slow, so it must run, but {_why_not_runnable(block)}"
            )
    assert not problems, "\n".join(problems)


def test_every_toml_block_parses() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    blocks = [b for b in _all_blocks() if b.lang == "toml"]
    assert blocks
    for block in blocks:
        try:
            tomllib.loads(block.text)
        except tomllib.TOMLDecodeError as error:
            pytest.fail(f"{block.name}: the ```toml block does not parse: {error}")


def _workspace(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A scratch copy of what the examples read, and an environment that keeps every cache,
    output and home directory inside it."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy2(ROOT / "graphbuild.toml", work / "graphbuild.toml")
    shutil.copytree(
        ROOT / "examples", work / "examples", ignore=shutil.ignore_patterns("__pycache__")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHBUILD_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        GRAPHBUILD_CACHE_DIR=str(tmp_path / "cache"),
        HOME=str(tmp_path / "home"),
        NO_COLOR="1",
    )
    return work, env


def _check(result: subprocess.CompletedProcess, block: Block, what: str) -> None:
    assert result.returncode == 0, (
        f"{block.name}: {what} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    )


def _params(blocks: list[Block]) -> list:
    params = []
    for block in blocks:
        if block.marker == "not run" or _why_not_runnable(block):
            continue
        marks = [pytest.mark.slow] if block.marker == "slow" else []
        params.append(pytest.param(block, id=block.name, marks=marks))
    return params


@pytest.mark.parametrize("block", _params(BLOCKS))
def test_the_block_runs(block: Block, tmp_path: Path) -> None:
    work, env = _workspace(tmp_path)
    if block.lang == "python":
        script = work / "doc_block.py"
        script.write_text(block.text, encoding="utf-8")
        result = subprocess.run(
            [sys.executable, script.name],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        _check(result, block, "the Python block")
        return
    for argv in shell_commands(block):
        result = subprocess.run(
            [sys.executable, "-m", "graphbuild", *argv[1:]],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        _check(result, block, shlex.join(argv))
