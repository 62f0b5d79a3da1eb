"""A model whose ``forward`` changes a buffer in place (a counter, a running-statistics
update) cannot be quantized: calibration runs ``forward`` and would change the model it was
given. Both the preset's split quantization (``place_quantizers``) and the one-stage PT2E
``quantize`` refuse it with the same typed error, naming the buffer and the way out, before
anything runs the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphbuild as gb
from graphbuild.errors import BufferMutationError, InputMutationError, StageError
from graphbuild.targets.qnn import build_qnn_pipeline

SAMPLE = (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),)


class Counter(nn.Module):
    """Counts its calls in a registered buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.lin(x)


class RunningMean(nn.Module):
    """Keeps a running mean of its activations, as a BatchNorm in training does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.mean.mul_(0.9).add_(0.1 * y.mean(0))
        return y - self.mean


class TrainingOnlyMean(RunningMean):
    """The way out: the update runs only in training, and the export is of the eval model."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * y.mean(0))
        return y - self.mean


def build(model: nn.Module, tmp_path, split: bool | None = None) -> gb.ExportArtifacts:
    torch.manual_seed(0)
    return gb.export(
        model,
        SAMPLE,
        tmp_path / "out",
        "m",
        options={"quantizer": "w8a16"},
        cache=tmp_path / "cache",
        pipeline_factory=lambda request: build_qnn_pipeline(
            request, one_stage_oracle=split is False
        ),
    )


@pytest.mark.parametrize(
    ("model", "buffer"), [(Counter, "count"), (RunningMean, "mean")], ids=["counter", "stat"]
)
@pytest.mark.parametrize(
    ("split", "stage"), [(None, "place_quantizers"), (False, "quantize")], ids=["split", "one"]
)
def test_a_forward_that_changes_a_buffer_is_refused_naming_it_and_the_way_out(
    tmp_path, model, buffer, split, stage
):
    torch.manual_seed(0)
    net = model().eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}

    with pytest.raises(StageError) as info:
        build(net, tmp_path, split)

    assert info.value.stage == stage, info.value
    cause = info.value.cause
    assert isinstance(cause, BufferMutationError) and isinstance(cause, InputMutationError)
    assert cause.buffers == (buffer,)
    message = str(cause)
    assert f"'{buffer}'" in message and "forward" in message
    assert "self.training" in message and "model.eval()" in message  # the way out
    for name, value in net.state_dict().items():  # nothing ran the model on its buffers
        assert torch.equal(value, before[name]), name


def test_the_way_out_an_update_only_in_training_exports(tmp_path):
    torch.manual_seed(0)
    net = TrainingOnlyMean().eval()

    art = build(net, tmp_path)

    assert art.files["onnx"].exists() and art.files["encodings"].exists()
    assert torch.equal(net.mean, torch.zeros(4))
