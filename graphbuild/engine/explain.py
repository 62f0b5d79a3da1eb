"""Why a stage reruns: its last run's record against its readings now, cheapest check first."""

from __future__ import annotations

from typing import Any

from graphbuild.engine.events import Change


def stale_reason(stale: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in stale)
    return f"the cached entry was written by an older codec {shown}; rebuilt"


#: the old value shown for an upstream output the stage's last run did not read
NOT_READ = "(not an input then)"


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
        before = last.get("upstream", {})
        prev = before.get(dep)
        if prev != digest:
            old = (prev or "")[:12] if dep in before else NOT_READ
            changes.append(Change(f"output of '{dep}'", old, (digest or "")[:12]))
    if not changes:
        return "no cache entry for this key (evicted, pruned, corrupt or never stored)", []
    first = changes[0]
    reshaped = _reshaped(last, now)
    if reshaped:
        head = reshaped
    elif first.read == "code":
        head = "code changed"
    elif first.read.startswith("output of"):
        head = f"{first.read} changed"
    else:
        head = str(first)
    more = f" (+{len(changes) - 1} more)" if len(changes) > 1 else ""
    return head + more, changes


def _reshaped(last: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The head of the reason when the stage under this name follows other stages than at
    its last run (a setting changed the pipeline's shape, as a QNN preset that quantizes in
    one stage rather than three does): a new function there, whose code naturally differs,
    which "code changed" would misname. (Its context reads may change with the context
    alone: a stage that declares none reads every key.)"""
    old_up, new_up = list(last.get("upstream", {})), list(now["upstream"])
    if set(old_up) != set(new_up):
        return f"the pipeline changed: now after {_names(new_up)} (was after {_names(old_up)})"
    return None


def _names(stages: list[str]) -> str:
    return ", ".join(f"'{s}'" for s in stages) or "nothing"


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
