"""Guards around a running stage: it reads only what it declared, and changes nothing it
was handed.

:class:`StageContext` is the ``context`` a stage receives, limited to its declared reads;
:func:`input_tokens` and :func:`check_inputs` take tokens of its inputs before it runs and
compare them after (docs/design.md, invariant 9).
"""

from __future__ import annotations

import marshal
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from graphbuild.engine.codecs import encode, snapshot
from graphbuild.engine.fingerprint import input_token
from graphbuild.errors import (
    InputMutationError,
    UndeclaredReadError,
)
from graphbuild.hashing import digest_bytes


class StageContext(Mapping[str, Any]):
    """The ``context`` a stage receives: the pipeline context, limited to what the stage
    declared it reads (an undeclared key raises :class:`UndeclaredReadError`).

    The first undeclared read is also kept in ``violation``: the scheduler fails the stage
    even when the stage caught the error (``UndeclaredReadError`` is a ``KeyError``, and
    ``except KeyError: default`` would otherwise turn it into a silent stale hit)."""

    def __init__(
        self,
        stage: str,
        values: Mapping[str, Any],
        allowed: set[str] | None,
        declared: tuple[str, ...],
        pipeline_input: Any = None,
        input_allowed: bool = False,
    ):
        self.stage = stage
        self._values = values
        self._allowed = allowed
        self._declared = declared
        self._input = pipeline_input
        self.input_allowed = input_allowed
        self.violation: UndeclaredReadError | None = None

    def _refuse(self, read: str) -> None:
        err = UndeclaredReadError(self.stage, read, self._declared)
        if self.violation is None:
            self.violation = err
        raise err

    def _check(self, key: str) -> None:
        if self._allowed is not None and key not in self._allowed:
            self._refuse(f"ctx.{key}")

    def __getitem__(self, key: str) -> Any:
        self._check(key)
        return self._values[key]

    def get(self, key: str, default: Any = None) -> Any:
        # Mapping.get would catch the KeyError an undeclared read raises
        self._check(key)
        return self._values.get(key, default)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        self._check(key)
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        allowed = self._allowed
        return iter([k for k in self._values if allowed is None or k in allowed])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @property
    def input(self) -> Any:
        """The pipeline input (the model); only for stages that declare an input read."""
        if not self.input_allowed:
            self._refuse("input")
        return self._input


@dataclass(frozen=True)
class InputToken:
    """What a stage was handed (an upstream output, the samples, the model) and a token of
    its contents before the stage ran."""

    source: str
    what: str
    value: Any
    token: Any


class Tokens:
    """Tokens of the values stages were handed in one run, as the last check left them.

    A value a stage handed back unchanged (its token taken after that stage, and equal to the
    one before) still has that token when a later stage is handed it: its "before" token is
    reused, and each stage pays one snapshot per input (the check after it) instead of two.
    The values are held, so an id is not reused while its token is kept. Under ``jobs > 1``
    stages that share an input may run at once: a stage that changes it is still caught, but
    the others that held it then see the change too, and whichever of them finishes first is
    the one named."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[Any, Any]] = {}

    def before(self, value: Any) -> Any:
        known = self._known.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        token = contents_token(value)
        self._known[id(value)] = (value, token)
        return token

    def after(self, value: Any) -> Any:
        token = contents_token(value)
        self._known[id(value)] = (value, token)
        return token

    def forget(self, values: Any) -> None:
        """Drop what is known of ``values``: a stage that failed may have changed them
        before it raised, unchecked, so the next stage handed one takes a token afresh."""
        for value in values:
            self._known.pop(id(value), None)


def contents_token(value: Any) -> Any:
    """A token of ``value``'s contents that changes when they change: the codec's snapshot,
    but a dict or list of plain data is read in one pass of ``marshal`` (C; it keeps tuples,
    key types and float bits apart; version 2 writes no back-references, so the bytes do not
    depend on reference counts) rather than walked in Python to pick its codec first: the
    large documents stages pass (placements, quant maps) cost a tenth."""
    kind = type(value)
    if kind is dict or kind is list:
        try:
            data = marshal.dumps(value, 2)
        except ValueError:
            pass  # holds tensors, programs...: per item below, or the codec's snapshot
        else:
            return ("plain", digest_bytes(data))
    if kind is tuple or kind is list:
        return (kind.__name__, [contents_token(v) for v in value])
    return snapshot(value)


def input_tokens(
    deps: list[str],
    inputs: Any,
    samples: Any,
    model: Any,
    model_allowed: bool,
    full: bool,
    tokens: Tokens | None = None,
) -> list[InputToken]:
    """Tokens of what a stage is handed and must not change, taken before it runs: its
    upstream outputs (their contents, bytes included), the sample inputs, and the model
    when the stage can reach it (cheaply: tensor identities and version counters; with
    ``full``, check mode, also a digest of every tensor). ``tokens`` reuses what the last
    check found of a value (:class:`Tokens`)."""
    take = (tokens or Tokens()).before
    out = [  # a root stage's inputs are the model itself
        InputToken(dep, f"the output of '{dep}'", value, take(value))
        for dep, value in zip(deps, inputs if deps else (), strict=True)
    ]
    out.append(InputToken("samples", "the sample inputs", samples, take(samples)))
    if not deps or model_allowed:
        out.append(InputToken("input", "the model", model, input_token(model, full=full)))
    return out


def check_inputs(
    name: str,
    before: list[InputToken],
    full: bool,
    recorded: Callable[[str], str | None],
    tokens: Tokens | None = None,
) -> None:
    """Inputs are read-only (docs/design.md, invariant 9): a stage that changed what it was
    handed in place fails, naming itself and what it changed. With ``full`` (check mode)
    every upstream output is also re-encoded and must still have the digest its upstream
    recorded (``recorded(stage)``). ``tokens`` keeps what each check found for the next
    stage (:class:`Tokens`)."""
    for token in before:
        if token.token is None:
            continue
        if token.source == "input":
            now = input_token(token.value, full=full)
        else:
            now = (tokens or Tokens()).after(token.value)
        if now != token.token:
            raise InputMutationError(name, token.source, what=token.what)
    if not full:
        return
    for token in before:
        if token.source in ("input", "samples"):
            continue
        if encode(token.value).digest != recorded(token.source):
            raise InputMutationError(
                name,
                token.source,
                "left its input with a different digest than it was given",
                what=token.what,
            )
