"""The cold export's fixed costs: each program is serialized once per stage that makes it,
and what a later stage passes on unchanged is not serialized again."""

from __future__ import annotations

import torch

import graphbuild as gb
from graphbuild.engine.checking import check_mode
from graphbuild.engine.codecs import encode, roundtrip
from graphbuild.frontend import programs
from graphbuild.frontend.programs import ProgramArtifact
from tests.models import FakeQuantConvNet

SAMPLE = (torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(5)),)


def artifact() -> ProgramArtifact:
    torch.manual_seed(0)
    program = torch.export.export(FakeQuantConvNet().eval(), SAMPLE)
    return roundtrip(ProgramArtifact(programs.strip_state(program)))


def count_encodes(monkeypatch) -> list[ProgramArtifact]:
    seen: list[ProgramArtifact] = []
    real = programs.ProgramCodec.encode
    monkeypatch.setattr(
        programs.ProgramCodec, "encode", lambda self, v: seen.append(v) or real(self, v)
    )
    return seen


def test_a_cold_export_serializes_each_program_once(tmp_path, monkeypatch):
    seen = count_encodes(monkeypatch)
    torch.manual_seed(0)
    art = gb.export(FakeQuantConvNet().eval(), SAMPLE, tmp_path / "out", "net", cache=tmp_path)
    assert {"capture", "normalize", "marker_graph"} <= set(art.report.ran)
    assert len(seen) == 2  # capture's program and normalize's marker graph (passed on as is)


def test_a_roundtripped_program_edited_in_place_is_encoded_afresh(monkeypatch):
    value = artifact()
    first = encode(value)
    assert encode(value) is first  # unchanged: its encoding is known
    node = next(n for n in value.program.graph.nodes if n.op == "call_function")
    node.target = torch.ops.aten.sub.Tensor  # an edit the program's token sees
    edited = encode(value)
    assert edited.digest != first.digest
    assert edited.digest == programs.ProgramCodec().encode(value).digest


def test_check_mode_encodes_a_roundtripped_program_afresh(monkeypatch):
    value = artifact()
    seen = count_encodes(monkeypatch)
    with check_mode():
        encode(value)
    assert seen == [value]
