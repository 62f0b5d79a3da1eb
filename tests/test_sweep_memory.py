"""``gb.sweep`` over a model in memory: the model, its samples and calibration sets are Python
objects built here, no config file or factory spec; the variants share one trace as a
config-file sweep's do, and the numerics check runs each variant in onnxruntime."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphbuild as gb
from graphbuild.errors import ArgumentTypeError, ConfigError


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def _batches(seed: int, scale: float = 1.0) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(2, 8, generator=generator),) for _ in range(4)]


SAMPLES = (torch.randn(2, 8, generator=torch.Generator().manual_seed(7)),)


def test_a_sweep_exports_every_variant_of_a_model_in_memory(tmp_path):
    result = gb.sweep(
        {"quantization.preset": ["w8a16", "w8a8"], "calibration": ["wide", "narrow"]},
        model=_mlp(),
        samples=SAMPLES,
        calibrations={"wide": _batches(1, 4.0), "narrow": lambda: _batches(2, 0.5)},
        model_name="mlp",
        cwd=tmp_path,
        output_dir=tmp_path / "out",
        cache=tmp_path / "cache",
    )

    assert [r["variant"] for r in result.rows] == [
        "w8a16-wide",
        "w8a16-narrow",
        "w8a8-wide",
        "w8a8-narrow",
    ]
    assert all(r["status"] == "ok" for r in result.rows), result.rows
    runs = result.summary["stage_runs"]
    assert runs["capture"] == 1 and runs["to_onnx"] == 1 and runs["calibrate"] == 2
    sqnr = {}
    for row in result.rows:
        assert (tmp_path / "out" / row["variant"] / "mlp.onnx").is_file()
        (sqnr[row["variant"]],) = row["sqnr_db"].values()  # the export run in onnxruntime
    assert sqnr["w8a16-wide"] > 30 and sqnr["w8a8-wide"] > 25, sqnr
    # the calibration set reached each variant: a range narrower than the samples clips
    assert sqnr["w8a16-narrow"] < sqnr["w8a16-wide"] - 10, sqnr
    assert sqnr["w8a8-narrow"] < sqnr["w8a8-wide"] - 10, sqnr


def test_a_factory_gives_the_model_and_its_samples(tmp_path):
    result = gb.sweep(
        {"quantization.preset": ["w8a16", "w4a16"]},
        model=lambda: (_mlp(), SAMPLES),
        calibration=_batches(3),
        cwd=tmp_path,
        output_dir=tmp_path / "out",
        cache=tmp_path / "cache",
        check_numerics=False,
    )

    assert all(r["status"] == "ok" for r in result.rows), result.rows
    assert (tmp_path / "out" / "w4a16" / "model.onnx").is_file()  # named "model" by default


def test_a_model_in_memory_is_not_sent_to_worker_processes(tmp_path):
    with pytest.raises(ConfigError, match="model in memory runs its jobs in this process"):
        gb.sweep(
            {"quantization.preset": ["w8a16", "w8a8"]},
            model=_mlp(),
            samples=SAMPLES,
            jobs=2,
            cwd=tmp_path,
            cache=tmp_path / "cache",
        )


def test_wrong_inputs_are_refused_before_anything_runs(tmp_path):
    vary = {"quantization.preset": ["w8a16"]}
    with pytest.raises(ArgumentTypeError, match="needs its sample inputs"):
        gb.sweep(vary, model=_mlp(), cwd=tmp_path)
    with pytest.raises(ArgumentTypeError, match="model must be a torch.nn.Module"):
        gb.sweep(vary, model=lambda: "not a model", samples=SAMPLES, cwd=tmp_path)
    with pytest.raises(ArgumentTypeError, match="calibration must be a list of batches"):
        gb.sweep(vary, model=_mlp(), samples=SAMPLES, calibration=SAMPLES[0], cwd=tmp_path)
    with pytest.raises(ArgumentTypeError, match="go with a model in memory"):
        gb.sweep(vary, samples=SAMPLES, cwd=tmp_path)
    config = tmp_path / "graphbuild.toml"
    config.write_text('model = "m.py:build"\n')
    with pytest.raises(ConfigError, match="give one of them"):
        gb.sweep(vary, model=_mlp(), samples=SAMPLES, config=config, cwd=tmp_path)
    assert not (tmp_path / "sweep-out").exists()
