"""Why a stage reruns: its last run's record against its readings now, cheapest check first."""

from __future__ import annotations

from typing import Any

from graphbuild.engine.events import Change


def stale_reason(stale: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in stale)
    return f"the cached entry was written by an older codec {shown}; rebuilt"


def explain_changes(last: dict[str, Any] | None, now: dict[str, Any]) -> tuple[str, list[Change]]:
    """Why a stage's key differs from its last run, cheapest check first."""
    if not last:
        return "no cached result (first run)", []
    changes: list[Change] = []
    if last.get("code") != now["code"]:
        changes.append(Change("code", last.get("code", "")[:12], now["code"][:12]))
    old_tc, new_tc = last.get("toolchain", {}), now["toolchain"]
    for tool in sorted(set(old_tc) | set(new_tc)):
        if old_tc.get(tool) != new_tc.get(tool):
            changes.append(Change(f"toolchain.{tool}", old_tc.get(tool), new_tc.get(tool)))
    old_reads = last.get("reads", {})
    for read, cur in now["reads"].items():
        prev = old_reads.get(read)
        if prev is None:
            changes.append(Change(read, None, cur["value"]))
        elif prev.get("digest") != cur["digest"]:
            changes.append(_read_change(read, prev, cur))
    for dep, digest in now["upstream"].items():
        prev = last.get("upstream", {}).get(dep)
        if prev != digest:
            changes.append(Change(f"output of '{dep}'", (prev or "")[:12], (digest or "")[:12]))
    if not changes:
        return "no cache entry for this key (evicted, pruned, corrupt or never stored)", []
    first = changes[0]
    if first.read == "code":
        head = "code changed"
    elif first.read.startswith("output of"):
        head = f"{first.read} changed"
    else:
        head = str(first)
    more = f" (+{len(changes) - 1} more)" if len(changes) > 1 else ""
    return head + more, changes


def _read_change(read: str, prev: dict[str, Any], cur: dict[str, Any]) -> Change:
    old_d, new_d = prev.get("details") or {}, cur.get("details") or {}
    if old_d or new_d:
        changed = sorted(k for k in set(old_d) | set(new_d) if old_d.get(k) != new_d.get(k))
        shown = ", ".join(changed[:5]) + (f", +{len(changed) - 5} more" if len(changed) > 5 else "")
        label = "submodules" if read == "input.structure" else "tensors"
        return Change(
            read,
            (prev.get("digest") or "")[:12],
            f"{(cur.get('digest') or '')[:12]} ({len(changed)} {label} changed: {shown or 'root'})",
        )
    return Change(read, prev.get("value"), cur.get("value"))
