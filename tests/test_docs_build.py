"""The manual builds: ``mkdocs build --strict`` over ``mkdocs.yml`` and ``docs/``.

Strict mode turns every warning into a failure: a page missing from the nav, a link to a page
or an anchor that is not there, a snippet (``bench/README.md``'s tables) that cannot be read.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed (pip install -e '.[dev]')",
)
def test_the_manual_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    pages = {p.parent.name for p in site.glob("*/index.html")}
    documents = {p.stem for p in (ROOT / "docs").glob("*.md")} - {"index"}
    assert documents <= pages, f"pages not built: {sorted(documents - pages)}"
    performance = (site / "performance" / "index.html").read_text(encoding="utf-8")
    assert "ci-2core" in performance, "bench/README.md's tables are not in the performance page"
