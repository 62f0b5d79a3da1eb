"""The scheduler and rebuilder: minimality, early cutoff, laziness, reasons and errors."""

from __future__ import annotations

import gc
import importlib
import sys
import textwrap
import weakref
from dataclasses import replace
from typing import Any

import pytest
import torch

from graphbuild.cache import FileBlobs
from graphbuild.cache.manifest import blob_refs
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.pipeline import Pipeline
from graphbuild.engine.scheduler import EventKind
from graphbuild.errors import StageError, UndeclaredReadError
from tests.engine_helpers import CALLS, DECODES, Box, Recorder, reset, stage, tiny_net

SAMPLES = (torch.zeros(1, 3, 8, 8),)
CONTEXT = {"opset": 18, "enc_version": "1.0.0"}


@pytest.fixture(autouse=True)
def _clean_calls():
    reset()
    yield
    reset()


@pytest.fixture
def cache(tmp_path):
    c = Cache(tmp_path / "cache")
    yield c
    c.close()


def _capture(model, samples, ctx):
    shapes = [list(p.shape) for p in model.parameters()]
    return Box(f"graph{shapes}{[list(s.shape) for s in samples]}")


def _to_onnx(inputs, samples, ctx):
    return Box(f"{inputs[0].text}@opset{ctx['opset']}")


def _weights(model, samples, ctx):
    return Box(repr([round(float(p.detach().sum()), 6) for p in model.parameters()]))


def _bind(inputs, samples, ctx):
    return Box(" + ".join(i.text for i in inputs))


def _encodings(inputs, samples, ctx):
    return Box(f"{ctx['enc_version']}:{inputs[0].text}")


def export_pipeline() -> Pipeline:
    """capture -> to_onnx -> bind <- weights -> encodings, like the reference plan."""
    p = Pipeline(name="export")
    capture = p.register_stage(
        stage("capture", _capture), "capture", reads=("input.structure", "samples.spec")
    )
    to_onnx = p.register_stage(stage("to_onnx", _to_onnx), "to_onnx", reads=("ctx.opset",))
    to_onnx.depends_on(capture)
    weights = p.register_stage(stage("weights", _weights), "weights", reads=("input.state",))
    p.register_stage(stage("bind", _bind), "bind", reads=()).depends_on(to_onnx, weights)
    p.register_stage(
        stage("encodings", _encodings), "encodings", reads=("ctx.enc_version",)
    ).depends_on(weights)
    return p


def run(p, model, cache, context=CONTEXT, **kw):
    """Run ``p`` and return (report, recorder), with the call and decode logs cleared first."""
    reset()
    rec = Recorder()
    result = p.run(model, SAMPLES, context=context, cache=cache, listeners=[rec], **kw)
    return result, rec


# --------------------------------------------------------------------------- minimality


def test_second_run_of_an_unchanged_pipeline_hits_everything_and_reads_no_artifact(
    cache, monkeypatch
):
    first, _ = run(export_pipeline(), tiny_net(), cache)
    assert first.report.ran == ["capture", "to_onnx", "weights", "bind", "encodings"]
    blob_reads = []
    real_read = FileBlobs.read
    monkeypatch.setattr(
        FileBlobs, "read", lambda self, *a, **k: blob_reads.append(a) or real_read(self, *a, **k)
    )

    # a fresh pipeline and a fresh model with equal weights: the next export, as a user runs it
    second, rec = run(export_pipeline(), tiny_net(), cache)

    assert set(second.report.statuses.values()) == {"hit"}
    assert CALLS == []
    assert rec.of(EventKind.LOADED) == []
    assert DECODES == []
    assert blob_reads == []
    assert rec.of(EventKind.HIT) == ["capture", "to_onnx", "weights", "bind", "encodings"]


def test_changing_a_context_key_reruns_only_its_readers_and_their_dependents(cache):
    model, p = tiny_net(), export_pipeline()
    run(p, model, cache)

    result, _ = run(p, model, cache, context={**CONTEXT, "opset": 21})

    assert result.report.ran == ["to_onnx", "bind"]
    assert CALLS == ["to_onnx", "bind"]
    assert result.report.with_status("hit") == ["capture", "weights", "encodings"]
    assert result.outputs["bind"].text.split(" + ")[0].endswith("@opset21")


def test_rerun_reason_names_the_context_key_with_old_and_new_values(cache):
    model, p = tiny_net(), export_pipeline()
    run(p, model, cache)

    result, rec = run(p, model, cache, context={**CONTEXT, "enc_version": "2.0.0"})

    record = result.report["encodings"]
    assert record.reason == "ctx.enc_version: 1.0.0 -> 2.0.0"
    assert [(c.read, c.old, c.new) for c in record.changes] == [
        ("ctx.enc_version", "1.0.0", "2.0.0")
    ]
    started = [e for e in rec.events if e.kind is EventKind.STARTED]
    assert [(e.stage, e.reason) for e in started] == [("encodings", record.reason)]


def test_a_key_added_to_the_context_reruns_nothing_that_does_not_declare_it(cache):
    model, p = tiny_net(), export_pipeline()
    run(p, model, cache)

    result, _ = run(p, model, cache, context={**CONTEXT, "unrelated": True})

    assert result.report.ran == []


def test_changing_weights_reruns_value_stages_but_never_capture_or_to_onnx(cache):
    model, p = tiny_net(), export_pipeline()
    run(p, model, cache)
    with torch.no_grad():
        model.fc.weight[0, 0] += 1.0

    result, _ = run(p, model, cache)

    assert result.report.ran == ["weights", "bind", "encodings"]
    assert result.report.with_status("hit") == ["capture", "to_onnx"]


def test_editing_a_stage_source_file_reruns_it_because_code_changed(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "gb_test_lower_stage.py"
    source.write_text("def lower(inputs, samples, ctx):\n    return inputs[0].text.upper()\n")
    importlib.invalidate_caches()
    module = importlib.import_module("gb_test_lower_stage")
    monkeypatch.setitem(sys.modules, "gb_test_lower_stage", module)  # dropped after the test

    def build():
        p = export_pipeline()
        p.register_stage(module.lower, "lower", reads=()).depends_on("to_onnx")
        return p

    model = tiny_net()
    run(build(), model, cache)
    source.write_text(
        textwrap.dedent(
            """\
            def lower(inputs, samples, ctx):
                # now strips the opset suffix
                return inputs[0].text.upper().split("@")[0]
            """
        )
    )
    module = importlib.reload(module)

    result, _ = run(build(), model, cache)

    assert result.report.ran == ["lower"]
    assert result.report["lower"].reason == "code changed"
    assert result.report["lower"].changes[0].read == "code"
    assert "@" not in result.outputs["lower"]


def test_a_stage_name_another_pipeline_shape_reuses_says_the_pipeline_changed(cache):
    """A setting that changes the pipeline's shape (a QNN preset that quantizes in one stage
    rather than three) gives a stage name to another function after other stages: the reason
    names the new inputs, not a code change the user never made, and a read the last run did
    not have shows as such."""

    def pipeline(split: bool) -> Pipeline:
        p = Pipeline(name="shape")
        src = p.register_stage(stage("src", lambda m, s, c: 3), "src", reads=())
        if split:
            mid = p.register_stage(stage("mid", lambda i, s, c: i[0] + 1), "mid", reads=())
            mid.depends_on(src)
            fn, reads = stage("values_split", lambda i, s, c: i[0] * c["k"]), ("ctx.k",)
            p.register_stage(fn, "values", reads=reads).depends_on(mid)
        else:
            fn = stage("values_one", lambda i, s, c: i[0] * 2)
            p.register_stage(fn, "values", reads=()).depends_on(src)
        return p

    pipeline(split=False).run(None, None, context={"k": 5}, cache=cache)
    result = pipeline(split=True).run(None, None, context={"k": 5}, cache=cache)

    rec = result.report["values"]
    assert rec.status == "ran"
    assert rec.reason.startswith("the pipeline changed"), rec.reason
    assert "'mid'" in rec.reason and "'src'" in rec.reason
    mid = next(c for c in rec.changes if c.read == "output of 'mid'")
    assert str(mid).startswith("output of 'mid': (not an input then) -> ")


# --------------------------------------------------------------------------- early cutoff


def test_identical_upstream_output_cuts_off_its_dependents(cache):
    p = Pipeline(name="cutoff")
    parity = p.register_stage(
        stage("parity", lambda m, s, c: c["n"] % 2), "parity", reads=("ctx.n",)
    )
    down = p.register_stage(stage("down", lambda i, s, c: i[0] * 10), "down", reads=())
    down.depends_on(parity)
    p.register_stage(stage("last", lambda i, s, c: i[0] + 1), "last", reads=()).depends_on(down)
    run(p, None, cache, context={"n": 1})

    result, rec = run(p, None, cache, context={"n": 3})

    assert result.report.statuses == {"parity": "ran", "down": "cutoff", "last": "hit"}
    assert CALLS == ["parity"]
    assert rec.of(EventKind.CUTOFF) == ["down"]
    assert rec.of(EventKind.LOADED) == []
    assert result.outputs["last"] == 11


def test_different_upstream_output_reruns_its_dependents(cache):
    p = Pipeline(name="cutoff")
    parity = p.register_stage(
        stage("parity", lambda m, s, c: c["n"] % 2), "parity", reads=("ctx.n",)
    )
    p.register_stage(stage("down", lambda i, s, c: i[0] * 10), "down", reads=()).depends_on(parity)
    run(p, None, cache, context={"n": 1})

    result, _ = run(p, None, cache, context={"n": 2})

    assert result.report.ran == ["parity", "down"]
    assert result.report["down"].reason == "output of 'parity' changed"
    assert result.outputs["down"] == 0


# --------------------------------------------------------------------------- laziness


def test_a_hit_that_no_dirty_stage_needs_is_never_loaded(cache):
    model, p = tiny_net(), export_pipeline()
    run(p, model, cache)

    result, rec = run(p, model, cache, context={**CONTEXT, "enc_version": "0.6.1"})

    assert result.report.ran == ["encodings"]
    assert rec.of(EventKind.LOADED) == ["weights"]
    assert len(DECODES) == 1


def test_a_hit_upstream_of_two_dirty_stages_is_loaded_exactly_once(cache):
    model, p = tiny_net(), export_pipeline()
    run(p, model, cache)

    # weights stays a hit; bind (through to_onnx) and encodings both rerun and read it
    result, rec = run(p, model, cache, context={"opset": 17, "enc_version": "2.0.0"})

    assert result.report.ran == ["to_onnx", "bind", "encodings"]
    assert result.report["weights"].status == "hit"
    assert rec.of(EventKind.LOADED) == ["capture", "weights"]
    assert len(DECODES) == 2


def test_outputs_of_hits_are_loaded_only_when_asked_for(cache):
    model, p = tiny_net(), export_pipeline()
    fresh, _ = run(p, model, cache)
    expected = fresh.outputs["bind"]

    result, rec = run(p, model, cache)
    assert rec.of(EventKind.LOADED) == []

    assert result.outputs["bind"] == expected
    assert rec.of(EventKind.LOADED) == ["bind"]
    assert result.outputs["bind"] == expected
    assert rec.of(EventKind.LOADED) == ["bind"]


# --------------------------------------------------------------------------- declared reads


def _reads_secret(inputs, samples, ctx):
    return ctx["secret"]


def _gets_secret(inputs, samples, ctx):
    return ctx.get("secret", "default")


def _swallows_secret(inputs, samples, ctx):
    try:
        return ctx["secret"]
    except KeyError:
        return "default"


@pytest.mark.parametrize("fn", [_reads_secret, _gets_secret, _swallows_secret])
def test_an_undeclared_context_read_fails_naming_the_stage_and_the_key(cache, fn):
    p = Pipeline(name="undeclared")
    p.register_stage(fn, "sneaky", reads=("ctx.opset",))

    with pytest.raises(StageError) as err:
        p.run(None, context={"opset": 18, "secret": 42}, cache=cache)

    assert isinstance(err.value.cause, UndeclaredReadError)
    assert err.value.stage == "sneaky"
    assert "stage 'sneaky' read 'ctx.secret'" in str(err.value)
    assert "declares only: ctx.opset" in str(err.value)
    assert err.value.report["sneaky"].status == "failed"
    assert cache.stats().entries == 0


def test_a_declared_context_key_is_readable(cache):
    p = Pipeline(name="declared")
    p.register_stage(_reads_secret, "open", reads=("ctx.secret",))

    assert p.run(None, context={"secret": 42}, cache=cache).outputs["open"] == 42


def test_a_root_stage_that_declares_nothing_reruns_when_weights_change(cache):
    model = tiny_net()
    p = Pipeline(name="conservative")
    p.register_stage(stage("root", lambda m, s, c: 1), "root")
    run(p, model, cache)
    assert run(p, model, cache)[0].report.ran == []
    with torch.no_grad():
        model.fc.bias[0] += 1.0

    result, _ = run(p, model, cache)

    assert result.report.ran == ["root"]
    assert result.report["root"].reason.startswith("input.state:")


def test_a_non_root_stage_that_declares_nothing_reruns_on_any_context_change(cache):
    p = Pipeline(name="conservative")
    root = p.register_stage(stage("root", lambda m, s, c: 1), "root", reads=())
    p.register_stage(stage("child", lambda i, s, c: i[0] + 1), "child").depends_on(root)
    run(p, None, cache, context={"a": 1})

    changed, _ = run(p, None, cache, context={"a": 2})
    added, _ = run(p, None, cache, context={"a": 2, "b": 0})

    assert changed.report.ran == ["child"]
    assert changed.report["child"].reason == "ctx.a: 1 -> 2"
    assert added.report.ran == ["child"]
    assert added.report["child"].reason == "ctx.b: None -> 0"


# --------------------------------------------------------------------------- explain records


def test_last_run_record_holds_the_reads_of_each_stage(cache):
    model, p = tiny_net(), export_pipeline()
    run(p, model, cache)

    capture = cache.last_run("export", "capture")
    to_onnx = cache.last_run("export", "to_onnx")
    weights = cache.last_run("export", "weights")

    assert set(capture["reads"]) == {"input.structure", "samples.spec"}
    assert capture["reads"]["samples.spec"]["value"] == ["float32[1, 3, 8, 8]"]
    assert set(capture["reads"]["input.structure"]["details"]) == {"", "conv", "norm", "fc"}
    assert to_onnx["reads"]["ctx.opset"]["value"] == 18
    assert to_onnx["status"] == "ran"
    assert set(weights["reads"]["input.state"]["details"]) == {
        "conv.weight",
        "conv.bias",
        "norm.weight",
        "norm.bias",
        "fc.weight",
        "fc.bias",
    }


def test_weight_change_reason_names_the_tensors_that_changed(cache):
    model, p = tiny_net(), export_pipeline()
    run(p, model, cache)
    with torch.no_grad():
        model.fc.weight[1, 1] = 7.0
        model.norm.bias.fill_(0.5)

    result, _ = run(p, model, cache)

    reason = result.report["weights"].reason
    assert reason.startswith("input.state:")
    assert "2 tensors changed: fc.weight, norm.bias" in reason
    assert "conv.weight" not in reason


_HIDDEN = {"factor": 2}


def _reads_a_global(inputs, samples, context):
    return inputs.weight.detach().sum().item() * _HIDDEN["factor"]  # undeclared: a global


def test_check_mode_fails_loudly_when_a_hit_reads_something_undeclared(tmp_path):
    from graphbuild.errors import FingerprintMismatchError

    p = Pipeline()
    p.register_stage(_reads_a_global, "scaled", reads=("input.state",))
    model = torch.nn.Linear(2, 2)
    cache = Cache(tmp_path / "cache")
    p.run(model, (), cache=cache)
    _HIDDEN["factor"] = 3
    try:
        assert p.run(model, (), cache=cache).report.statuses == {"scaled": "hit"}  # stale
        with pytest.raises(StageError) as err:
            p.run(model, (), cache=cache, check=True)
        assert isinstance(err.value.cause, FingerprintMismatchError)
        assert "scaled" in str(err.value)
    finally:
        _HIDDEN["factor"] = 2


# --------------------------------------------------------------------------- rematerialize


def rematerializing_pipeline(bind=_bind) -> Pipeline:
    """export_pipeline with ``bind`` keeping only its digest in the cache."""
    p = export_pipeline()
    p.replace_stage("bind", stage("bind", bind), reads=())
    p.graph.nodes["bind"]["stage"] = replace(p._stage("bind"), rematerialize=True)
    return p


def test_a_rematerializing_stage_stores_its_digest_and_none_of_its_bytes(cache):
    first, _ = run(rematerializing_pipeline(), tiny_net(), cache)
    manifest = cache.lookup(first.report["bind"].key)
    assert manifest["artifact"]["digest"] == first.report["bind"].digest
    assert blob_refs(manifest["artifact"]) == [] and manifest["bytes"] == 0
    bind_blob = manifest["artifact"]["parts"][0][0]
    assert not cache.blobs.has(bind_blob, manifest["artifact"]["parts"][0][1])
    assert cache.lookup(first.report["weights"].key)["bytes"] > 0  # the others keep theirs


def test_a_rematerialized_hit_is_neither_run_nor_loaded_unless_asked_for(cache):
    run(rematerializing_pipeline(), tiny_net(), cache)
    second, rec = run(rematerializing_pipeline(), tiny_net(), cache)
    assert set(second.report.statuses.values()) == {"hit"}
    assert CALLS == [] and DECODES == [] and rec.of(EventKind.LOADED) == []


def test_a_rematerialized_hit_asked_for_is_recomputed_from_its_inputs(cache):
    fresh, _ = run(rematerializing_pipeline(), tiny_net(), cache)
    expected = fresh.outputs["bind"]
    result, rec = run(rematerializing_pipeline(), tiny_net(), cache)
    assert result.outputs["bind"] == expected
    assert CALLS == ["bind"]  # recomputed, once: its inputs loaded from the cache
    assert rec.of(EventKind.LOADED) == ["to_onnx", "weights", "bind"]
    assert result.outputs["bind"] == expected and CALLS == ["bind"]
    assert result.report["bind"].status == "hit"


def _ship(inputs, samples, ctx):
    return Box(f"{ctx['destination']}:{inputs[0].text}")


def test_a_rematerialized_dependency_feeds_a_dirty_dependent(cache):
    p = rematerializing_pipeline()
    p.register_stage(stage("ship", _ship), "ship", reads=("ctx.destination",)).depends_on("bind")
    model = tiny_net()
    first, _ = run(p, model, cache, context={**CONTEXT, "destination": "a"})
    result, _ = run(p, model, cache, context={**CONTEXT, "destination": "b"})
    assert result.report.ran == ["ship"] and result.report["bind"].status == "hit"
    assert result.outputs["ship"] == Box(f"b:{first.outputs['bind'].text}")


_SALT = {"value": "a"}


def _salted_bind(inputs, samples, ctx):
    return Box(" + ".join(i.text for i in inputs) + _SALT["value"])  # undeclared: a global


def test_a_rematerialized_stage_that_gives_another_output_fails_naming_it(cache):
    from graphbuild.errors import FingerprintMismatchError

    run(rematerializing_pipeline(_salted_bind), tiny_net(), cache)
    _SALT["value"] = "b"
    try:
        result, rec = run(rematerializing_pipeline(_salted_bind), tiny_net(), cache)
        with pytest.raises(StageError, match="'bind'") as err:
            result.outputs["bind"]
        assert isinstance(err.value.cause, FingerprintMismatchError)
        assert result.report["bind"].status == "failed"
        assert rec.of(EventKind.FAILED) == ["bind"]
    finally:
        _SALT["value"] = "a"


def test_check_mode_keeps_the_value_it_recomputed_for_a_rematerialized_hit(cache):
    run(rematerializing_pipeline(), tiny_net(), cache)
    result, rec = run(rematerializing_pipeline(), tiny_net(), cache, check=True)
    assert CALLS.count("bind") == 1
    result.outputs["bind"]
    assert CALLS.count("bind") == 1 and "bind" not in rec.of(EventKind.LOADED)


_RECORDED: list = []  # weak references to what ``_record`` returned


def _record(inputs, samples, ctx):
    value = torch.arange(1 << 16, dtype=torch.float32) * ctx["opset"]
    _RECORDED.append(weakref.ref(value))
    return value


def _use(inputs, samples, ctx):
    return float(inputs[0].sum())


def recording_pipeline(rematerialize: bool, use_rematerializes: bool = False) -> Pipeline:
    """record -> use, then ``later`` (reads neither): a large output that one stage reads."""
    p = Pipeline(name="recording")
    p.register_stage(
        stage("record", _record), "record", reads=("ctx.opset",), rematerialize=rematerialize
    )
    p.register_stage(
        stage("use", _use), "use", reads=(), rematerialize=use_rematerializes
    ).depends_on("record")
    p.register_stage(stage("later", lambda i, s, c: 1), "later", reads=("ctx.opset",))
    return p


def _alive_when_later_starts(rematerialize: bool, cache) -> tuple[list[bool], Any]:
    _RECORDED.clear()
    alive: list[bool] = []

    def listen(event):
        if event.stage == "later" and event.kind is EventKind.STARTED:
            gc.collect()
            alive.extend(r() is not None for r in _RECORDED)

    result = recording_pipeline(rematerialize).run(
        tiny_net(), SAMPLES, context=CONTEXT, cache=cache, listeners=[listen]
    )
    return alive, result


def test_a_rematerialized_output_is_let_go_once_no_stage_left_reads_it(cache):
    alive, _ = _alive_when_later_starts(True, cache)
    assert alive == [False]


def test_a_stored_output_is_kept_for_the_run(cache):
    alive, _ = _alive_when_later_starts(False, cache)
    assert alive == [True]


def test_a_large_stored_output_is_let_go_once_no_stage_left_reads_it(cache, monkeypatch):
    """An output at least ``release.LARGE_BYTES`` large, stored whole in the cache, is not
    held to the run's end either: placing it reads it back."""
    monkeypatch.setattr("graphbuild.engine.release.LARGE_BYTES", 1 << 16)
    alive, _ = _alive_when_later_starts(False, cache)
    assert alive == [False]


def test_a_stored_output_under_the_large_size_is_kept_for_the_run(cache, monkeypatch):
    monkeypatch.setattr("graphbuild.engine.release.LARGE_BYTES", (1 << 18) + 1)
    alive, _ = _alive_when_later_starts(False, cache)
    assert alive == [True]


def test_a_let_go_stored_output_is_read_back_from_the_cache_not_recomputed(cache, monkeypatch):
    monkeypatch.setattr("graphbuild.engine.release.LARGE_BYTES", 1 << 16)
    _, result = _alive_when_later_starts(False, cache)
    value = result.outputs["record"]
    assert CALLS == ["record", "use", "later"]
    assert torch.equal(value, torch.arange(1 << 16, dtype=torch.float32) * CONTEXT["opset"])


def test_a_let_go_stored_output_the_cache_lost_is_rebuilt(cache, monkeypatch):
    monkeypatch.setattr("graphbuild.engine.release.LARGE_BYTES", 1 << 16)
    _, result = _alive_when_later_starts(False, cache)
    result.wait_for_cache()
    for entry in cache.entries():
        cache.discard({"key": entry.key})
    value = result.outputs["record"]
    assert CALLS == ["record", "use", "later", "record"]
    assert torch.equal(value, torch.arange(1 << 16, dtype=torch.float32) * CONTEXT["opset"])


def test_without_a_cache_a_large_stored_output_is_kept(monkeypatch):
    monkeypatch.setattr("graphbuild.engine.release.LARGE_BYTES", 1 << 16)
    alive, result = _alive_when_later_starts(False, None)
    assert alive == [True]
    assert float(result.outputs["record"].sum()) == result.outputs["use"]


def test_a_let_go_output_read_after_the_run_is_recomputed_and_the_same(cache):
    _, result = _alive_when_later_starts(True, cache)
    assert CALLS == ["record", "use", "later"]
    value = result.outputs["record"]
    assert CALLS == ["record", "use", "later", "record"]
    assert torch.equal(value, torch.arange(1 << 16, dtype=torch.float32) * CONTEXT["opset"])
    assert result.report["record"].status == "ran"


def test_what_a_read_after_the_run_recomputes_is_let_go_again(cache):
    _RECORDED.clear()
    p = recording_pipeline(True, use_rematerializes=True)
    result = p.run(tiny_net(), SAMPLES, context=CONTEXT, cache=cache)
    assert result.outputs["use"] == float(torch.arange(1 << 16).sum()) * CONTEXT["opset"]
    assert CALLS == ["record", "use", "later", "record", "use"]
    gc.collect()
    assert [r() is not None for r in _RECORDED] == [False, False]


def test_a_let_go_output_is_recomputed_without_a_cache(cache):
    _, result = _alive_when_later_starts(True, None)
    assert float(result.outputs["record"].sum()) == result.outputs["use"]


def _frozen_now(inputs, samples, ctx):
    import gc

    return gc.get_freeze_count()


def test_a_run_collects_only_what_it_allocates_and_leaves_the_collector_as_it_was():
    import gc

    p = Pipeline(name="gc")
    p.register_stage(_frozen_now, "frozen", reads=())
    before = [object() for _ in range(100)]  # objects that exist before the run

    frozen_during = p.run(None, cache=None).outputs["frozen"]

    assert frozen_during >= len(before)  # they were left alone while it ran
    assert gc.get_freeze_count() == 0
    gc.freeze()  # a process that freezes objects itself keeps them frozen
    try:
        p.run(None, cache=None)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
