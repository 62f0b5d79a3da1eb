"""Planning: what an export would run and why, without running anything (the public API
behind ``graphbuild status`` and ``graphbuild explain``).

The planner reads keys (:class:`~graphbuild.engine.keying.Keys`) and asks the rebuilder's
decision (:func:`~graphbuild.engine.rebuild.decide`) of each, never running a stage: as Build
Systems à la Carte keeps the scheduler apart from the rebuilder, nothing here can run one
(:mod:`~graphbuild.engine.scheduler` does)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from graphbuild.engine.events import RunReport, StageRecord
from graphbuild.engine.explain import explain_changes
from graphbuild.engine.keying import Keys
from graphbuild.engine.rebuild import Freshness, decide
from graphbuild.engine.status import StageStatus

if TYPE_CHECKING:
    from graphbuild.engine.artifact_store import Cache
    from graphbuild.engine.pipeline import Pipeline

__all__ = ["explain_plan", "plan", "plan_status", "stage_inputs"]


def plan_status(
    pipeline: Pipeline,
    pipeline_input: Any,
    samples: Any,
    *,
    context: Mapping[str, Any],
    cache: Cache | None,
    run_id: str = "pipeline",
) -> RunReport:
    """What a run would do, without running anything: each stage ``hit`` or ``dirty`` with
    the reason. A stage downstream of a dirty one is ``maybe``: whether it reruns depends on
    the upstream output (early cutoff)."""
    keys = Keys(pipeline, pipeline_input, samples, context, cache, run_id)
    for name in keys.order:
        st = keys.begin(name)
        deps = pipeline.dependencies(name)
        if any(
            keys.states[d].record.status in (StageStatus.DIRTY, StageStatus.MAYBE) for d in deps
        ):
            st.record.status = StageStatus.MAYBE
            st.record.reason = "depends on a dirty stage (reruns unless its output is unchanged)"
            continue
        key = keys.compute_key(name)
        st.record.key = key
        found = decide(cache, key, keys, count=False)
        if found.hit:
            st.record.status = StageStatus.HIT
            st.record.digest = found.manifest["artifact"]["digest"]  # type: ignore[index]
            continue
        if found.freshness is Freshness.STALE:
            st.record.status, st.record.reason = StageStatus.DIRTY, found.reason
            continue
        st.record.status = StageStatus.DIRTY
        st.record.reason, st.record.changes = keys.why(name, key)
    return RunReport(run_id, [keys.states[n].record for n in keys.order])


#: Each stage ``hit``, ``dirty`` (with the reason) or ``maybe`` (downstream of a dirty stage:
#: it reruns unless the upstream output comes out unchanged); nothing runs.
plan = plan_status


def explain_plan(
    pipeline: Pipeline,
    pipeline_input: Any,
    samples: Any,
    *,
    context: Mapping[str, Any],
    cache: Cache,
    run_id: str = "pipeline",
    only: str | None = None,
) -> list[dict[str, Any]]:
    """For each stage (or ``only`` that one), what changed since its last recorded run:
    code, toolchain, each read (old and new value, or digests and which tensors / submodules
    changed) and upstream outputs, with the plan's status and a reason a person can read.
    Uses the planner's readings; nothing is executed."""
    planned_run = plan(
        pipeline, pipeline_input, samples, context=context, cache=cache, run_id=run_id
    )
    keys = Keys(pipeline, pipeline_input, samples, context, cache, run_id)
    out = []
    for planned in planned_run.stages:
        name = planned.name
        keys.begin(name, StageRecord(name, planned.status, planned.key, digest=planned.digest))
        if only is not None and name != only:
            continue
        keys.compute_key(name)
        now = keys.snapshot(name)
        last = cache.last_run(run_id, name)
        pending = [
            d
            for d in pipeline.dependencies(name)
            if planned_run[d].status in (StageStatus.DIRTY, StageStatus.MAYBE)
        ]
        for dep in pending:  # unknown until it reruns: do not report it as a change
            now["upstream"][dep] = ((last or {}).get("upstream") or {}).get(dep)
        reason, changes = explain_changes(last, now)
        if not last:
            reason = "no record of a previous run"
        elif not changes and planned.status == StageStatus.HIT:
            reason = "unchanged since the last run"
        elif not changes and planned.status == StageStatus.MAYBE:
            reason = f"its own reads are unchanged; reruns only if {_outputs_of(pending)}"
        elif pending:
            reason += f"; also downstream of dirty {', '.join(pending)}"
        out.append(
            {
                "name": name,
                "status": planned.status,
                "reason": reason,
                "last_run": None
                if not last
                else {
                    "status": last.get("status"),
                    "when": last.get("when"),
                    "key": last.get("key"),
                    "seconds": last.get("seconds"),
                    "reason": last.get("reason"),
                    "changes": [
                        {"read": read, "old": old, "new": new}
                        for read, old, new in last.get("changes", [])
                    ],
                },
                "changes": [asdict(c) for c in changes],
                "dirty_upstream": pending,
            }
        )
    return out


def stage_inputs(
    pipeline: Pipeline, pipeline_input: Any, samples: Any, *, context: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """For every stage, what its key covers besides its upstream outputs: its code version
    and the digest of each declared read (``"uncacheable: <reason>"`` where there is none).
    Nothing runs and no cache is read. For the same model, samples and options these are
    the same in every process (docs/design.md, invariant 10): compare them to find a read that
    is not."""
    keys = Keys(pipeline, pipeline_input, samples, context, None, "plan")
    out: dict[str, dict[str, Any]] = {}
    for name in keys.order:
        keys.begin(name)
        keys.compute_key(name)
        st = keys.states[name]
        out[name] = {
            "code": st.code or f"uncacheable: {st.code_error}",
            "reads": {
                r: rd.digest if rd.digest is not None else f"uncacheable: {rd.reason}"
                for r, rd in st.readings.items()
            },
        }
    return out


def _outputs_of(stages: Sequence[str]) -> str:
    if len(stages) == 1:
        return f"the output of {stages[0]} changes"
    return f"the outputs of {', '.join(stages)} change"
