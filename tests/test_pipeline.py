"""The pipeline manipulation API: building, rewiring and calling a DAG of stages."""

from __future__ import annotations

import pytest
import torch

from graphbuild.engine.pipeline import Pipeline
from graphbuild.errors import PipelineError, StageError
from tests.engine_helpers import CALLS, reset, stage, tiny_net


@pytest.fixture(autouse=True)
def _clean_calls():
    reset()
    yield
    reset()


def const(value):
    return lambda inputs, samples, ctx: value


def echo(inputs, samples, ctx):
    """Returns its inputs as a list, so a test can see their order."""
    return list(inputs)


def test_register_stage_refuses_a_duplicate_name():
    p = Pipeline()
    p.register_stage(const(1), "a")
    with pytest.raises(PipelineError, match="'a' is already registered"):
        p.register_stage(const(2), "a")


def test_register_stage_refuses_a_read_it_does_not_know():
    p = Pipeline()
    with pytest.raises(PipelineError, match="unknown read 'input.weights'"):
        p.register_stage(const(1), "a", reads=("input.weights",))
    with pytest.raises(PipelineError, match="unknown read 'opset'"):
        p.register_stage(const(1), "b", reads=("opset",))
    assert "a" not in p and "b" not in p


def test_register_stage_names_a_stage_after_its_function():
    def capture(inputs, samples, ctx):
        return 1

    ref = Pipeline().register_stage(capture)
    assert ref.name == "capture"


def test_depends_on_order_is_the_order_of_inputs():
    p = Pipeline()
    a = p.register_stage(const("a"), "a")
    b = p.register_stage(const("b"), "b")
    c = p.register_stage(const("c"), "c")
    p.register_stage(echo, "out").depends_on(c, a, b)

    assert p.dependencies("out") == ["c", "a", "b"]
    assert p.run(None).outputs["out"] == ["c", "a", "b"]


def test_insert_stage_before_takes_over_the_targets_dependencies():
    p = Pipeline()
    a = p.register_stage(const("a"), "a")
    b = p.register_stage(const("b"), "b")
    p.register_stage(echo, "t").depends_on(b, a)

    p.insert_stage_before("t", echo, "pre")

    assert p.dependencies("pre") == ["b", "a"]
    assert p.dependencies("t") == ["pre"]
    assert p.run(None).outputs["t"] == [["b", "a"]]


def test_insert_stage_before_with_depends_on_makes_only_those_edges():
    p = Pipeline()
    a = p.register_stage(const("a"), "a")
    b = p.register_stage(const("b"), "b")
    p.register_stage(echo, "t").depends_on(a)

    p.insert_stage_before("t", echo, "pre", depends_on=[b, a])

    assert p.dependencies("pre") == ["b", "a"]
    assert p.dependencies("t") == ["a"]
    assert p.run(None).outputs["pre"] == ["b", "a"]


def test_insert_stage_after_rewires_dependents_keeping_their_input_positions():
    p = Pipeline()
    a = p.register_stage(const("a"), "a")
    x = p.register_stage(const("x"), "x")
    p.register_stage(echo, "d1").depends_on(a, x)
    p.register_stage(echo, "d2").depends_on(x, a)

    p.insert_stage_after(a, lambda inputs, samples, ctx: inputs[0] + "'", "post")

    assert p.dependencies("post") == ["a"]
    assert p.dependencies("d1") == ["post", "x"]
    assert p.dependencies("d2") == ["x", "post"]
    outputs = p.run(None).outputs
    assert outputs["d1"] == ["a'", "x"]
    assert outputs["d2"] == ["x", "a'"]


def test_replace_stage_keeps_edges_and_capture_flag():
    p = Pipeline()
    a = p.register_stage(const("a"), "a")
    b = p.register_stage(const("b"), "b")
    p.register_stage(echo, "mid", capture_stage_output=True).depends_on(b, a)
    p.register_stage(echo, "sink").depends_on("mid")

    p.replace_stage("mid", lambda inputs, samples, ctx: "+".join(inputs))

    assert p.dependencies("mid") == ["b", "a"]
    assert p.dependents("mid") == ["sink"]
    assert p.get_stage("mid").stage.capture_output
    result = p.run(None)
    assert dict(result.captured) == {"mid": "b+a"}
    assert result.outputs["sink"] == ["b+a"]


def test_replace_stage_can_rename_keeping_edges():
    p = Pipeline()
    a = p.register_stage(const("a"), "a")
    p.register_stage(echo, "old", capture_stage_output=True).depends_on(a)
    p.register_stage(echo, "sink").depends_on("old")

    ref = p.replace_stage("old", echo, "new")

    assert ref.name == "new"
    assert "old" not in p
    assert p.dependencies("new") == ["a"]
    assert p.dependencies("sink") == ["new"]
    assert p.get_stage("new").stage.capture_output
    with pytest.raises(PipelineError, match="'a' is already registered"):
        p.replace_stage("new", echo, "a")


def test_add_dependency_is_idempotent():
    p = Pipeline()
    a = p.register_stage(const("a"), "a")
    b = p.register_stage(const("b"), "b")
    c = p.register_stage(echo, "c").depends_on(a, b)

    p.add_dependency(c, a)
    c.depends_on(a)

    assert p.dependencies("c") == ["a", "b"]
    assert p.graph.number_of_edges() == 2


def test_add_dependency_refuses_a_cycle_naming_both_stages():
    p = Pipeline()
    a = p.register_stage(const("a"), "a")
    b = p.register_stage(echo, "b").depends_on(a)
    p.register_stage(echo, "c").depends_on(b)

    with pytest.raises(ValueError, match="'a'.*'c'|'c'.*'a'"):
        p.add_dependency("a", "c")
    with pytest.raises(ValueError, match="'a'"):
        p.add_dependency("a", "a")
    assert p.dependencies("a") == []


def test_remove_dependency_raises_keyerror_when_there_is_no_such_edge():
    p = Pipeline()
    a = p.register_stage(const("a"), "a")
    b = p.register_stage(echo, "b").depends_on(a)
    p.register_stage(const("c"), "c")

    with pytest.raises(KeyError, match="'b' does not depend on 'c'"):
        p.remove_dependency(b, "c")
    p.remove_dependency(b, a)
    assert p.dependencies("b") == []
    with pytest.raises(KeyError):
        p.remove_dependency(b, a)


def test_get_stage_of_an_unknown_name_lists_the_stages():
    p = Pipeline()
    p.register_stage(const(1), "capture")
    p.register_stage(const(2), "to_onnx")

    with pytest.raises(KeyError, match="no stage named 'bind'.*capture, to_onnx"):
        p.get_stage("bind")


def test_calling_the_pipeline_returns_captured_outputs_and_eval_results():
    model = tiny_net()
    x = torch.randn(1, 3, 8, 8)
    p = Pipeline({"scale": 2.0})
    fwd = p.register_stage(
        lambda m, samples, ctx: m(*samples).detach() * ctx["scale"],
        "forward",
        capture_stage_output=True,
    )
    p.register_stage(lambda inputs, samples, ctx: float(inputs[0].sum()), "total").depends_on(fwd)

    captured, eval_results = p(model, (x,))

    with torch.no_grad():
        expected = model(x) * 2.0
    assert set(captured) == {"forward"}
    torch.testing.assert_close(captured["forward"], expected)
    assert set(eval_results) == {"total"}
    assert eval_results["total"] == pytest.approx(float(expected.sum()))


def test_a_failure_after_many_stages_names_the_count_and_the_last_few_not_each():
    err = StageError("p9.graph", ValueError("bad"), tuple(f"s{i}" for i in range(200)))

    assert str(err) == (
        "stage 'p9.graph' failed (after 200 stages, the last: s197, s198, s199): ValueError: bad"
    )
    assert (
        str(StageError("b", ValueError("x"), ("a",)))
        == "stage 'b' failed (after: a): ValueError: x"
    )


def test_failing_stage_raises_stage_error_naming_it_skips_dependents_and_attaches_report():
    def broken(inputs, samples, ctx):
        raise RuntimeError("boom")

    p = Pipeline()
    a = p.register_stage(stage("a", lambda i, s, c: 1), "a")
    bad = p.register_stage(broken, "bad").depends_on(a)
    p.register_stage(stage("after", lambda i, s, c: 2), "after").depends_on(bad)
    p.register_stage(stage("beside", lambda i, s, c: 3), "beside").depends_on(a)

    with pytest.raises(StageError, match="stage 'bad' failed.*RuntimeError: boom") as err:
        p.run(None)

    assert err.value.stage == "bad"
    assert isinstance(err.value.cause, RuntimeError)
    assert err.value.ran_before == ("a",)
    report = err.value.report
    assert report.statuses == {"a": "ran", "bad": "failed", "after": "skipped", "beside": "ran"}
    assert "bad" in report["after"].reason
    assert "after" not in CALLS
