"""Sound, stable keys (issue 8): never a stale artifact, never a needless re-trace.

Each test reproduces one defect found on real models: a stage editing its input in place,
registries missing from keys, fingerprints that depend on the process, a marker graph that
changed with the preset, and the smaller holes (ndarray shape, the package digest).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import graphbuild as gb
import graphbuild.engine.codecs as codecs
from graphbuild.engine.codecs import Encoded, JsonCodec, Part, encode, register_codec, roundtrip
from graphbuild.engine.fingerprint import (
    callable_version,
    fingerprint,
    fingerprint_type,
    function_files,
    structure_fingerprint,
)
from graphbuild.engine.pipeline import Pipeline
from graphbuild.errors import InputMutationError, StageError
from graphbuild.frontend.normalize import recognizers, register_recognizer
from graphbuild.frontend.programs import ProgramArtifact
from graphbuild.frontend.quantize import QUANTIZER_PRESETS
from graphbuild.targets.qnn import build_qnn_pipeline
from tests.models import FakeQuantConvNet

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = (torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(3)),)


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return FakeQuantConvNet().eval()


def export(out, cache, model=None, factory=None, **options):
    return gb.export(
        model if model is not None else convnet(),
        SAMPLE,
        out,
        "model",
        options=gb.QnnOnnxOptions(**options),
        cache=cache,
        pipeline_factory=factory,
    )


def files(art) -> dict[str, bytes]:
    return {k: Path(v).read_bytes() for k, v in art.files.items() if k != "lock"}


# --------------------------------------------------------------------------- 1. in place


def relu_to_clamp(program: torch.export.ExportedProgram) -> None:
    """An FX pass that edits the graph in place, as FX passes usually do."""
    gm = program.graph_module
    for node in list(gm.graph.nodes):
        if node.target == torch.ops.aten.relu.default:
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(torch.ops.aten.clamp_min.default, (node.args[0], 0.0))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
    gm.recompile()


def clamp_in_place(inputs, samples, context):
    (marker,) = inputs
    relu_to_clamp(marker.program)
    return marker


def clamp_a_copy(inputs, samples, context):
    (marker,) = inputs
    program = copy.deepcopy(marker.program)
    relu_to_clamp(program)
    return ProgramArtifact(program)


def after_marker_graph(fn):
    def factory(request):
        p = build_qnn_pipeline(request)
        p.insert_stage_after("marker_graph", fn, "clamp", reads=())
        return p

    return factory


def test_a_stage_that_edits_its_input_program_in_place_fails_naming_itself(tmp_path):
    with pytest.raises(StageError) as info:
        export(tmp_path / "out", tmp_path / "cache", factory=after_marker_graph(clamp_in_place))

    assert info.value.stage == "clamp"
    assert isinstance(info.value.cause, InputMutationError)
    assert "'marker_graph'" in str(info.value) and "copy" in str(info.value)


def test_a_stage_that_edits_a_copy_gives_the_uncached_result_cold_and_warm(tmp_path):
    factory = after_marker_graph(clamp_a_copy)
    uncached = export(tmp_path / "plain", False, factory=factory, check_numerics=True)
    cold = export(tmp_path / "cold", tmp_path / "cache", factory=factory)
    warm = export(tmp_path / "warm", tmp_path / "cache", factory=factory)

    assert set(warm.report.statuses.values()) == {"hit"}
    assert files(cold) == files(uncached) == files(warm)
    assert uncached.report.extra["numerics"]["outputs"][0]["max_error_steps"] == 0.0


def test_a_stage_that_writes_into_an_upstream_tensor_fails_and_its_sibling_never_sees_it(
    tmp_path,
):
    seen = []

    def weights(inputs, samples, ctx):
        return {"w": torch.zeros(3)}

    def bump(inputs, samples, ctx):
        (state,) = inputs
        state["w"].add_(1.0)
        return state

    def total(inputs, samples, ctx):
        seen.append(float(inputs[0]["w"].sum()))
        return float(inputs[0]["w"].sum())

    p = Pipeline(name="siblings")
    p.register_stage(weights, "weights", reads=())
    p.register_stage(bump, "bump", reads=()).depends_on("weights")
    p.register_stage(total, "total", reads=()).depends_on("weights")

    with pytest.raises(StageError) as info:
        p.run(None, cache=gb.Cache(tmp_path / "cache"))

    assert info.value.stage == "bump" and isinstance(info.value.cause, InputMutationError)
    assert seen == []  # the failure stops the run before a sibling reads the edited tensor


def _nested_append(doc):
    doc["sites"][1]["qids"].append(3)


def _value_change(doc):
    doc["sites"][0]["bits"] = 4


def _new_key(doc):
    doc["extra"] = None


def _list_to_tuple(doc):
    doc["sites"][1]["qids"] = (1, 2)


@pytest.mark.parametrize("edit", [_nested_append, _value_change, _new_key, _list_to_tuple])
def test_a_stage_that_edits_a_json_document_its_upstream_returned_fails(tmp_path, edit):
    """After an earlier reader checked the document unchanged, a later one edits it: the
    token the first check left is the one the edit is measured against."""
    read = []

    def layout(inputs, samples, ctx):
        return ({"sites": [{"bits": 8}, {"qids": [1, 2]}]}, torch.ones(2))

    def reader(inputs, samples, ctx):
        read.append(len(inputs[0][0]["sites"]))
        return 0

    def editor(inputs, samples, ctx):
        edit(inputs[0][0])
        return 1

    p = Pipeline(name="json-edit")
    p.register_stage(layout, "layout", reads=())
    p.register_stage(reader, "reader", reads=()).depends_on("layout")
    p.register_stage(editor, "edit", reads=()).depends_on("layout", "reader")

    with pytest.raises(StageError) as info:
        p.run(None, cache=gb.Cache(tmp_path / "cache"))

    assert read == [2]
    assert info.value.stage == "edit" and isinstance(info.value.cause, InputMutationError)


def test_a_stage_that_edits_its_input_then_raises_leaves_the_next_reader_unblamed(tmp_path):
    """The failed stage's edit is never checked; a later reader of the value takes its own
    token, so it is not named for an edit it did not make."""

    def layout(inputs, samples, ctx):
        return {"sites": [1, 2]}

    def breaks(inputs, samples, ctx):
        inputs[0]["sites"].append(3)
        raise ValueError("broken stage")

    def reader(inputs, samples, ctx):
        return len(inputs[0]["sites"])

    p = Pipeline(name="edit-then-raise")
    p.register_stage(layout, "layout", reads=())
    p.register_stage(breaks, "breaks", reads=()).depends_on("layout")
    p.register_stage(reader, "reader", reads=()).depends_on("layout")

    with pytest.raises(StageError) as info:
        p.run(None, cache=gb.Cache(tmp_path / "cache"))

    assert info.value.stage == "breaks" and isinstance(info.value.cause, ValueError)


def test_encoding_a_program_leaves_its_metadata_as_it_was():
    program = torch.export.export(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), (torch.ones(1, 2),))
    before = {n.name: n.meta.get("stack_trace") for n in program.graph.nodes}
    assert any(before.values())

    encode(ProgramArtifact(program))

    assert {n.name: n.meta.get("stack_trace") for n in program.graph.nodes} == before


def test_a_roundtripped_value_edited_after_its_first_encoding_is_encoded_afresh():
    value = roundtrip({"a": [1, 2]})
    first = encode(value)  # the scheduler's encoding of the stage that made it

    value["a"].append(3)

    assert encode(value).digest != first.digest
    assert encode(value).digest == encode({"a": [1, 2, 3]}).digest


# --------------------------------------------------------------------------- 2. registries


class SymmetricActivations:
    """A user recogniser: per-tensor fake quantizers, declared symmetric."""

    def __init__(self):
        self.inner = next(r for r in recognizers() if "per_tensor_affine" in repr(r))

    def match(self, node, program):
        m = self.inner.match(node, program)
        return None if m is None else dataclasses.replace(m, symmetric=True)


def test_registering_a_recognizer_reruns_normalize_with_its_result(tmp_path):
    cache = tmp_path / "cache"
    before = export(tmp_path / "a", cache)
    recognizer = register_recognizer(SymmetricActivations(), first=True)
    try:
        cached = export(tmp_path / "b", cache)
        uncached = export(tmp_path / "c", False)
    finally:
        from graphbuild.frontend.normalize import unregister_recognizer

        unregister_recognizer(recognizer)

    assert cached.report.statuses["capture"] == "hit"
    assert cached.report.statuses["normalize"] == "ran"
    assert "registry.recognizers" in cached.report["normalize"].reason
    assert files(cached) == files(uncached) != files(before)


def test_replacing_a_quantizer_preset_reruns_quantize_with_the_new_preset(tmp_path, monkeypatch):
    from examples import convnet

    model, samples = convnet.build()
    calibration = convnet.calibration()

    def run(out, cache):
        return gb.export(
            model,
            samples,
            out,
            "m",
            options=gb.QnnOnnxOptions(quantizer="w8a8", calibration=calibration),
            cache=cache,
        )

    before = run(tmp_path / "a", tmp_path / "cache")
    monkeypatch.setitem(QUANTIZER_PRESETS, "w8a8", QUANTIZER_PRESETS["w4a16"])
    cached = run(tmp_path / "b", tmp_path / "cache")
    uncached = run(tmp_path / "c", False)
    # a preset a user replaced is not graphbuild's: PT2E runs as one stage
    assert "place_quantizers" in before.report.statuses
    assert "place_quantizers" not in cached.report.statuses
    assert cached.report.statuses["quantize"] == "ran"
    assert files(cached) == files(uncached) != files(before)

    monkeypatch.setitem(QUANTIZER_PRESETS, "w8a8", QUANTIZER_PRESETS["w8a16"])
    again = run(tmp_path / "d", tmp_path / "cache")
    assert again.report.statuses["quantize"] == "ran"
    assert "registry.quantizer_presets" in again.report["quantize"].reason
    assert files(again) == files(run(tmp_path / "e", False)) != files(cached)


class LoudJsonCodec(JsonCodec):
    """The built-in JSON codec's replacement: same name, different bytes."""

    def encode(self, value):
        return Encoded(self.name, {"loud": True}, [Part(repr(value).upper().encode())])


def test_an_entry_written_by_a_codec_that_was_replaced_since_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setattr(codecs, "_CODECS", list(codecs._CODECS))
    monkeypatch.setattr(codecs, "_BY_NAME", dict(codecs._BY_NAME))
    p = Pipeline(name="codecs")
    p.register_stage(make_json, "make", reads=())
    cache = gb.Cache(tmp_path / "cache")
    first = p.run(None, cache=cache).report
    assert p.run(None, cache=cache).report.statuses == {"make": "hit"}

    register_codec(LoudJsonCodec())
    second = p.run(None, cache=cache).report

    assert second["make"].status == "ran"
    assert "codec 'json'" in second["make"].reason
    assert second["make"].digest != first["make"].digest
    assert p.run(None, cache=cache).report.statuses == {"make": "hit"}


def make_json(inputs, samples, ctx):
    return {"x": 1}


@dataclasses.dataclass
class Knob:
    name: str


def test_a_registered_fingerprint_function_is_part_of_the_fingerprint():
    before = fingerprint(Knob("a"))

    @fingerprint_type.register(Knob)
    def _(value, walk):
        return value.name

    try:
        first = fingerprint(Knob("a"))

        @fingerprint_type.register(Knob)
        def _(value, walk):  # same values, other code: what "equal" means has changed
            return str(value.name)

        second = fingerprint(Knob("a"))
    finally:
        fingerprint_type.register(Knob, fingerprint_type.dispatch(object))

    assert len({str(before), str(first), str(second)}) == 3


# --------------------------------------------------------------------------- 3. processes


def test_a_generation_config_hash_does_not_reach_the_structure():
    transformers = pytest.importorskip(
        "transformers", reason="builds a transformers model (the dev extra)"
    )
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    before = structure_fingerprint(model).digest

    model.generation_config._original_object_hash = 12345  # what another process computes

    assert structure_fingerprint(model).digest == before


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


def test_an_lstm_is_cached_and_its_weights_are_state_not_structure(tmp_path):
    torch.manual_seed(0)
    model = Recurrent().eval()
    before = structure_fingerprint(model).digest  # weakrefs used to make this raise

    with torch.no_grad():
        model.lstm.weight_ih_l0.add_(1.0)

    assert structure_fingerprint(model).digest == before
    p = Pipeline(name="lstm")
    p.register_stage(lambda m, s, c: 1, "capture", reads=("input.structure",))
    cache = gb.Cache(tmp_path / "cache")
    p.run(model, cache=cache)
    assert p.run(model, cache=cache).report.statuses == {"capture": "hit"}


def test_code_without_source_has_the_same_version_whatever_its_address():
    source = "def f(x):\n    g = lambda y: y in {'a', 'b', 'c'}\n    return g(x)\n"
    made = []
    for _ in range(2):
        scope: dict = {}
        exec(compile(source, "<generated>", "exec"), scope)
        made.append(scope["f"])

    assert made[0].__code__.co_consts != ()  # holds the lambda's code object
    assert callable_version(made[0]) == callable_version(made[1])


SCRIPT = """
import sys
import torch
from torch import nn
import graphbuild as gb


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu()


def export(out):
    torch.manual_seed(0)
    return gb.export(Net().eval(), (torch.ones(1, 4),), out, "net", cache=sys.argv[1])


if __name__ == "__main__":
    export(sys.argv[2] + "/a")
    report = export(sys.argv[2] + "/b").report
    print("STATUSES", sorted(set(report.statuses.values())))
    print("REASON", report["capture"].reason)
"""


def test_a_script_that_imports_graphbuild_exports_twice_without_a_retrace(tmp_path):
    script = tmp_path / "export_twice.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "cache"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "STATUSES ['hit']" in done.stdout, done.stdout


def test_a_module_imported_inside_forward_is_in_the_closure_before_forward_runs(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "gb_lazy_helper.py").write_text("def act(x):\n    return x.relu()\n")
    (tmp_path / "gb_lazy_model.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.fc = nn.Linear(2, 2)

                def forward(self, x):
                    from gb_lazy_helper import act

                    return act(self.fc(x))
            """
        )
    )
    importlib.invalidate_caches()
    module = importlib.import_module("gb_lazy_model")
    monkeypatch.setitem(sys.modules, "gb_lazy_model", module)
    before = structure_fingerprint(module.Net()).digest
    assert "gb_lazy_helper" not in sys.modules

    (tmp_path / "gb_lazy_helper.py").write_text("def act(x):\n    return x.sigmoid()\n")

    assert structure_fingerprint(module.Net()).digest != before


# --------------------------------------------------------------------------- 4. GQA preset


def test_a_grouped_query_decoder_keeps_its_onnx_graph_across_a_preset_change(tmp_path):
    pytest.importorskip("transformers", reason="builds a transformers model (the dev extra)")
    from examples import tiny_llama

    model, samples = tiny_llama.build()  # 4 query heads, 2 key/value heads
    assert model.model.config.num_key_value_heads < model.model.config.num_attention_heads
    calibration = tiny_llama.calibration(batches=2)
    reports = [
        gb.export(
            model,
            samples,
            tmp_path / preset,
            "m",
            options=gb.QnnOnnxOptions(quantizer=preset, calibration=calibration),
            cache=tmp_path / "cache",
        ).report
        for preset in ("w8a16", "w8a8")
    ]

    assert reports[1]["marker_graph"].digest == reports[0]["marker_graph"].digest
    # the presets share one placement: the marker graph and the ONNX export are hits
    assert reports[1].statuses["marker_graph"] == reports[1].statuses["to_onnx"] == "hit"


# --------------------------------------------------------------------------- 5. smaller


def test_ndarrays_of_equal_bytes_and_different_shapes_differ():
    assert fingerprint(np.zeros((2, 3))) != fingerprint(np.zeros((3, 2)))


def test_a_stage_keys_on_the_files_it_uses_not_on_the_whole_package():
    from graphbuild.frontend.capture import capture as capture_stage
    from graphbuild.targets.qnn.pipeline.outputs import encodings as encodings_stage

    capture = function_files(capture_stage)
    encodings = function_files(encodings_stage)

    assert "graphbuild.frontend.capture" in capture
    assert "graphbuild.targets.qnn.encodings" not in capture
    assert "graphbuild.targets.qnn.encodings" in encodings


def test_a_user_stage_keys_on_the_helper_module_it_calls(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "gb_stage_helper.py").write_text("def scale():\n    return 2\n")
    (tmp_path / "gb_stage_mod.py").write_text(
        "from gb_stage_helper import scale\n\n\ndef stage(inputs, samples, ctx):\n"
        "    return scale()\n"
    )
    importlib.invalidate_caches()
    module = importlib.import_module("gb_stage_mod")
    monkeypatch.setitem(sys.modules, "gb_stage_mod", module)
    monkeypatch.setitem(sys.modules, "gb_stage_helper", sys.modules["gb_stage_helper"])
    p = Pipeline(name="helper")
    p.register_stage(module.stage, "stage", reads=())
    cache = gb.Cache(tmp_path / "cache")
    p.run(None, cache=cache)

    (tmp_path / "gb_stage_helper.py").write_text("def scale():\n    return 3  # edited\n")
    module = importlib.reload(sys.modules["gb_stage_helper"])

    report = p.run(None, cache=cache).report
    assert report.statuses == {"stage": "ran"}


# --------------------------------------------------------------------------- 6. the audit
# Defects of the same classes found after the five above were fixed.


def siblings(edit) -> Pipeline:
    """weights -> edit, weights -> total: ``edit`` is handed the state dict ``total`` reads."""

    def weights(inputs, samples, ctx):
        return {"w": torch.zeros(3)}

    def total(inputs, samples, ctx):
        return float(inputs[0]["w"].sum())

    p = Pipeline(name="siblings")
    p.register_stage(weights, "weights", reads=())
    p.register_stage(edit, "edit", reads=()).depends_on("weights")
    p.register_stage(total, "total", reads=()).depends_on("weights")
    return p


def write_through_data(inputs, samples, ctx):
    inputs[0]["w"].data.add_(1.0)  # .data has a version counter of its own
    return 0


def write_through_numpy(inputs, samples, ctx):
    inputs[0]["w"].numpy()[:] += 1.0  # numpy keeps no version counter at all
    return 0


@pytest.mark.parametrize("edit", [write_through_data, write_through_numpy])
def test_a_stage_that_writes_into_an_upstream_tensor_behind_torchs_back_fails(tmp_path, edit):
    with pytest.raises(StageError) as info:
        siblings(edit).run(None, cache=gb.Cache(tmp_path / "cache"))

    assert info.value.stage == "edit" and isinstance(info.value.cause, InputMutationError)
    assert "'weights'" in str(info.value)


def test_a_stage_that_writes_into_a_bound_models_array_fails(tmp_path):
    import onnx

    from graphbuild.onnx.bind import BoundModel

    def bound(inputs, samples, ctx):
        return BoundModel(onnx.ModelProto(ir_version=10), {"w": np.zeros(4, np.float32)})

    def scale(inputs, samples, ctx):
        array = inputs[0].tensors["w"]
        array *= 2.0  # same object, same address: only the contents moved
        array += 1.0
        return 0

    p = Pipeline(name="bound")
    p.register_stage(bound, "bound", reads=())
    p.register_stage(scale, "scale", reads=()).depends_on("bound")

    with pytest.raises(StageError) as info:
        p.run(None, cache=gb.Cache(tmp_path / "cache"))

    assert info.value.stage == "scale" and isinstance(info.value.cause, InputMutationError)


def model_reader(edit):
    """capture -> edit (reads input.state), capture -> later (reads input.state)."""
    p = Pipeline(name="model")
    p.register_stage(lambda m, s, c: 0, "capture", reads=("input.structure",))
    p.register_stage(edit, "edit", reads=("input.state",)).depends_on("capture")
    p.register_stage(
        lambda i, s, c: float(c.input.weight.sum()), "later", reads=("input.state",)
    ).depends_on("capture")
    return p


def bump_the_model(inputs, samples, ctx):
    with torch.no_grad():
        ctx.input.weight.add_(1.0)
    return 0


def bump_the_model_through_data(inputs, samples, ctx):
    ctx.input.weight.data.add_(1.0)
    return 0


def test_a_stage_that_writes_into_the_model_fails_naming_itself(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(StageError) as info:
        model_reader(bump_the_model).run(model, cache=gb.Cache(tmp_path / "cache"))

    assert info.value.stage == "edit" and isinstance(info.value.cause, InputMutationError)
    assert "the model" in str(info.value)


def test_check_mode_catches_a_write_into_the_model_behind_torchs_back(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(StageError) as info:
        model_reader(bump_the_model_through_data).run(
            model, cache=gb.Cache(tmp_path / "cache"), check=True
        )

    assert info.value.stage == "edit" and isinstance(info.value.cause, InputMutationError)


def test_a_stage_that_writes_into_the_sample_inputs_fails_naming_itself(tmp_path):
    def bump(inputs, samples, ctx):
        samples[0].add_(1.0)
        return 0

    p = Pipeline(name="samples")
    p.register_stage(lambda m, s, c: 0, "capture", reads=("samples.spec",))
    p.register_stage(bump, "edit", reads=()).depends_on("capture")

    with pytest.raises(StageError) as info:
        p.run(None, (torch.zeros(2),), cache=gb.Cache(tmp_path / "cache"))

    assert info.value.stage == "edit" and isinstance(info.value.cause, InputMutationError)
    assert "sample inputs" in str(info.value)


def captured_linear(inputs, samples, ctx):
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    return ProgramArtifact(torch.export.export(model, (torch.ones(1, 2),)))


def tag_nodes(inputs, samples, ctx):
    for node in inputs[0].program.graph.nodes:
        node.meta["custom"] = {"tagged": "yes"}  # what torch's serializer keeps
    return 0


def rename_module_stack(inputs, samples, ctx):
    for node in inputs[0].program.graph.nodes:
        for key, (path, cls) in list(node.meta.get("nn_module_stack", {}).items()):
            node.meta["nn_module_stack"][key] = ("renamed." + path, cls)
    return 0


@pytest.mark.parametrize("edit", [tag_nodes, rename_module_stack])
def test_a_stage_that_edits_node_metadata_of_its_input_program_fails(tmp_path, edit):
    before = encode(captured_linear((), None, None)).digest
    edited = captured_linear((), None, None)
    edit((edited,), None, None)
    assert encode(edited).digest != before  # the metadata is part of the artifact

    p = Pipeline(name="meta")
    p.register_stage(captured_linear, "capture", reads=())
    p.register_stage(edit, "edit", reads=()).depends_on("capture")

    with pytest.raises(StageError) as info:
        p.run(None, cache=gb.Cache(tmp_path / "cache"))

    assert info.value.stage == "edit" and isinstance(info.value.cause, InputMutationError)


def test_the_quantizer_preset_registry_reads_the_same_whatever_was_imported_before():
    code = textwrap.dedent(
        """
        import sys
        import graphbuild.frontend
        from graphbuild.engine.fingerprint import read_registry
        first = read_registry("quantizer_presets").digest
        print("TORCHAO", "torchao" in sys.modules)
        import graphbuild.targets.qnn.presets.quantizer  # registers the QNN presets
        print("SAME", read_registry("quantizer_presets").digest == first)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SAME True" in done.stdout
    assert "TORCHAO False" in done.stdout  # reading the registry imports no torchao


def test_a_replaced_builtin_preset_changes_the_registry_reading():
    from graphbuild.engine.fingerprint import read_registry
    from graphbuild.targets.qnn.presets import quantizer  # noqa: F401  - registers the QNN presets

    before = read_registry("quantizer_presets").digest
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(QUANTIZER_PRESETS, "w8a8", QUANTIZER_PRESETS["w4a16"])
        replaced = read_registry("quantizer_presets").digest
    assert replaced != before
    assert read_registry("quantizer_presets").digest == before


def test_the_qnn_quantize_stage_keys_on_the_builtin_presets_it_loads():
    from graphbuild.frontend.capture import capture
    from graphbuild.targets.qnn.pipeline.quantize import quantize

    assert "graphbuild.targets.qnn.presets.quantizer" in function_files(quantize)
    assert "graphbuild.targets.qnn.presets.quantizer" not in function_files(capture)


def test_a_preset_registered_before_the_builtins_load_keeps_its_name(monkeypatch):
    from graphbuild.frontend import presets
    from graphbuild.targets.qnn.presets import quantizer  # noqa: F401  - registers the QNN presets

    def mine():
        return QUANTIZER_PRESETS["w4a16"]()

    monkeypatch.setattr(presets, "_BUILTIN_FACTORIES", {})
    monkeypatch.setattr(presets, "QUANTIZER_PRESETS", {"w8a8": mine})

    presets.register_preset("w8a8", QUANTIZER_PRESETS["w8a8"])  # a built-in, loaded late

    assert presets.QUANTIZER_PRESETS["w8a8"] is mine


def on_forward(module, args, output):
    return None


def hooked() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    model[0].register_forward_hook(on_forward, with_kwargs=False, always_call=True)
    model[1].register_forward_pre_hook(lambda m, args: None)
    return model


def test_forward_hooks_reach_the_structure_without_their_handle_ids():
    first = structure_fingerprint(hooked()).digest
    for _ in range(3):  # hook handles come from one global counter
        nn.Linear(1, 1).register_forward_hook(on_forward)

    assert structure_fingerprint(hooked()).digest == first
    plain = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert structure_fingerprint(plain).digest != first  # the hooks themselves still count


class TracedInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))

    def forward(self, x):
        return self.g(x)


def test_weights_of_a_graph_module_inside_the_model_are_state_not_structure():
    torch.manual_seed(0)
    model = TracedInside()
    before = structure_fingerprint(model).digest

    with torch.no_grad():
        model.g.get_submodule("0").weight.add_(1.0)

    assert structure_fingerprint(model).digest == before


def test_a_graph_module_with_many_nodes_has_a_structure_fingerprint():
    torch.manual_seed(0)
    layers = [m for _ in range(10) for m in (nn.Linear(2, 2), nn.ReLU())]
    model = nn.Sequential(torch.fx.symbolic_trace(nn.Sequential(*layers)))

    assert structure_fingerprint(model).digest  # no "nested too deep" along the node list


def test_a_torchao_quantizer_object_has_a_fingerprint_that_follows_its_preset():
    from graphbuild.engine.fingerprint import read_value
    from graphbuild.targets.qnn.presets.quantizer import QnnQuantizer

    w8a16, again, w8a8 = (read_value(QnnQuantizer(p)) for p in ("w8a16", "w8a16", "w8a8"))

    assert w8a16.digest is not None, w8a16.reason
    assert w8a16.digest == again.digest != w8a8.digest
    assert fingerprint(torch.per_tensor_affine) != fingerprint(torch.per_channel_symmetric)


class Scaler:
    def __init__(self, k):
        self.k = k

    def scale(self, x):
        return x * self.k


class WithExtra(nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.extra = extra

    def forward(self, x):
        return self.fc(x)


def _double(x):
    return 2 * x


def _triple(x):
    return 3 * x


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (Scaler(1).scale, Scaler(2).scale),  # a bound method: its object counts
        (functools.lru_cache(_double), functools.lru_cache(_triple)),  # the wrapped function
        (staticmethod(_double), staticmethod(_triple)),
    ],
    ids=["bound-method", "lru-cache", "staticmethod"],
)
def test_callables_held_as_attributes_fingerprint_what_they_call(one, other):
    def digest(extra):
        torch.manual_seed(0)
        return structure_fingerprint(WithExtra(extra)).digest

    assert digest(one) != digest(other)


def test_a_stage_that_is_a_bound_method_keys_on_its_object():
    assert callable_version(Scaler(1).scale) != callable_version(Scaler(2).scale)


def test_a_user_module_held_as_an_attribute_is_fingerprinted_by_its_source(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "gb_ops_helper.py").write_text("def act(x):\n    return x.relu()\n")
    importlib.invalidate_caches()
    ops = importlib.import_module("gb_ops_helper")
    monkeypatch.setitem(sys.modules, "gb_ops_helper", ops)
    before = fingerprint(ops)

    (tmp_path / "gb_ops_helper.py").write_text("def act(x):\n    return x.sigmoid()\n")

    assert fingerprint(ops) != before


class Box:
    """Sample inputs in a container whose pytree context has no repr of its own."""

    def __init__(self, x):
        self.x = x


class Opaque:
    pass


torch.utils._pytree.register_pytree_node(
    Box, lambda box: ([box.x], Opaque()), lambda children, context: Box(children[0])
)


def test_a_repr_that_holds_an_address_is_refused_not_fingerprinted():
    from graphbuild.engine.fingerprint import InputFacets

    reading = InputFacets(None, (Box(torch.ones(2)),)).read("samples.spec")

    assert reading.digest is None
    assert "memory address" in reading.reason


class Runner:
    def __init__(self):
        self.how = threading.Lock()  # nothing to fingerprint it by

    def run(self, inputs, samples, ctx):
        return 1


def test_a_stage_whose_code_cannot_be_fingerprinted_reruns_with_the_reason(tmp_path):
    p = Pipeline(name="bound")
    p.register_stage(Runner().run, "run", reads=())
    cache = gb.Cache(tmp_path / "cache")
    p.run(None, cache=cache)
    report = p.run(None, cache=cache).report

    assert report.statuses == {"run": "ran"}
    assert "cannot be cached" in report["run"].reason and "lock" in report["run"].reason


def test_a_stage_keys_on_a_helper_module_it_reaches_through_a_module_level_alias(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "gb_alias_helper.py").write_text("def scale():\n    return 2\n")
    (tmp_path / "gb_alias_stage.py").write_text(
        "import gb_alias_helper as _h\n\nscale = _h.scale\n\n\n"
        "def stage(inputs, samples, ctx):\n    return scale()\n"
    )
    importlib.invalidate_caches()
    module = importlib.import_module("gb_alias_stage")
    monkeypatch.setitem(sys.modules, "gb_alias_stage", module)
    monkeypatch.setitem(sys.modules, "gb_alias_helper", sys.modules["gb_alias_helper"])
    before = function_files(module.stage)
    assert "gb_alias_helper" in before

    (tmp_path / "gb_alias_helper.py").write_text("def scale():\n    return 3  # edited\n")

    assert function_files(module.stage) != before


def test_a_stage_keys_on_helpers_it_reaches_through_a_class_and_a_decorated_function(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "gb_cls_helper.py").write_text("def scale():\n    return 2\n")
    (tmp_path / "gb_deco_helper.py").write_text("def shift():\n    return 1\n")
    (tmp_path / "gb_cls_stage.py").write_text(
        textwrap.dedent(
            """
            import functools

            import gb_cls_helper
            import gb_deco_helper


            class Scaler:
                def value(self):
                    return gb_cls_helper.scale()


            @functools.lru_cache
            def shifted():
                return gb_deco_helper.shift()


            def stage(inputs, samples, ctx):
                return Scaler().value() + shifted()
            """
        )
    )
    importlib.invalidate_caches()
    module = importlib.import_module("gb_cls_stage")
    monkeypatch.setitem(sys.modules, "gb_cls_stage", module)

    reached = function_files(module.stage)

    assert {"gb_cls_helper", "gb_deco_helper"} <= set(reached)


def test_the_onnx_codec_version_covers_what_encode_and_decode_use_not_bind_or_save():
    from graphbuild.engine.scheduler import codec_files

    onnx_files = codec_files("onnx")
    bound_files = codec_files("bound_onnx")

    assert "graphbuild.onnx.codecs" in onnx_files
    assert "graphbuild.onnx.bind" not in onnx_files
    assert "graphbuild.onnx.save" not in onnx_files
    assert "graphbuild.onnx.bind" in bound_files  # BoundModel is defined there
    assert "graphbuild.onnx.save" not in bound_files


def test_key_computation_reuses_code_closures_and_still_sees_edits(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "gb_memo_helper.py").write_text("def scale():\n    return 2\n")
    (tmp_path / "gb_memo_stage.py").write_text(
        "from gb_memo_helper import scale\n\n\ndef stage(inputs, samples, ctx):\n"
        "    return scale()\n"
    )
    importlib.invalidate_caches()
    module = importlib.import_module("gb_memo_stage")
    monkeypatch.setitem(sys.modules, "gb_memo_stage", module)
    monkeypatch.setitem(sys.modules, "gb_memo_helper", sys.modules["gb_memo_helper"])
    first = function_files(module.stage)
    looked_up = []
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda *a: looked_up.append(a) or real(*a))

    assert function_files(module.stage) == first
    assert looked_up == []  # the second key computation finds no module spec again

    (tmp_path / "gb_memo_helper.py").write_text("def scale():\n    return 3  # edited\n")
    assert function_files(module.stage) != first


def make_stage(scale):
    def stage(inputs, samples, ctx, *, scale=scale):
        return scale

    return stage


def test_a_stage_keys_on_its_keyword_only_defaults():
    assert callable_version(make_stage(2)) != callable_version(make_stage(3))


def test_an_edit_that_keeps_the_files_size_and_mtime_is_still_seen(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    helper = tmp_path / "gb_racy_helper.py"
    helper.write_text("def act(x):\n    return x.relu()\n")
    (tmp_path / "gb_racy_stage.py").write_text(
        "from gb_racy_helper import act\n\n\ndef stage(inputs, samples, ctx):\n"
        "    return act(inputs)\n"
    )
    importlib.invalidate_caches()
    module = importlib.import_module("gb_racy_stage")
    monkeypatch.setitem(sys.modules, "gb_racy_stage", module)
    monkeypatch.setitem(sys.modules, "gb_racy_helper", sys.modules["gb_racy_helper"])
    first = function_files(module.stage)
    stamp = helper.stat()

    helper.write_text("def act(x):\n    return x.tanh()\n")  # same size, same clock tick
    os.utime(helper, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))

    assert function_files(module.stage) != first


class Bag:
    """A stage output whose codec cannot tell a change in place (no snapshot)."""

    def __init__(self, items):
        self.items = items


class BagCodec(codecs.Codec):
    name = "test_bag"
    types = (Bag,)

    def encode(self, value):
        return Encoded(self.name, None, [Part(repr(value.items).encode())])

    def decode(self, meta, parts, children):
        return Bag(eval(bytes(parts[0]).decode()))  # noqa: S307 - the test's own bytes


def bag_pipeline():
    def make(inputs, samples, ctx):
        return Bag([1, 2])

    def append_in_place(inputs, samples, ctx):
        inputs[0].items.append(3)
        return 0

    p = Pipeline(name="bags")
    p.register_stage(make, "make", reads=())
    p.register_stage(append_in_place, "edit", reads=()).depends_on("make")
    return p


def test_check_mode_re_encodes_the_inputs_a_codec_cannot_snapshot(tmp_path, monkeypatch):
    monkeypatch.setattr(codecs, "_CODECS", list(codecs._CODECS))
    monkeypatch.setattr(codecs, "_BY_NAME", dict(codecs._BY_NAME))
    register_codec(BagCodec())

    bag_pipeline().run(None, cache=gb.Cache(tmp_path / "quiet"))  # no token: not seen
    with pytest.raises(StageError) as info:
        bag_pipeline().run(None, cache=gb.Cache(tmp_path / "checked"), check=True)

    assert info.value.stage == "edit" and isinstance(info.value.cause, InputMutationError)
    assert "different digest" in str(info.value)


class HoldsCallables(nn.Module):
    """Callables that reach a submodule: a lambda's cell, a partial's argument."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        fc = self.fc
        self.through_cell = lambda x: fc(x)
        self.through_partial = functools.partial(nn.functional.linear, weight=self.fc.weight)

    def forward(self, x):
        return self.through_cell(x) + self.through_partial(x)


def test_weights_reached_through_a_closure_or_a_partial_are_state_not_structure():
    torch.manual_seed(0)
    model = HoldsCallables()
    before = structure_fingerprint(model).digest

    with torch.no_grad():
        model.fc.weight.add_(1.0)

    assert structure_fingerprint(model).digest == before


def test_a_stage_keys_on_a_helper_it_takes_through_a_star_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "gb_star_helper.py").write_text("def scale():\n    return 2\n")
    (tmp_path / "gb_star_stage.py").write_text(
        "from gb_star_helper import *\n\n\ndef stage(inputs, samples, ctx):\n    return scale()\n"
    )
    importlib.invalidate_caches()
    module = importlib.import_module("gb_star_stage")
    monkeypatch.setitem(sys.modules, "gb_star_stage", module)

    assert "gb_star_helper" in function_files(module.stage)
