"""The ``graphbuild`` command line."""

from graphbuild.cli.app import app, main

__all__ = ["app", "main"]
