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


def _token_ids(text: str, bundle: Path) -> tuple[list[int], bool]:
    """The prompt's token ids, and whether it was text (encoded by the bundle's tokenizer)."""
    from graphbuild.targets.qnn.llm.tokenizer import TOKENIZER, encode

    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        if (bundle / TOKENIZER).is_file():
            return encode(bundle, text), True
        raise ConfigError(
            f"--prompt takes token ids (integers), not {text!r}: the bundle holds no "
            f"{TOKENIZER} to encode text with"
        ) from None
    if not ids:
        raise ConfigError("--prompt needs at least one token id")
    return ids, False


@handles_errors
def generate(
    bundle: Annotated[
        Path, typer.Argument(help="A bundle folder: an llm export's cpu/ (genai_config.json).")
    ],
    prompt: Annotated[
        str,
        typer.Option(
            "--prompt",
            "-p",
            help="Prompt token ids, e.g. '5 17 33' or 5,17,33; text where the bundle holds "
            "tokenizer.json.",
        ),
    ],
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Tokens to generate.")] = 16,
    as_json: JsonOpt = False,
) -> None:
    """Generate greedily from a prompt with onnxruntime-genai (the llm extra): token ids, or
    text where the bundle holds its tokenizer (the text generated is printed then)."""
    from graphbuild.targets.qnn.llm.generate import generate as run
    from graphbuild.targets.qnn.llm.tokenizer import decode

    ids, is_text = _token_ids(prompt, bundle)
    result = run(bundle, ids, tokens)
    text = decode(bundle, result.tokens) if is_text else None
    if as_json:
        out = {"tokens": result.tokens, "stopped": result.stopped, "runtime": result.genai_version}
        emit_json(out if text is None else {**out, "text": text})
        return
    typer.echo(text if text is not None else " ".join(str(t) for t in result.tokens))
