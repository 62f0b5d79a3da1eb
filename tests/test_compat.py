"""Each version gate of graphbuild/compat.py, on whichever torch is installed.

CI's compat matrix (``.ci/matrix``) runs this file under every supported torch release.
"""

from __future__ import annotations

from pathlib import Path

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

    before = (serde.serialize_torch_artifact, getattr(serde, "typing", None))
    graph = compat.serialize_program_graph(_program())
    compat.deserialize_program(graph, _program().state_dict, {})
    assert (serde.serialize_torch_artifact, getattr(serde, "typing", None)) == before


def test_quantized_decomposed_ops_are_registered_on_demand() -> None:
    compat.register_quantized_decomposed_ops()
    assert hasattr(torch.ops.quantized_decomposed, "quantize_per_tensor")
    assert hasattr(torch.ops.quantized_decomposed, "dequantize_per_channel")
