"""The repository's documents are its own: every citation resolves inside it.

Code, tests and the README cite the design by ``docs/design.md, invariant N``. A citation of a
file outside the repository (the old out-of-tree design file, a sibling checkout, an absolute
path on one machine) dangles in every clone; so does ``docs/<name>.md`` for a file that is not
there, or an invariant number the design does not have.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"

#: Strings no tracked file may hold: each names something outside the repository. Spelled in
#: pieces so that this file does not hold them itself.
FORBIDDEN = ("DESIGN" + ".md", ".." + "/shared", "/" + "work/")

#: Directories a checkout without git metadata is walked without.
_SKIPPED_DIRS = {".git", ".venv", "venv", "__pycache__", "build", "dist", "node_modules"}

_DOC_CITATION = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)\b")
_INVARIANT_CITATION = re.compile(
    r"\binvariants?\s+(\d+(?:\s*(?:,|and|or|-)\s*\d+)*)", re.IGNORECASE
)
_SECTION_CITATION = re.compile(r'docs/design\.md,\s+"([^"]+)')


def _tracked_files() -> list[Path]:
    """The files git tracks here, or, in a copy without git metadata, every file but caches
    and hidden directories."""
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout.decode()
        names = [n for n in listing.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = []
    if names:
        return [ROOT / n for n in names if (ROOT / n).is_file()]
    found = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d
            for d in dirs
            if d not in _SKIPPED_DIRS and not d.startswith(".") and not d.endswith(".egg-info")
        ]
        found += [Path(top) / f for f in files]
    return found


def _texts() -> dict[str, str]:
    """Each tracked text file's contents by path relative to the root (binary files left out)."""
    texts = {}
    for path in _tracked_files():
        try:
            texts[path.relative_to(ROOT).as_posix()] = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def _lines(texts: dict[str, str]):
    """(path, line number, line) for every line of every tracked text file. A citation may
    wrap across a line break, so each line is joined with the next one."""
    for rel, text in texts.items():
        lines = text.splitlines()
        for i, line in enumerate(lines):
            following = lines[i + 1] if i + 1 < len(lines) else ""
            yield rel, i + 1, line, f"{line} {following.strip()}"


def _invariant_numbers(design: str) -> set[int]:
    """The numbers of the invariants in the design's ``## Invariants`` section: headings
    (``### 5. ...``) or list items (``5. ...``)."""
    section = re.search(r"^## Invariants\s*$(.*?)(?=^## |\Z)", design, re.MULTILINE | re.DOTALL)
    assert section, "docs/design.md has no '## Invariants' section"
    return {
        int(m.group(1))
        for m in re.finditer(r"^(?:#{3,6}\s+)?(\d+)\.\s+\S", section.group(1), re.MULTILINE)
    }


def _headings(design: str) -> set[str]:
    return {
        m.group(1).strip().strip("`") for m in re.finditer(r"^#+\s+(.+)$", design, re.MULTILINE)
    }


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    return _texts()


def test_the_design_document_is_in_the_repository() -> None:
    assert DESIGN.is_file(), "docs/design.md is missing: code, tests and README cite it"


def test_the_invariants_are_numbered_one_to_n_without_a_gap() -> None:
    numbers = _invariant_numbers(DESIGN.read_text(encoding="utf-8"))
    assert numbers, "docs/design.md's Invariants section numbers no invariant"
    assert numbers == set(range(1, max(numbers) + 1)), (
        f"invariant numbers in docs/design.md skip some: {sorted(numbers)}"
    )


def test_no_file_cites_anything_outside_the_repository(texts: dict[str, str]) -> None:
    found = [
        f"{rel}:{n}: {line.strip()}"
        for rel, n, line, _ in _lines(texts)
        for bad in FORBIDDEN
        if bad in line
    ]
    assert not found, (
        "these lines cite files outside the repository; cite docs/design.md (or the document "
        "in docs/ that holds it) instead:\n" + "\n".join(found)
    )


def test_every_cited_document_exists(texts: dict[str, str]) -> None:
    missing = [
        f"{rel}:{n}: docs/{name}"
        for rel, n, line, _ in _lines(texts)
        for name in _DOC_CITATION.findall(line)
        if not (ROOT / "docs" / name).is_file()
    ]
    assert not missing, "citations of documents that are not in docs/:\n" + "\n".join(missing)


def test_every_cited_invariant_is_in_the_design(texts: dict[str, str]) -> None:
    known = _invariant_numbers(DESIGN.read_text(encoding="utf-8"))
    unknown = []
    cited = 0
    for rel, n, line, joined in _lines(texts):
        for match in _INVARIANT_CITATION.finditer(joined):
            if match.start() >= len(line):  # starts on the next line: counted there
                continue
            for number in map(int, re.findall(r"\d+", match.group(1))):
                cited += 1
                if number not in known:
                    unknown.append(f"{rel}:{n}: invariant {number}")
    assert cited, "no 'invariant N' citation found: is the pattern still right?"
    assert not unknown, (
        f"citations of invariants docs/design.md does not number (it has "
        f"{sorted(known)}):\n" + "\n".join(unknown)
    )


def test_every_cited_section_of_the_design_is_a_heading(texts: dict[str, str]) -> None:
    headings = _headings(DESIGN.read_text(encoding="utf-8"))
    missing = []
    for rel, n, line, joined in _lines(texts):
        for match in _SECTION_CITATION.finditer(joined):
            if match.start() >= len(line):
                continue
            title = match.group(1).strip()
            if not any(h == title or h.startswith(title) for h in headings):
                missing.append(f'{rel}:{n}: "{title}"')
    assert not missing, "citations of sections docs/design.md does not have:\n" + "\n".join(missing)
