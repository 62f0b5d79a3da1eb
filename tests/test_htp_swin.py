"""Swin passes ``--check-htp --strict-coverage``: its relative-position-bias lookup
(``table[index]``), which the exporter writes as a GatherND that QNN's HTP ran float, is
written as a Gather on the table's grid, and the numbers stay those of the GatherND export
(41.92 dB SQNR against the float model at w8a16)."""

from __future__ import annotations

import onnx
import pytest
import torch

import graphbuild as gb
from graphbuild.targets.qnn import htp_runtime as hr

pytest.importorskip("onnxruntime_qnn", reason="the htp extra (onnxruntime-qnn) is not installed")
pytest.importorskip("transformers", reason="builds a transformers Swin (the dev extra)")
if not hr.availability().available:
    pytest.skip(hr.availability().reason, allow_module_level=True)


class Hidden(torch.nn.Module):
    """Swin's last hidden state for an image (the graph's one output)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).last_hidden_state


def swin() -> tuple[torch.nn.Module, list[tuple[torch.Tensor]]]:
    from transformers import SwinConfig, SwinModel

    torch.manual_seed(0)
    config = SwinConfig(
        image_size=32,
        patch_size=4,
        num_channels=3,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
    )
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(1, 3, 32, 32, generator=g),) for _ in range(3)]
    return Hidden(SwinModel(config)).eval(), batches


def test_swin_passes_strict_coverage_on_the_htp(tmp_path):
    model, batches = swin()
    art = gb.export(
        model,
        batches[0],
        tmp_path / "out",
        "swin",
        format="onnx_qdq",
        options=gb.QnnOnnxOptions(
            quantizer="w8a16",
            calibration=batches,
            check_numerics=True,
            check_htp=True,
            strict_coverage=True,
        ),
        cache=gb.Cache(tmp_path / "cache"),
    )
    (check,) = art.report.extra["htp"]["checks"]
    assert check["compiled"], check["summary"]
    assert check["partition"]["float_ops"] == [] and check["partition"]["cpu_nodes"] == []
    (out,) = check["outputs"]
    assert out["sqnr_htp_db"] == pytest.approx(out["sqnr_cpu_db"], abs=0.5), out
    (numerics,) = art.report.extra["numerics"]["outputs"]
    assert numerics["sqnr_db_vs_float"] >= 41.9, numerics
    ops = {n.op_type for n in onnx.load(art.files["onnx"]).graph.node}
    assert "GatherND" not in ops and "Gather" in ops
