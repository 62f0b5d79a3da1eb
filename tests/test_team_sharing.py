"""One cache for a whole team (docs/design.md, invariant 10): clones of the project at different
paths, a second user and a second build of the same Python minor version share one local
cache directory and one Redis server, and every export after the first is all hits with
byte-identical files.

The second build is another interpreter of this minor version found on the machine (Debian's
``/usr/bin/python3.11`` beside a pyenv 3.11.7, say) running on this environment's
site-packages; where there is none, this interpreter with the build's own strings changed
(``sys.version``, ``sys.version_info``'s micro release), and the test says so. The second user
is another uid in the cache directory's group (``setpriv``, as root); where that cannot be
done, the same user, and the test says so.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
GROUP, SECOND_USER = 61000, 61011

CONFIG = """\
model = "examples/tiny_decoder.py:build"
calibration = "examples/tiny_decoder.py:calibration"
model_name = "tiny"
output_dir = "out"

[quantization]
preset = "w8a16"
"""

# a build of this Python with other build strings: what a second build differs in
SIMULATED_BUILD = """\
import collections, sys
v = sys.version_info
sys.version = f"{v.major}.{v.minor}.{v.micro + 3} (simulated, Jan  1 2020, 00:00:00) [Clang 9.0]"
sys.version_info = collections.namedtuple(
    "version_info", "major minor micro releaselevel serial"
)(v.major, v.minor, v.micro + 3, "final", 0)
"""


def clone(where: Path, owner: tuple[int, int] | None = None) -> Path:
    """A checkout of the project at ``where``: its graphbuild.toml names the example by a
    path relative to it, as a repository's would."""
    where.mkdir(parents=True)
    shutil.copytree(
        ROOT / "examples", where / "examples", ignore=shutil.ignore_patterns("__pycache__")
    )
    (where / "graphbuild.toml").write_text(CONFIG)
    if owner is not None:
        for path in [where, *where.rglob("*")]:
            os.chown(path, *owner)
    return where


def _site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def _version_of(python: str, env: dict[str, str]) -> str | None:
    probe = "import sys, torch, redis, graphbuild; print(sys.version)"
    try:
        done = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, env=env, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def second_build(base: Path) -> tuple[str, dict[str, str], str]:
    """(interpreter, PYTHONPATH entries after the repository, what it is)."""
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [
        f"/usr/bin/python{minor}",
        f"/usr/local/bin/python{minor}",
        *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{minor}.*/bin/python{minor}"))),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), _site_packages()])}
    for python in candidates:
        if not os.path.exists(python):
            continue
        version = _version_of(python, env)
        if version and version != sys.version and version.startswith(minor + "."):
            return python, {"PYTHONPATH": env["PYTHONPATH"]}, f"{python} ({version.split()[0]})"
    sim = base / "simulated-build"
    sim.mkdir()
    (sim / "sitecustomize.py").write_text(SIMULATED_BUILD)
    path = os.pathsep.join([str(sim), str(ROOT)])
    return sys.executable, {"PYTHONPATH": path}, "simulated: this interpreter, other build strings"


def second_user(base: Path, python: str, env: dict[str, str]) -> tuple[list[str], str]:
    """(command prefix that runs as another member of the cache's group, what it is)."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        return [], "the same user (another needs root and setpriv)"
    prefix = [setpriv, f"--reuid={SECOND_USER}", f"--regid={GROUP}", f"--groups={GROUP}", "--"]
    probe = subprocess.run(
        [*prefix, python, "-c", "import torch, redis, graphbuild"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=base,
        timeout=120,
    )
    if probe.returncode != 0:
        return [], f"the same user (uid {SECOND_USER} cannot import this environment)"
    return prefix, f"uid {SECOND_USER}"


def export(
    prefix: list[str], python: str, env: dict[str, str], project: Path, cache: Path, url: str
) -> tuple[dict, dict[str, bytes]]:
    """``graphbuild export`` in ``project``: (its --json report, the files it placed)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHBUILD_")}
    full.update(env, HOME=str(project.parent))
    proc = subprocess.run(
        [*prefix, python, "-m", "graphbuild", "export", "--cache-dir", str(cache),
         "--cache-url", url, "--json"],
        capture_output=True, text=True, env=full, cwd=project, timeout=600, umask=0o002,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = project / "out"
    return json.loads(proc.stdout), {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def statuses(doc: dict) -> set[str]:
    return {s["status"] for s in doc["stages"]}


def test_clones_a_second_user_and_a_second_python_build_share_one_cache_and_server(capsys):
    base = Path(tempfile.mkdtemp(prefix="gb-team-", dir="/tmp"))
    try:
        base.chmod(0o755)
        shared = base / "cache"  # the documented set-up: group-owned, set-group-ID, umask 002
        shared.mkdir()
        python, env, build = second_build(base)
        prefix, user = second_user(base, python, env)
        owner = (SECOND_USER, GROUP) if prefix else None
        if prefix:
            os.chown(shared, 0, GROUP)
            shared.chmod(0o2775)
        with capsys.disabled():
            print(f"\n  second Python build: {build}; second user: {user}")
        here = {"PYTHONPATH": str(ROOT)}
        with RedisServer() as url:
            first, placed = export(
                [], sys.executable, here, clone(base / "alice" / "work" / "proj"), shared, url
            )
            own = base / "carol-cache"  # her own local cache: the hits come from the server
            own.mkdir()
            if owner:
                os.chown(own, *owner)
            with ThreadPoolExecutor(2) as pool:  # two teammates at once
                bob = pool.submit(
                    export, prefix, python, env, clone(base / "b" / "proj", owner), shared, url
                )
                carol_clone = clone(base / "carol" / "x" / "y" / "proj", owner)
                carol = pool.submit(export, prefix, python, env, carol_clone, own, url)
                (second, second_files), (third, third_files) = bob.result(), carol.result()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    assert statuses(first) == {"ran"}
    assert statuses(second) == {"hit"}, second["stages"]
    assert statuses(third) == {"hit"}, third["stages"]
    assert second_files == placed and third_files == placed
    assert set(placed) == {"tiny.onnx", "tiny.encodings", "graphbuild.lock.json"}


def test_the_simulated_build_differs_from_this_one_in_its_strings_only(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(SIMULATED_BUILD))
    probe = "import sys; print(sys.version); print(list(sys.version_info[:3]))"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        timeout=60,
    )
    version, info = done.stdout.splitlines()
    assert version != sys.version and "simulated" in version
    assert json.loads(info)[:2] == list(sys.version_info[:2])
