"""Planning: what an export would run and why, without running anything (the public API
behind ``graphbuild status`` and ``graphbuild explain``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from graphbuild.engine.scheduler import (
    StageRecord,
    _Run,
    _State,
    explain_changes,
    plan_reads,
    plan_status,
)
from graphbuild.engine.status import StageStatus

if TYPE_CHECKING:
    from graphbuild.engine.pipeline import Pipeline
    from graphbuild.engine.store import Cache

__all__ = ["explain_plan", "plan", "stage_inputs"]


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
    run = _Run(pipeline, pipeline_input, samples, context, cache, (), (), run_id)
    out = []
    for planned in planned_run.stages:
        name = planned.name
        record = StageRecord(name, planned.status, planned.key, digest=planned.digest)
        run.states[name] = _State(record, plan_reads(pipeline, name, context))
        if only is not None and name != only:
            continue
        run.compute_key(name)
        now = run._snapshot(name)
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
    the same in every process (DESIGN.md, invariant 10): compare them to find a read that
    is not."""
    run = _Run(pipeline, pipeline_input, samples, context, None, (), (), "plan")
    out: dict[str, dict[str, Any]] = {}
    for name in run.order:
        run.states[name] = _State(StageRecord(name), plan_reads(pipeline, name, context))
        run.compute_key(name)
        st = run.states[name]
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
