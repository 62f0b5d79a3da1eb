"""Stage statuses are one enum, StageStatus, in run reports and plans alike; it reads, prints
and serializes as the plain word the reports always used."""

from __future__ import annotations

import json

from graphbuild.engine.pipeline import Pipeline
from graphbuild.engine.plan import plan
from graphbuild.engine.status import StageStatus
from tests.engine_helpers import reset, stage


def _pipeline() -> Pipeline:
    p = Pipeline(name="status")
    a = p.register_stage(stage("a", lambda i, s, c: c["n"]), "a", reads=("ctx.n",))
    p.register_stage(stage("b", lambda i, s, c: i[0] * 2), "b", reads=()).depends_on(a)
    return p


def test_run_report_statuses_are_stage_statuses(tmp_path):
    from graphbuild.engine.artifact_store import Cache

    reset()
    cache = Cache(tmp_path / "cache")
    first = _pipeline().run(None, None, context={"n": 1}, cache=cache).report
    second = _pipeline().run(None, None, context={"n": 1}, cache=cache).report
    assert first.statuses == {"a": StageStatus.RAN, "b": StageStatus.RAN}
    assert second.statuses == {"a": StageStatus.HIT, "b": StageStatus.HIT}
    assert all(
        type(s) is StageStatus for s in (*first.statuses.values(), *second.statuses.values())
    )


def test_plan_statuses_are_stage_statuses(tmp_path):
    from graphbuild.engine.artifact_store import Cache

    reset()
    cache = Cache(tmp_path / "cache")
    _pipeline().run(None, None, context={"n": 1}, cache=cache)
    report = plan(_pipeline(), None, None, context={"n": 2}, cache=cache)
    assert report.statuses == {"a": StageStatus.DIRTY, "b": StageStatus.MAYBE}
    assert report.with_status(StageStatus.DIRTY) == ["a"]


def test_a_status_prints_and_serializes_as_its_word():
    assert StageStatus.CUTOFF == "cutoff"
    assert f"{StageStatus.HIT:<6}|" == "hit   |"
    assert str(StageStatus.MAYBE) == "maybe"
    assert repr({"a": StageStatus.DIRTY}) == "{'a': 'dirty'}"  # a printed report as before
    assert json.dumps({"status": StageStatus.RAN}) == '{"status": "ran"}'
    assert StageStatus("skipped") is StageStatus.SKIPPED
