"""The stage key: one pure function of everything a stage's output may depend on, known
before the stage runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from graphbuild.hashing import digest_json

KEY_SCHEMA = 1


def stage_key(
    stage: str,
    code_version: str,
    reads: Mapping[str, str],
    upstream: Sequence[str],
    toolchain: Mapping[str, str],
) -> str:
    """xxh3-128 over (stage identity and code version, the digests of its declared reads,
    the digests of its upstream outputs in input order, toolchain versions).

    An entry under the key serves by a two-part rule: the key matches, *and* every codec that
    encoded the entry (recorded in it) has the version registered under its name now
    (:func:`graphbuild.engine.rebuild.decide` applies both parts; nothing else may). Codec
    versions stay out of the key because which codecs encode an output depends on the value
    the stage returns, which is not known until it runs: a key over every codec instead
    would rerun every stage on an edit to any one codec, and would differ between processes
    that registered different codecs (a test's or a plug-in's), which keys must not."""
    return digest_json(
        {
            "schema": KEY_SCHEMA,
            "stage": stage,
            "code": code_version,
            "reads": dict(sorted(reads.items())),
            "upstream": list(upstream),
            "toolchain": dict(sorted(toolchain.items())),
        }
    )
