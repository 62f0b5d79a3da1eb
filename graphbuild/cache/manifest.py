"""Checks on a manifest read from a cache: the shape, the types and the artifact digest.

A manifest is data written by whoever could write to the cache. Before anything uses it, its
artifact description is checked against its own digest (the digest is recomputed from the
codec, meta, part digests and child digests, as the engine's ``Encoded`` computes it), every
part names a digest and a size, and a file artifact's name is a plain name. A manifest that
fails is corrupt: a miss, never an error, never a path.

The description lists every blob the entry holds (:func:`blob_refs`): the cache learns what
an entry references from its manifest alone, never by decoding the artifact. An entry of a
stage that rematerializes its output keeps the description (and so the digest) of what the
stage made but none of its bytes (``"stored": false``): it holds no blob.
"""

from __future__ import annotations

import math
from typing import Any

from graphbuild.cache.names import is_digest, is_placed_path
from graphbuild.hashing import digest_json

_MAX_DEPTH = 64
_MAX_COUNT = 2**53  # bytes: far beyond any artifact, and exact as a float
_MAX_NUMBER = 1e12  # seconds and timestamps: some 30 000 years
_ARTIFACT_KEYS = {"codec", "meta", "digest", "parts", "children"}
_STORED = "stored"


class InvalidManifest(ValueError):
    """A manifest that is not what the cache writes."""


def check_manifest(key: str, manifest: Any) -> dict[str, Any]:
    """``manifest`` if it is a well-formed entry for ``key``; raises InvalidManifest."""
    if type(manifest) is not dict:
        raise InvalidManifest("not a JSON object")
    if manifest.get("key") != key:
        raise InvalidManifest("holds another key's entry")
    _count(manifest, "bytes")
    for field in ("seconds", "created", "last_used"):
        _number(manifest, field)
    for field in ("stage", "pipeline", "code"):
        if field in manifest and type(manifest[field]) is not str:
            raise InvalidManifest(f"'{field}' is not a string")
    if not _table_of(manifest.get("codecs", {}), str):
        raise InvalidManifest("'codecs' is not a table of codec versions")
    check_artifact(manifest.get("artifact"))
    if manifest.get("bytes", 0) != sum(s for _, s in blob_refs(manifest["artifact"])):
        raise InvalidManifest("'bytes' is not the size of its blobs")
    return manifest


def check_artifact(description: Any, depth: int = 0) -> str:
    """The artifact digest of a description whose digest matches its contents."""
    if depth > _MAX_DEPTH:
        raise InvalidManifest("artifact nested too deeply")
    if type(description) is not dict or set(description) - {_STORED} != _ARTIFACT_KEYS:
        raise InvalidManifest("artifact description has the wrong fields")
    if _STORED in description and (depth > 0 or description[_STORED] is not False):
        raise InvalidManifest("'stored' is only ever false, on an entry's own artifact")
    codec, parts, children = description["codec"], description["parts"], description["children"]
    if type(codec) is not str or type(parts) is not list or type(children) is not list:
        raise InvalidManifest("artifact description has the wrong types")
    digests = []
    for part in parts:
        if (
            type(part) is not list
            or len(part) != 2
            or not is_digest(part[0])
            or type(part[1]) is not int
            or not 0 <= part[1] <= _MAX_COUNT
        ):
            raise InvalidManifest(f"bad blob reference {str(part)[:80]}")
        digests.append(part[0])
    child_digests = [check_artifact(c, depth + 1) for c in children]
    if codec == "file":
        meta = description["meta"]
        if type(meta) is not dict or not is_placed_path(meta.get("name")):
            raise InvalidManifest("file artifact without a plain file name (or folder/name)")
    try:
        digest = digest_json([codec, description["meta"], digests, child_digests])
    except (TypeError, ValueError) as err:
        raise InvalidManifest(f"artifact meta is not JSON ({err})") from err
    if not is_digest(description["digest"]) or digest != description["digest"]:
        raise InvalidManifest("artifact does not match its digest")
    return digest


def check_run_record(record: Any) -> dict[str, Any] | None:
    """``record`` if it has the shape of what the scheduler records about a stage's last run
    (``explain`` compares against it); None otherwise: a malformed record is no record."""
    if type(record) is not dict:
        return None
    for field, kinds in _RECORD_FIELDS.items():
        if field in record and type(record[field]) not in kinds:
            return None
    if not _table_of(record.get("toolchain", {}), *_SCALARS):
        return None
    if not _table_of(record.get("upstream", {}), str, type(None)):
        return None
    changes = record.get("changes", [])
    if type(changes) is not list or any(
        type(c) is not list or len(c) != 3 or type(c[0]) is not str for c in changes
    ):
        return None
    reads = record.get("reads", {})
    if type(reads) is not dict:
        return None
    for reading in reads.values():
        if type(reading) is not dict:
            return None
        if type(reading.get("digest")) not in (str, type(None)):
            return None
        if type(reading.get("details") or {}) is not dict:
            return None
    return record


def check_explain_record(record: Any) -> dict[str, Any]:
    """:func:`check_run_record` for ``cache verify``: raises InvalidManifest."""
    if check_run_record(record) is None:
        raise InvalidManifest("not an explain record")
    return record


#: What :func:`graphbuild.output.placement.place_outputs` records of each placed file.
_STAMP_FILE = {"name": str, "xxh3_128": str, "product": str, "bytes": int, "mtime_ns": int}
LOCK_FILE = "graphbuild.lock.json"


def check_placement_stamp(stamp: Any) -> dict[str, Any]:
    """``stamp`` if it has the shape of what placement records about an output directory:
    product digests, and for each file a plain name (never the lock file), its digest, size
    and mtime, and for a model file the ranges of its tensors, each inside the file; raises
    InvalidManifest. (Placement also checks each name against the files its pipeline
    declares, which only it knows.)"""
    if type(stamp) is not dict:
        raise InvalidManifest("not a JSON object")
    products = stamp.get("products")
    if not _table_of(products, str) or not all(map(is_digest, products.values())):
        raise InvalidManifest("'products' is not a table of digests")
    if stamp.get("external_data") not in (None, True, False, "per_tensor"):
        raise InvalidManifest("'external_data' is not true, false, 'per_tensor' or null")
    if type(stamp.get("files")) is not list:
        raise InvalidManifest("'files' is not a list")
    for item in stamp["files"]:
        if type(item) is not list or len(item) != 2 or type(item[0]) is not str:
            raise InvalidManifest(f"bad file entry {str(item)[:80]}")
        f = item[1]
        if type(f) is not dict or any(type(f.get(k)) is not t for k, t in _STAMP_FILE.items()):
            raise InvalidManifest(f"bad file entry {str(item)[:80]}")
        if not is_placed_path(f["name"]) or f["name"] == LOCK_FILE:
            raise InvalidManifest(f"names {str(f['name'])[:80]!r}, not a file it may place")
        if not is_digest(f["xxh3_128"]) or not 0 <= f["bytes"] <= _MAX_COUNT:
            raise InvalidManifest(f"bad digest or size for {f['name']!r}")
        _check_ranges(f.get("ranges", []), f["bytes"], f["name"])
    return stamp


def _check_ranges(ranges: Any, size: int, name: str) -> None:
    """``[[offset, length, digest], ...]``, each range inside a file of ``size`` bytes."""
    if type(ranges) is not list:
        raise InvalidManifest(f"'ranges' of {name!r} is not a list")
    for r in ranges:
        if type(r) is not list or len(r) != 3:
            raise InvalidManifest(f"bad range {str(r)[:80]} in {name!r}")
        offset, length, digest = r
        if type(offset) is not int or type(length) is not int or not is_digest(digest):
            raise InvalidManifest(f"bad range {str(r)[:80]} in {name!r}")
        if offset < 0 or length < 0 or offset + length > size:
            raise InvalidManifest(f"range {str(r)[:80]} lies outside {name!r} ({size} bytes)")


def check_memo_record(record: Any) -> dict[str, Any]:
    """``record`` if it is a memo record (``graphbuild.engine.source_memo``) that matches
    its own digest; raises InvalidManifest."""
    if type(record) is not dict or type(record.get("kind")) is not str or "value" not in record:
        raise InvalidManifest("not a memo record")
    try:
        digest = digest_json([record["kind"], record["value"]])
    except (TypeError, ValueError) as err:
        raise InvalidManifest(f"its value is not JSON ({err})") from err
    if record.get("digest") != digest:
        raise InvalidManifest("does not match its digest")
    return record


_SCALARS = (str, int, float, bool, type(None))
_RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "key": (str, type(None)),
    "code": (str,),
    "digest": (str, type(None)),
    "status": (str, type(None)),
    "when": (int, float, type(None)),
    "seconds": (int, float, type(None)),
    "reason": (str, type(None)),
    "changes": (list,),
    "toolchain": (dict,),
    "upstream": (dict,),
    "reads": (dict,),
}


def _table_of(value: Any, *kinds: type) -> bool:
    """True for a JSON object whose values are all of ``kinds``."""
    return type(value) is dict and all(type(v) in kinds for v in value.values())


def blob_refs(description: dict[str, Any]) -> list[tuple[str, int]]:
    """Every (blob digest, size) an artifact description references, parts before children;
    none for an artifact whose bytes are not stored (:func:`bytes_stored`)."""
    if not bytes_stored(description):
        return []
    out = [(d, s) for d, s in description["parts"]]
    for c in description["children"]:
        out.extend(blob_refs(c))
    return out


def bytes_stored(description: dict[str, Any]) -> bool:
    """False for the artifact of a stage that rematerializes its output: the entry keeps its
    digest, and a run that needs the value recomputes it from the stage's inputs."""
    return description.get(_STORED) is not False


def without_bytes(description: dict[str, Any]) -> dict[str, Any]:
    """``description`` marked as holding none of its bytes (same digest)."""
    return {**description, _STORED: False}


def _count(manifest: dict[str, Any], field: str) -> None:
    value = manifest.get(field, 0)
    if type(value) is not int or not 0 <= value <= _MAX_COUNT:
        raise InvalidManifest(f"'{field}' is not a count")


def _number(manifest: dict[str, Any], field: str) -> None:
    value = manifest.get(field, 0.0)
    if type(value) not in (int, float) or not math.isfinite(value):
        raise InvalidManifest(f"'{field}' is not a finite number")
    if not 0 <= value <= _MAX_NUMBER:
        raise InvalidManifest(f"'{field}' is out of range")
