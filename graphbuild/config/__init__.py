"""``graphbuild.toml`` / ``[tool.graphbuild]`` loading and validation.

The configuration names what to export (a model factory, its sample inputs and calibration
batches), how (target, format, quantization, the target's options) and where (output and cache
directories). It is found from the working directory upward: in each directory a
``graphbuild.toml`` wins over a ``pyproject.toml`` with a ``[tool.graphbuild]`` table, and the
first directory with either wins. Relative paths in it are relative to its own directory.

Loading only parses and validates; nothing is imported until :meth:`Config.load_model`, so
``graphbuild cache ...`` and ``graphbuild --help`` stay quick. Every problem is a
:class:`~graphbuild.errors.ConfigError` that names the key, what was expected and what was
found; only the CLI turns it into an exit code.

One job a module: ``files`` (finding and reading the file), ``schema`` (keys and types),
``overrides`` (``--set``), ``specs`` (``module:attr`` strings to objects) and ``settings``
(:class:`Config` and :func:`load_config`), ``request`` (:func:`export_request`, a config made
into an export request); the public names are re-exported here.
"""

from graphbuild.config.files import CONFIG_FILE, PYPROJECT, find_config
from graphbuild.config.overrides import parse_override
from graphbuild.config.request import export_request
from graphbuild.config.settings import DEFAULT_OUTPUT_DIR, Config, load_config

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_OUTPUT_DIR",
    "PYPROJECT",
    "Config",
    "export_request",
    "find_config",
    "load_config",
    "parse_override",
]
