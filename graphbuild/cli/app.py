"""The command line: ``graphbuild export | status | explain | graph | targets | sweep |
cache ...``.

One module per command group (``export``, ``status`` with ``explain``, ``graph`` with
``targets``, ``sweep``, ``cache``); this module assembles them into one Typer application. Library code
raises typed errors and :mod:`graphbuild.cli.errors` alone turns them into messages and exit
codes. ``--json`` on every command prints exactly one JSON document to stdout, errors included.
Torch and the export machinery are imported only by the commands that need them, so
``graphbuild cache ...`` starts quickly.
"""

from __future__ import annotations

import os

import typer

from graphbuild.cli import cache, export, generate, graph, status, sweep
from graphbuild.cli.output import debug_enabled, human_size, parse_age, parse_size
from graphbuild.cli.progress import Progress

__all__ = ["Progress", "app", "human_size", "main", "parse_age", "parse_size"]

app = typer.Typer(
    name="graphbuild",
    help="Incremental, content-addressed export of quantized PyTorch models.\n\n"
    "export, status, explain and graph run on a build server that keeps torch and built "
    "models warm: graphbuild server status|stop looks after it, and --no-server runs a "
    "command in this process.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command(cls=export.ExportCommand)(export.export)
app.command()(status.status)
app.command()(status.explain)
app.command()(graph.graph)
app.command()(graph.targets)
app.command()(sweep.sweep)
app.command()(generate.generate)
app.add_typer(cache.cache_app, name="cache")


def quiet_libraries() -> None:
    """torch, torchao and onnxscript print deprecation notes and optional-package warnings
    that say nothing about the user's export; GRAPHBUILD_DEBUG=1 shows them."""
    if debug_enabled():
        return
    import logging
    import warnings

    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings(
            "ignore", category=category, module=r"(torch|torchao|onnx|onnxscript|copyreg)"
        )
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for name in ("torchao", "onnxscript"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main() -> None:
    """Console-script entry point (``graphbuild``, ``python -m graphbuild``)."""
    quiet_libraries()
    app(prog_name="graphbuild")
