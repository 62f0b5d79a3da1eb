"""graphbuild's encodings load into aimet-onnx's QuantizationSimModel in strict mode.

Needs aimet-onnx (the ``interop`` extra); skipped without it. The model quantizes exactly what
AIMET's ``htp_v81`` config quantizes for a lone Conv (input, per-channel int8 weight, output),
so what is checked is the file format: field names, types, the int8 grid and the bias.

AIMET's own behaviour, which the 2.0.0 test follows: a fresh ``htp_v81`` sim keeps bias
quantizers disabled, so a 2.0.0 file with int32 bias encodings (AIMET's own export included)
fails ``strict=True`` on "enabled: False, loaded encoding enabled: True" for every bias. AIMET
users enable the bias quantizers at 32 bits before loading; the test does the same, and checks
that without it the load fails on the biases alone.
"""

from __future__ import annotations

import tempfile

import onnx
import pytest
import torch
from torch import nn

import graphbuild as gb

aimet_onnx = pytest.importorskip(
    "aimet_onnx", reason="the interop extra (aimet-onnx) is not installed"
)
pytestmark = pytest.mark.filterwarnings("ignore")


class ConvFakeQuant(nn.Module):
    """uint16 input and output, int8 symmetric per-channel weight on the full [-128, 127]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        scale = self.conv.weight.detach().abs().amax(dim=(1, 2, 3)) / 127
        self.register_buffer("w_scale", scale.float())
        self.register_buffer("w_zp", torch.zeros(4, dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.fake_quantize_per_tensor_affine(x, 1e-4, 30000, 0, 65535)
        w = torch.fake_quantize_per_channel_affine(
            self.conv.weight, self.w_scale, self.w_zp, 0, -128, 127
        )
        y = nn.functional.conv2d(x, w, self.conv.bias)
        return torch.fake_quantize_per_tensor_affine(y, 2e-4, 30000, 0, 65535)


def export(tmp_path, version: str):
    sample = (torch.rand(1, 3, 8, 8) * 3 - 1.5,)
    gb.export(
        ConvFakeQuant().eval(),
        sample,
        tmp_path,
        "m",
        options=gb.QnnOnnxOptions(encodings_version=version),
        cache=gb.Cache(tmp_path / "cache"),
    )
    return tmp_path / "m.onnx", tmp_path / "m.encodings"


def htp_sim(onnx_path):
    from aimet_onnx import QuantizationSimModel

    return QuantizationSimModel(
        onnx.load(onnx_path),
        param_type="int8",
        activation_type="int16",
        config_file="htp_v81",
        path=tempfile.mkdtemp(prefix="gb_aimet_"),
    )


def enable_int32_bias_quantizers(sim) -> None:
    for name in sim.param_names:
        if name.endswith("bias"):
            quantizer = sim.qc_quantize_op_dict[name]
            quantizer.enabled = True
            quantizer.set_bitwidth(32)
            quantizer.use_symmetric_encodings = True


@pytest.mark.parametrize("version", ["1.0.0", "0.6.1"])
def test_1_0_0_and_0_6_1_load_strictly_into_a_fresh_htp_sim(tmp_path, version):
    from aimet_onnx.quantsim import load_encodings_to_sim

    model, encodings = export(tmp_path, version)
    load_encodings_to_sim(htp_sim(model), str(encodings), strict=True)


def test_2_0_0_with_int32_biases_loads_strictly_once_bias_quantizers_are_enabled(tmp_path):
    from aimet_onnx.quantsim import load_encodings_to_sim

    model, encodings = export(tmp_path, "2.0.0")
    sim = htp_sim(model)
    enable_int32_bias_quantizers(sim)
    load_encodings_to_sim(sim, str(encodings), strict=True)
    biases = sim.qc_quantize_op_dict["conv.bias"].get_encodings()
    assert len(biases) == 4 and all(b.bw == 32 for b in biases)  # per output channel


def test_2_0_0_into_a_fresh_sim_fails_on_the_biases_alone_as_aimets_own_export_does(tmp_path):
    from aimet_onnx.quantsim import load_encodings_to_sim

    model, encodings = export(tmp_path, "2.0.0")
    with pytest.raises(AssertionError) as err:
        load_encodings_to_sim(htp_sim(model), str(encodings), strict=True)
    _, *names = [line for line in str(err.value).splitlines() if line.endswith(":")]
    assert names == ["conv.bias:"]
