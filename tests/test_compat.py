"""Each version gate of graphbuild/compat.py, on whichever torch is installed.

CI's compat matrix (``.ci/matrix``) runs this file under every supported torch release.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from graphbuild import compat

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class _Affine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("offset", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.offset


def _program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(_Affine().eval(), (torch.randn(2, 4),))


def test_installed_torch_is_in_the_declared_range() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = next(
        Requirement(r)
        for r in pyproject["project"]["dependencies"]
        if Requirement(r).name == "torch"
    )
    assert declared.specifier.contains(torch.__version__.split("+")[0]), declared


def test_graph_serialization_pickles_no_tensor(monkeypatch) -> None:
    program = _program()

    def refuse(*args, **kwargs):
        raise AssertionError("torch.save called: tensors are graphbuild's to store")

    monkeypatch.setattr(torch, "save", refuse)
    graph = compat.serialize_program_graph(program)
    assert program.state_dict["linear.weight"].detach().numpy().tobytes() not in graph


def test_program_round_trips_through_graph_bytes_and_tensors() -> None:
    program = _program()
    graph = compat.serialize_program_graph(program)
    restored = compat.deserialize_program(graph, program.state_dict, program.constants)
    x = torch.randn(2, 4)
    torch.testing.assert_close(restored.module()(x), program.module()(x))
    assert [n.op for n in restored.graph.nodes] == [n.op for n in program.graph.nodes]


def test_serializing_leaves_torch_serializer_as_it_was() -> None:
    from torch._export.serde import serialize as serde

    def current():
        return (
            serde.serialize_torch_artifact,
            getattr(serde, "typing", None),
            serde.canonicalize,
            serde._dict_to_dataclass,
        )

    before = current()
    graph = compat.serialize_program_graph(_program())
    compat.deserialize_program(graph, _program().state_dict, {})
    assert current() == before


def test_skipping_the_serializers_canonical_form_self_test_changes_no_byte() -> None:
    """torch's serializer canonicalizes a deep copy of the serialized program and throws it
    away; where its source shows exactly that, graphbuild skips it, and the bytes are the
    same."""
    from torch._export.serde import serialize as serde

    program = _program()
    ours = compat.serialize_program_graph(program)
    if compat._canonical_form_check_is_discarded():
        checked: list[object] = []
        real = serde.canonicalize
        serde.canonicalize = lambda ep, constants=None: checked.append(ep) or real(ep, constants)
        try:
            assert compat.serialize_program_graph(program) == ours and checked == []
            torchs = serde.serialize(program).exported_program  # torch's own path, checked
        finally:
            serde.canonicalize = real
        assert len(checked) == 1 and torchs == ours


def test_deserializing_looks_up_each_schema_class_type_hints_once(monkeypatch) -> None:
    import typing

    looked_up: list[object] = []
    real = typing.get_type_hints

    def count(obj, *args, **kwargs):
        looked_up.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(typing, "get_type_hints", count)
    graph = compat.serialize_program_graph(_program())
    looked_up.clear()
    compat.deserialize_program(graph, _program().state_dict, {})
    assert looked_up and len(looked_up) == len(set(looked_up))


def _schema_objects(graph: bytes, planned: bool) -> object:
    """What torch's deserializer makes of a program's JSON, with or without the plans."""
    from torch._export.serde import schema
    from torch._export.serde import serialize as serde

    with compat._planned_dataclasses() if planned else contextlib.nullcontext():
        return serde._bytes_to_dataclass(schema.ExportedProgram, graph)


def test_planned_schema_conversion_gives_torchs_own_dataclasses() -> None:
    from tests.models import FakeQuantConvNet

    if not compat._dict_to_dataclass_is_known():
        pytest.skip("this torch's _dict_to_dataclass is not one the plans repeat")

    torch.manual_seed(0)
    fake_quant = torch.export.export(FakeQuantConvNet().eval(), (torch.randn(1, 3, 16, 16),))
    for program in (_program(), fake_quant):
        graph = compat.serialize_program_graph(program)
        ours, torchs = _schema_objects(graph, True), _schema_objects(graph, False)
        assert ours == torchs and repr(ours) == repr(torchs)


def test_an_unknown_dict_to_dataclass_is_left_as_torch_has_it(monkeypatch) -> None:
    from torch._export.serde import serialize as serde

    real = serde._dict_to_dataclass
    monkeypatch.setattr(compat, "_DICT_TO_DATACLASS_SOURCES", frozenset())
    compat._dict_to_dataclass_is_known.cache_clear()
    try:
        with compat._planned_dataclasses():
            assert serde._dict_to_dataclass is real
        graph = compat.serialize_program_graph(_program())
        restored = compat.deserialize_program(graph, _program().state_dict, {})
        assert [n.op for n in restored.graph.nodes] == [n.op for n in _program().graph.nodes]
    finally:
        compat._dict_to_dataclass_is_known.cache_clear()
    assert serde._dict_to_dataclass is real


def test_quantized_decomposed_ops_are_registered_on_demand() -> None:
    compat.register_quantized_decomposed_ops()
    assert hasattr(torch.ops.quantized_decomposed, "quantize_per_tensor")
    assert hasattr(torch.ops.quantized_decomposed, "dequantize_per_channel")


# --------------------------------------------------------------------------- both branches


def test_pre_2_13_serialize_path_gives_the_same_graph_without_pickling(monkeypatch) -> None:
    """torch < 2.13 has no serialize_state_dict flag: the tensor pickler is bypassed instead."""
    program = _program()
    current = compat.serialize_program_graph(program)

    def refuse(*args, **kwargs):
        raise AssertionError("torch.save called: tensors are graphbuild's to store")

    monkeypatch.setattr(compat, "_serialize_takes_part_flags", lambda: False)
    monkeypatch.setattr(torch, "save", refuse)
    old_path = compat.serialize_program_graph(program)
    assert old_path == current
    restored = compat.deserialize_program(old_path, program.state_dict, program.constants)
    x = torch.randn(2, 4)
    torch.testing.assert_close(restored.module()(x), program.module()(x))


def _doubled_state(program: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """Twice the program's state; parameters stay Parameters, as the verifier demands."""
    out = {}
    for name, t in program.state_dict.items():
        doubled = 2 * t.detach()
        is_param = isinstance(t, torch.nn.Parameter)
        out[name] = torch.nn.Parameter(doubled, requires_grad=False) if is_param else doubled
    return out


@pytest.mark.parametrize("release", [compat.TORCH_VERSION, (2, 16)], ids=["installed", "later"])
def test_program_with_state_swaps_the_values_and_leaves_the_original(monkeypatch, release):
    """Up to 2.15 the state dict attribute is replaced on a shallow copy; a later release
    goes through the constructor."""
    monkeypatch.setattr(compat, "TORCH_VERSION", release)
    program = _program()
    before = {name: t.clone() for name, t in program.state_dict.items()}
    doubled = _doubled_state(program)
    swapped = compat.program_with_state(program, doubled)
    assert swapped.state_dict.keys() == doubled.keys()
    assert all(swapped.state_dict[name] is t for name, t in doubled.items())
    for name, t in before.items():
        torch.testing.assert_close(program.state_dict[name], t)
    x = torch.randn(2, 4)
    model = _Affine()
    model.load_state_dict(doubled)
    torch.testing.assert_close(swapped.module()(x), model(x))


@pytest.mark.parametrize("takes_verifiers", [True, False])
def test_new_program_builds_a_verified_program_either_way(monkeypatch, takes_verifiers):
    monkeypatch.setattr(compat, "_constructor_takes_verifiers", lambda: takes_verifiers)
    program = _program()
    rebuilt = compat.new_program(
        root=program.graph_module,
        graph=program.graph,
        graph_signature=program.graph_signature,
        state_dict=program.state_dict,
        range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph,
        example_inputs=program.example_inputs,
        constants=program.constants,
        verifiers=program.verifiers,
    )
    x = torch.randn(2, 4)
    torch.testing.assert_close(rebuilt.module()(x), program.module()(x))
    assert [type(v) for v in rebuilt.verifiers] == [type(v) for v in program.verifiers]


def test_the_installed_torch_takes_the_current_branches() -> None:
    """Within the supported range every gate picks the cheap, current path."""
    assert compat.TORCH_VERSION <= compat._STATE_DICT_ATTRIBUTE_THROUGH
    assert compat._constructor_takes_verifiers()
    if compat.TORCH_VERSION >= (2, 13):
        assert compat._serialize_takes_part_flags()
    if compat.TORCH_VERSION == (2, 14):
        assert compat._dict_to_dataclass_is_known()


class _Halves(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[..., 2:], x[..., :2]], -1)  # views at storage offset 2


def test_a_loaded_program_serializes_to_the_bytes_it_was_loaded_from() -> None:
    program = torch.export.export(_Halves(), (torch.randn(2, 4),))
    graph = compat.serialize_program_graph(program)

    loaded = compat.deserialize_program(graph, {}, {})

    assert compat.serialize_program_graph(loaded) == graph


def test_storage_offsets_are_written_as_they_are_where_the_loader_reads_them(monkeypatch) -> None:
    monkeypatch.setattr(compat, "_loader_drops_storage_offset", lambda: False)
    program = torch.export.export(_Halves(), (torch.randn(2, 4),))

    assert b'"storage_offset": {"as_int": 2}' in compat.serialize_program_graph(program)


def test_the_onnx_registry_is_built_once_per_opset_and_each_export_gets_its_own_copy() -> None:
    from torch.onnx._internal.exporter import _registration

    cls = _registration.ONNXRegistry
    real = vars(cls)["from_torchlib"]
    built: list[int] = []
    counting = classmethod(lambda klass, *a, **k: built.append(1) or real.__func__(klass, *a, **k))
    cls.from_torchlib = counting
    compat._ONNX_REGISTRIES.clear()
    try:
        with compat.onnx_registry_reused():
            first = cls.from_torchlib(opset_version=21)
            first.register_op(torch.ops.aten.add.Tensor, lambda x, y: x)  # a call's own
            second = cls.from_torchlib(opset_version=21)
        assert vars(cls)["from_torchlib"] is counting  # put back
    finally:
        cls.from_torchlib = real
        compat._ONNX_REGISTRIES.clear()
    assert built == [1] and first is not second
    assert len(first.get_decomps(torch.ops.aten.add.Tensor)) == 1 + len(
        second.get_decomps(torch.ops.aten.add.Tensor)
    )


def test_an_onnx_export_with_the_registry_reused_is_the_same_model(monkeypatch) -> None:
    import contextlib

    import onnx_ir as ir

    from graphbuild.onnx import skeleton

    def exported() -> bytes:
        return ir.serde.serialize_model(skeleton._torch_export(_program(), 21)).SerializeToString()

    compat._ONNX_REGISTRIES.clear()
    first, again = exported(), exported()  # the registry built, then copied
    monkeypatch.setattr(skeleton, "onnx_registry_reused", contextlib.nullcontext)
    assert first == again == exported()  # as torch builds it for every call


def _at_most_one_at_a_time(monkeypatch, module, name: str) -> list[int]:
    """Wrap ``module.name`` so that each call holds for a moment and notes how many calls
    ran at once; returns the list those counts go in."""
    import threading
    import time

    real, lock, running, seen = getattr(module, name), threading.Lock(), [0], []

    def counted(*args, **kwargs):
        with lock:
            running[0] += 1
            seen.append(running[0])
        time.sleep(0.2)  # long enough for the other thread to enter, were it let in
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(module, name, counted)
    return seen


def _in_two_threads(call) -> list:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return [f.result() for f in [pool.submit(call), pool.submit(call)]]


def test_two_threads_never_deserialize_programs_at_once(monkeypatch) -> None:
    """torch's program deserializer (its ShapeEnv, the serde module's globals compat patches
    for the call) is not known to be thread-safe: the concurrent scheduler's stages load
    programs in threads, so the loads take turns."""
    from torch._export.serde import serialize as serde

    program = _program()
    graph = compat.serialize_program_graph(program)
    seen = _at_most_one_at_a_time(monkeypatch, serde, "deserialize")
    loaded = _in_two_threads(
        lambda: compat.deserialize_program(graph, program.state_dict, program.constants)
    )
    assert seen == [1, 1]
    x = torch.randn(2, 4)
    for restored in loaded:
        torch.testing.assert_close(restored.module()(x), program.module()(x))


def test_two_threads_never_serialize_programs_at_once(monkeypatch) -> None:
    """Serializing swaps functions of torch's serde module for the call (the discarded
    canonical-form check, the tensor pickler): two at once would leave the swapped one in
    place for good, so the calls take turns, and the module is as it was afterwards."""
    from torch._export.serde import serialize as serde

    program = _program()
    expected = compat.serialize_program_graph(program)
    before = (getattr(serde, "canonicalize", None), serde.serialize_torch_artifact)
    seen = _at_most_one_at_a_time(monkeypatch, serde, "serialize")
    assert _in_two_threads(lambda: compat.serialize_program_graph(program)) == [expected] * 2
    assert seen == [1, 1]
    assert (getattr(serde, "canonicalize", None), serde.serialize_torch_artifact) == before
