"""``graphbuild generate``: greedy generation with an llm export's onnxruntime-genai bundle."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphbuild.cli.errors import handles_errors
from graphbuild.cli.options import JsonOpt
from graphbuild.cli.output import emit_json
from graphbuild.errors import ConfigError

__all__ = ["generate"]


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ConfigError(f"--prompt takes token ids (integers), not {text!r}") from None
    if not ids:
        raise ConfigError("--prompt needs at least one token id")
    return ids


@handles_errors
def generate(
    bundle: Annotated[
        Path, typer.Argument(help="A bundle folder: an llm export's cpu/ (genai_config.json).")
    ],
    prompt: Annotated[
        str, typer.Option("--prompt", "-p", help="Prompt token ids, e.g. '5 17 33' or 5,17,33.")
    ],
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Tokens to generate.")] = 16,
    as_json: JsonOpt = False,
) -> None:
    """Generate greedily from a prompt of token ids with onnxruntime-genai (the llm extra)."""
    from graphbuild.targets.qnn.llm.generate import generate as run

    result = run(bundle, _token_ids(prompt), tokens)
    if as_json:
        emit_json(
            {"tokens": result.tokens, "stopped": result.stopped, "runtime": result.genai_version}
        )
        return
    typer.echo(" ".join(str(t) for t in result.tokens))
