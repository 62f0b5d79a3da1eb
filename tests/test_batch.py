"""A batch of builds over one cache runs each distinct stage key once, wave by wave, with the
cache as the only transport between the batch and whoever runs its jobs."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.batch import (
    BatchStatus,
    Build,
    InlineExecutor,
    JobResult,
    StageJob,
    run_batch,
    run_job,
)
from graphbuild.engine.pipeline import Pipeline
from tests.engine_helpers import CALLS, reset, stage, tiny_net


def _weights(m, samples, ctx):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _scaled(inputs, samples, ctx):
    return {k: v * ctx["factor"] for k, v in inputs[0].items()}


def _shapes(inputs, samples, ctx):  # the same for every factor: cuts the wave off
    return sorted((k, list(v.shape)) for k, v in inputs[0].items())


def _described(inputs, samples, ctx):
    return {"count": len(inputs[0])}


def _total(inputs, samples, ctx):
    return float(sum(v.double().sum() for v in inputs[0].values()))


def pipeline() -> Pipeline:
    """weights (the input) -> scaled (ctx.factor) -> shapes -> described; scaled -> total"""
    p = Pipeline(name="batch")
    w = p.register_stage(stage("weights", _weights), "weights", reads=("input.state",))
    s = p.register_stage(stage("scaled", _scaled), "scaled", reads=("ctx.factor",)).depends_on(w)
    sh = p.register_stage(stage("shapes", _shapes), "shapes", reads=()).depends_on(s)
    p.register_stage(stage("described", _described), "described", reads=()).depends_on(sh)
    p.register_stage(stage("total", _total), "total", reads=()).depends_on(s)
    return p


def builds(factors=(1.0, 2.0, 3.0), model=None) -> list[Build]:
    model = model if model is not None else tiny_net()
    return [Build(f"x{f}", pipeline(), model, (), {"factor": f}, "batch:test") for f in factors]


def test_each_distinct_key_runs_once_across_the_builds(tmp_path):
    cache = Cache(tmp_path / "c")
    reset()

    report = run_batch(builds(), cache)

    assert report.runs_per_stage() == {"weights": 1, "scaled": 3, "shapes": 3, "described": 1,
                                       "total": 3}  # fmt: skip
    assert sorted(CALLS) == sorted(["weights"] + ["scaled", "shapes", "total"] * 3 + ["described"])
    statuses = {b: {s: o.status for s, o in st.items()} for b, st in report.stages.items()}
    assert [statuses[b]["weights"] for b in ("x1.0", "x2.0", "x3.0")].count(BatchStatus.RAN) == 1
    assert [statuses[b]["described"] for b in ("x1.0", "x2.0", "x3.0")].count(
        BatchStatus.SHARED
    ) == 2
    assert report.failures() == {}


def test_a_batch_over_a_warm_cache_runs_nothing(tmp_path):
    cache = Cache(tmp_path / "c")
    run_batch(builds(), cache)
    reset()

    report = run_batch(builds(), cache)

    assert CALLS == [] and report.jobs == []
    assert {o.status for st in report.stages.values() for o in st.values()} == {BatchStatus.HIT}


def test_what_the_batch_built_is_what_an_export_of_each_build_hits(tmp_path):
    cache = Cache(tmp_path / "c")
    batch = run_batch(builds(), cache)
    reset()

    for build in builds():
        result = build.pipeline.run(build.input, context=build.context, cache=cache)
        assert set(result.report.statuses.values()) == {"hit"}
        for name, outcome in batch.stages[build.name].items():
            assert result.report[name].key == outcome.key
    assert CALLS == []


def test_a_failed_stage_stops_its_build_and_the_others_go_on(tmp_path):
    cache = Cache(tmp_path / "c")

    report = run_batch(builds(factors=(1.0, "not a number", 3.0)), cache)

    bad = report.stages["xnot a number"]
    assert bad["scaled"].status == BatchStatus.FAILED
    assert "scaled" in bad["scaled"].detail and "TypeError" in bad["scaled"].detail
    assert {bad[s].status for s in ("shapes", "described", "total")} == {BatchStatus.SKIPPED}
    assert report.stages["x3.0"]["total"].status == BatchStatus.RAN
    assert list(report.failures()) == ["xnot a number"]


def _unhashable(m, samples, ctx):
    return {"n": 1}


def test_a_stage_without_a_cacheable_key_is_deferred_with_its_dependents(tmp_path):
    p = Pipeline(name="deferred")
    first = p.register_stage(_unhashable, "first", reads=("ctx.thing",))
    p.register_stage(stage("after", _described), "after", reads=()).depends_on(first)
    build = Build("b", p, None, (), {"thing": object()}, "batch:deferred")

    report = run_batch([build], Cache(tmp_path / "c"))

    assert report.stages["b"]["first"].status == BatchStatus.DEFERRED
    assert "cannot be cached" in report.stages["b"]["first"].detail
    assert report.stages["b"]["after"].status == BatchStatus.DEFERRED
    assert report.jobs == []


class _OtherModelExecutor:
    """Runs every job against builds over another model: its keys differ from the batch's."""

    def __init__(self, cache):
        self.cache = cache
        self.builds = {b.name: b for b in builds(model=tiny_net(seed=1))}

    def submit(self, job: StageJob) -> Future[JobResult]:
        future: Future[JobResult] = Future()
        future.set_result(run_job(self.builds[job.build], job, self.cache))
        return future


def test_a_worker_that_builds_another_model_fails_before_running_anything(tmp_path):
    cache = Cache(tmp_path / "c")
    reset()

    report = run_batch(builds(factors=(1.0,)), cache, _OtherModelExecutor(cache))

    outcome = report.stages["x1.0"]["weights"]
    assert outcome.status == BatchStatus.FAILED
    assert "key" in outcome.detail and "does not build the same model" in outcome.detail
    assert CALLS == []


class _ElsewhereExecutor(InlineExecutor):
    """Runs jobs against a cache the batch cannot see."""

    def __init__(self, builds, cache, other):
        super().__init__(builds, cache)
        self.cache = other


def test_a_worker_that_does_not_share_the_cache_is_a_clear_failure(tmp_path):
    b = builds(factors=(1.0,))
    cache = Cache(tmp_path / "c")

    report = run_batch(b, cache, _ElsewhereExecutor(b, cache, Cache(tmp_path / "elsewhere")))

    detail = report.stages["x1.0"]["weights"].detail
    assert report.stages["x1.0"]["weights"].status == BatchStatus.FAILED
    assert "must share the cache" in detail


def test_builds_of_one_batch_need_distinct_names(tmp_path):
    b = builds(factors=(1.0, 1.0))
    with pytest.raises(Exception, match="distinct names"):
        run_batch(b, Cache(tmp_path / "c"))


def test_an_executor_that_gives_up_fails_the_stages_that_needed_the_job(tmp_path):
    class Broken:
        def submit(self, job):
            future: Future = Future()
            future.set_exception(RuntimeError("worker died 4 times"))
            return future

    report = run_batch(builds(factors=(1.0, 2.0)), Cache(tmp_path / "c"), Broken())

    for build in ("x1.0", "x2.0"):
        assert report.stages[build]["weights"].status == BatchStatus.FAILED
        assert "worker died 4 times" in report.stages[build]["weights"].detail
        assert report.stages[build]["total"].status == BatchStatus.SKIPPED
    assert len(report.jobs) == 1  # one key, one job, needed by both builds


def test_builds_sharing_an_input_can_share_its_fingerprints(tmp_path):
    from graphbuild.engine.fingerprint import InputFacets

    model = tiny_net()
    facets = InputFacets(model, ())
    b = [Build(f"x{f}", pipeline(), model, (), {"factor": f}, "batch:f", facets) for f in (1, 2)]

    report = run_batch(b, Cache(tmp_path / "c"))

    assert report.failures() == {}
    assert facets._cache["input.state"].digest  # read once, for both builds


def _box(m, samples, ctx):
    from tests.engine_helpers import Box

    return Box("made once")


def _unbox(inputs, samples, ctx):
    return {"text": inputs[0].text}


@pytest.mark.parametrize("keep", [True, False])
def test_a_cache_that_keeps_values_decodes_an_artifact_once(tmp_path, keep):
    from tests.engine_helpers import DECODES

    cache = Cache(tmp_path / "c")
    cache.keep_values(1 << 20 if keep else None)
    p = Pipeline(name="values")
    box = p.register_stage(_box, "box", reads=())
    p.register_stage(stage("unbox", _unbox), "unbox", reads=()).depends_on(box)
    p.run(None, cache=cache)
    reset()

    for _ in range(3):  # each run reads box's output, a hit
        again = p.run(None, cache=cache, force=["unbox"])

    assert again.outputs["unbox"] == {"text": "made once"}
    decoded = list(DECODES)
    assert decoded == ["made once"] * (1 if keep else 3)
