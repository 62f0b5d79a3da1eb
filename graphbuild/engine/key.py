"""The stage key: one pure function of everything a stage's output may depend on."""

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
    the digests of its upstream outputs in input order, toolchain versions)."""
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
