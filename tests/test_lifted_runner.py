"""Running an exported program without unlifting it (calibration's forward passes): the
same outputs as ``program.module()``, call targets swapped on a copy of the graph only, and
programs that mutate state run unlifted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphbuild.errors import CodecError
from graphbuild.frontend.programs import lifted_runner


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.register_buffer("shift", torch.full((4,), 0.5))
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

    def forward(self, x: torch.Tensor, extra: dict) -> torch.Tensor:
        return torch.relu(self.fc(x) + self.shift) * self.scale + extra["b"] + 1.5


class Counter(nn.Module):
    """Mutates a buffer: each call sees the count the last one left."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1.0)
        return x * self.count


def test_a_program_runs_as_its_unlifted_module_does():
    x, extra = torch.randn(2, 4), {"b": torch.randn(4)}
    program = torch.export.export(Block().eval(), (x, extra))
    run = lifted_runner(program)
    (out,) = run(x, extra)
    torch.testing.assert_close(out, program.module()(x, extra), rtol=0, atol=0)


def test_replaced_targets_are_called_on_a_copy_of_the_graph():
    x, extra = torch.randn(2, 4), {"b": torch.randn(4)}
    program = torch.export.export(Block().eval(), (x, extra))
    before = program.graph_module.code
    seen = []

    def relu(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.shape)
        return torch.relu(t)

    (out,) = lifted_runner(program, {torch.ops.aten.relu.default: relu})(x, extra)
    assert seen == [torch.Size([2, 4])]
    assert program.graph_module.code == before
    torch.testing.assert_close(out, program.module()(x, extra), rtol=0, atol=0)


def test_a_program_that_mutates_a_buffer_runs_unlifted_and_keeps_the_count():
    x = torch.ones(3)
    program = torch.export.export(Counter(), (x,))
    run = lifted_runner(program)
    (first,), (second,) = run(x), run(x)
    torch.testing.assert_close(second, 2 * first)


def test_a_program_edited_since_its_last_run_is_copied_afresh():
    x, extra = torch.randn(2, 4), {"b": torch.randn(4)}
    program = torch.export.export(Block().eval(), (x, extra))
    replace = {torch.ops.aten.relu.default: torch.relu}
    (before,) = lifted_runner(program, replace)(x, extra)
    for node in program.graph.nodes:
        if node.target is torch.ops.aten.relu.default:
            node.target = torch.ops.aten.sigmoid.default
    program.graph_module.recompile()
    (after,) = lifted_runner(program, replace)(x, extra)
    torch.testing.assert_close(after, program.module()(x, extra), rtol=0, atol=0)
    assert not torch.equal(before, after)


def test_an_input_of_another_shape_than_traced_is_refused_naming_both():
    x, extra = torch.randn(2, 4), {"b": torch.randn(4)}
    program = torch.export.export(Block().eval(), (x, extra))
    run = lifted_runner(program)
    with pytest.raises(CodecError, match=r"input 0 has shape \[3, 4\].*traced for \[2, 4\]"):
        run(torch.randn(3, 4), extra)


def test_a_dynamic_dimension_takes_any_size():
    x, extra = torch.randn(2, 4), {"b": torch.randn(4)}
    batch = torch.export.Dim("batch")
    program = torch.export.export(
        Block().eval(), (x, extra), dynamic_shapes=({0: batch}, {"b": None})
    )
    (out,) = lifted_runner(program)(torch.randn(5, 4), extra)
    assert out.shape == (5, 4)


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n


def test_a_constant_input_other_than_traced_is_refused():
    x = torch.ones(2)
    program = torch.export.export(Scaled(), (x, 3))
    run = lifted_runner(program)
    (out,) = run(x, 3)
    torch.testing.assert_close(out, 3 * x)
    with pytest.raises(CodecError, match=r"input 1 is 5; the program was traced for 3"):
        run(x, 5)
