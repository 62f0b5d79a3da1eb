"""Models on any device: the same graph, keys and encodings as on the CPU.

The CPU tests use the ``meta`` device as a stand-in for an accelerator (its tensors are off
the CPU and have no values). Tests marked ``gpu`` need CUDA and skip without it; they run on
the device machine (see DEVELOPERS.md).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import graphbuild as gb
from examples import convnet, tiny_decoder
from graphbuild.engine.codecs import encode
from graphbuild.engine.fingerprint import state_digests, structure_fingerprint, tensor_digest
from graphbuild.engine.fingerprint import tensors as fingerprint
from graphbuild.frontend import devices
from graphbuild.frontend.capture import capture_program
from graphbuild.frontend.devices import HostState, on_cpu, to_device
from graphbuild.targets.qnn.encodings import read_encodings

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 8, bias=False)
        self.head.weight = self.proj.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(x))) + torch.arange(8, device=x.device)


def test_on_cpu_swaps_off_cpu_parameters_for_cpu_stand_ins_and_restores_them():
    model = _Block().to("meta")
    model.head.weight = model.proj.weight
    originals = {n: p for n, p in model.named_parameters()}
    with on_cpu(model):
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert model.head.weight is model.proj.weight  # ties survive
    assert {n: p for n, p in model.named_parameters()} == originals
    assert all(p.device.type == "meta" for p in model.parameters())


def test_on_cpu_restores_the_model_when_the_block_raises():
    model = _Block().to("meta")
    weight = model.proj.weight
    with pytest.raises(RuntimeError), on_cpu(model):
        raise RuntimeError("tracing failed")
    assert model.proj.weight is weight


def test_on_cpu_leaves_a_cpu_model_untouched():
    model = _Block()
    weight = model.proj.weight
    with on_cpu(model):
        assert model.proj.weight is weight


def test_capture_of_an_off_cpu_model_is_the_cpu_models_program():
    torch.manual_seed(0)
    model = _Block().eval()
    samples = (torch.randn(2, 8),)
    cpu = capture_program(model, samples)
    meta = copy.deepcopy(model).to("meta")
    meta.head.weight = meta.proj.weight  # .to("meta") unties; a move to CUDA does not
    off_cpu = capture_program(meta, samples)
    assert encode(off_cpu).digest == encode(cpu).digest


def test_host_state_reads_tensors_as_cpu_tensors():
    state = HostState({"w": torch.ones(2), "m": torch.ones(2, device="meta")})
    assert state["w"].device.type == "cpu"
    assert len(state) == 2 and set(state) == {"w", "m"}
    with pytest.raises(NotImplementedError):  # meta has no values to copy: proves it tried
        state["m"]


def test_streamed_digest_equals_the_one_shot_digest(monkeypatch):
    monkeypatch.setattr(fingerprint, "DEVICE_CHUNK", 64)
    t = torch.randn(33, 7)  # 924 bytes: 15 chunks, the last one short
    assert fingerprint._streamed_digest(t) == tensor_digest(t)
    strided = t.t()
    assert fingerprint._streamed_digest(strided) == tensor_digest(strided)


def test_to_device_moves_tensors_in_nested_batches():
    batch = ({"ids": torch.ones(2)}, [torch.zeros(1)], 3)
    moved = to_device(batch, "meta")
    assert moved[0]["ids"].device.type == "meta" and moved[1][0].device.type == "meta"
    assert moved[2] == 3


class _Holder(torch.nn.Module):
    """Tensors where ``.to()`` does not reach them (a list and a dict attribute), a device
    attribute used in ``forward``, and a container holding one of its own parameters."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, device=device)
        self.device = torch.device(device)
        self.tables = [torch.linspace(0, 1, 8, device=device)]
        self.masks = {"keep": torch.ones(8, device=device)}
        self.flat = [self.proj.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x) + self.tables[0] * self.masks["keep"]
        return y + torch.arange(8, device=self.device)


def _zeros_for_meta(monkeypatch) -> None:
    """meta tensors have no values to copy to the host: let their host copies be zeros (the
    CPU model of these tests holds zeros where it matters)."""
    real = devices._host_copy

    def host_copy(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t.shape, dtype=t.dtype) if t.device.type == "meta" else real(t)

    monkeypatch.setattr(devices, "_host_copy", host_copy)


def test_on_cpu_swaps_tensors_held_in_containers_and_restores_the_containers(monkeypatch):
    _zeros_for_meta(monkeypatch)
    model = _Holder("meta")
    tables, masks, flat = model.tables, model.masks, model.flat
    with on_cpu(model):
        assert model.tables[0].device.type == "cpu" and model.masks["keep"].device.type == "cpu"
        assert model.flat[0] is model.proj.weight  # the parameter's one stand-in
        assert model.device == torch.device("cpu")
    assert model.tables is tables and model.masks is masks and model.flat is flat
    assert tables[0].device.type == "meta" and model.device == torch.device("meta")


def test_capture_with_container_tensors_and_a_device_attribute_off_cpu_is_the_cpu_program(
    monkeypatch,
):
    _zeros_for_meta(monkeypatch)
    torch.manual_seed(0)
    cpu = _Holder().eval()
    cpu.tables, cpu.masks = [torch.zeros(8)], {"keep": torch.zeros(8)}
    samples = (torch.randn(2, 8),)
    meta = _Holder("meta").eval()
    assert (
        encode(capture_program(meta, samples)).digest
        == encode(capture_program(cpu, samples)).digest
    )


def test_a_model_naming_cuda_in_forward_captures_here_like_the_cpu_model():
    """The device attribute of a model built for CUDA reads as the CPU while tracing, so its
    program (and its structure key) is the CPU model's, on a machine without CUDA too."""
    torch.manual_seed(0)
    model = _Holder().eval()
    samples = (torch.randn(2, 8),)
    cpu_program = encode(capture_program(model, samples)).digest
    cpu_structure = structure_fingerprint(model).digest
    model.device = torch.device("cuda", 0)
    assert encode(capture_program(model, samples)).digest == cpu_program
    assert structure_fingerprint(model).digest == cpu_structure
    assert model.device == torch.device("cuda", 0)


def test_a_device_outside_a_model_is_still_a_value():
    from graphbuild.engine.fingerprint import fingerprint

    assert fingerprint(torch.device("cuda")) != fingerprint(torch.device("cpu"))


def _fp32_settings() -> list:
    backends = torch.backends
    return [backends.cuda.matmul, backends.cudnn.conv, backends.cudnn.rnn]


def _tf32_state() -> tuple:
    """What full_float32 sets, read through the API the installed torch wants read (reading
    the legacy flags after the new API was used is an error from torch 2.9 on)."""
    from graphbuild import compat

    if compat._has_precision_api():
        return tuple(s.fp32_precision for s in _fp32_settings())
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


def _full_precision() -> tuple:
    from graphbuild import compat

    return ("ieee",) * 3 if compat._has_precision_api() else (False, False)


@pytest.fixture
def restore_tf32():
    from graphbuild import compat

    saved, precision_api = _tf32_state(), compat._has_precision_api()
    yield
    if precision_api:
        for setting, value in zip(_fp32_settings(), saved, strict=True):
            setting.fp32_precision = value
    else:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_full_float32_turns_tf32_off_in_the_block_and_restores_it(restore_tf32):
    from graphbuild import compat

    before = _tf32_state()
    with pytest.raises(RuntimeError, match="inside"), compat.full_float32():
        assert _tf32_state() == _full_precision()
        raise RuntimeError("inside")
    assert _tf32_state() == before


def test_full_float32_through_the_legacy_flags(monkeypatch, restore_tf32):
    """Releases before the fp32_precision settings: the allow_tf32 flags."""
    from graphbuild import compat

    monkeypatch.setattr(compat, "_has_precision_api", lambda: False)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    with pytest.raises(RuntimeError, match="inside"), compat.full_float32():
        assert not torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cudnn.allow_tf32
        raise RuntimeError("inside")
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


def test_reference_of_a_cuda_model_is_computed_without_tf32(monkeypatch, restore_tf32):
    """The reference runs the model where it lives; on CUDA it must not use TF32 (the device
    check is stood in for: no CUDA here)."""
    from types import SimpleNamespace

    from graphbuild.frontend import reference

    seen = []

    class _Probe(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(_tf32_state())
            return x * 2

    before = _tf32_state()
    monkeypatch.setattr(reference, "model_device", lambda model: torch.device("cuda"))
    monkeypatch.setattr(reference, "to_device", lambda tree, device: tree)
    out = reference.reference_from_model((), (torch.ones(2),), SimpleNamespace(input=_Probe()))
    assert seen == [_full_precision()] and _tf32_state() == before
    torch.testing.assert_close(out["0000"], torch.full((2,), 2.0))


# --------------------------------------------------------------------------- CUDA


def _export(model, samples, out, cache, **options):
    return gb.export(
        model, samples, out, "model", options=gb.QnnOnnxOptions(**options), cache=cache
    )


def _assert_same_encodings(cpu_dir, gpu_dir) -> None:
    cpu = read_encodings(json.loads((cpu_dir / "model.encodings").read_text()))
    gpu = read_encodings(json.loads((gpu_dir / "model.encodings").read_text()))
    assert cpu.keys() == gpu.keys()
    for name, enc in cpu.items():
        other = gpu[name]
        assert (other.bitwidth, other.granularity) == (enc.bitwidth, enc.granularity), name
        assert (other.offset == enc.offset).all(), name
        rel = abs(other.scale - enc.scale) / abs(enc.scale).clip(min=1e-30)
        assert float(rel.max()) <= 1e-5, name


def _cuda_round_trip(model, samples, tmp_path, **options):
    """Export on the CPU, then the same model on CUDA with its own cache: same encodings,
    same keys (the CUDA export is all hits in the CPU export's cache), second CUDA export all
    hits."""
    cpu_report = _export(model, samples, tmp_path / "cpu", gb.Cache(tmp_path / "c1"), **options)
    gpu_model = copy.deepcopy(model).to("cuda")
    gpu_samples = to_device(samples, "cuda")
    gpu_options = dict(options)
    if "calibration" in options:
        gpu_options["calibration"] = to_device(options["calibration"], "cuda")
    fresh = gb.Cache(tmp_path / "c2")
    _export(gpu_model, gpu_samples, tmp_path / "gpu", fresh, **gpu_options)
    _assert_same_encodings(tmp_path / "cpu", tmp_path / "gpu")
    again = _export(gpu_model, gpu_samples, tmp_path / "gpu", fresh, **gpu_options).report
    assert set(again.statuses.values()) == {"hit"}, again.statuses
    shared = _export(
        gpu_model, gpu_samples, tmp_path / "gpu2", gb.Cache(tmp_path / "c1"), **gpu_options
    ).report
    assert set(shared.statuses.values()) == {"hit"}, shared.statuses
    assert cpu_report.report.statuses.keys() == shared.statuses.keys()
    assert all(p.device.type == "cuda" for p in gpu_model.parameters())


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensor_digest_equals_the_cpu_digest():
    t = torch.randn(3_000_000, generator=torch.Generator().manual_seed(0))  # 12 MB
    big = torch.randn(40_000_000)  # 160 MB: streamed in chunks
    assert tensor_digest(t.cuda()) == tensor_digest(t)
    assert tensor_digest(big.cuda()) == tensor_digest(big)
    assert tensor_digest(big.cuda()[::3]) == tensor_digest(big[::3])


@pytest.mark.gpu
@needs_cuda
def test_cuda_model_fingerprints_equal_the_cpu_models():
    model, _ = tiny_decoder.build()
    gpu = copy.deepcopy(model).cuda()
    assert structure_fingerprint(gpu).digest == structure_fingerprint(model).digest
    assert state_digests(gpu).digest == state_digests(model).digest


@pytest.mark.gpu
@needs_cuda
def test_cuda_convnet_w8a16_exports_like_the_cpu_model(tmp_path):
    model, samples = convnet.build()
    _cuda_round_trip(model, samples, tmp_path, quantizer="w8a16", calibration=[samples] * 2)


@pytest.mark.gpu
@needs_cuda
def test_cuda_fake_quant_convnet_exports_like_the_cpu_model(tmp_path):
    from tests.models import FakeQuantConvNet

    model = FakeQuantConvNet().eval()
    samples = (torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(3)),)
    _cuda_round_trip(model, samples, tmp_path)


@pytest.mark.gpu
@needs_cuda
def test_cuda_tiny_decoder_exports_like_the_cpu_model(tmp_path):
    model, samples = tiny_decoder.build()
    _cuda_round_trip(
        model, samples, tmp_path, quantizer="w8a8", calibration=tiny_decoder.calibration()
    )


@pytest.mark.gpu
@needs_cuda
def test_cuda_transformers_llama_exports_like_the_cpu_model(tmp_path):
    pytest.importorskip("transformers", reason="builds a transformers model (the dev extra)")
    from examples import tiny_llama

    model, samples = tiny_llama.build()
    _cuda_round_trip(
        model, samples, tmp_path, quantizer="w8a16", calibration=tiny_llama.calibration()
    )


@pytest.mark.gpu
@needs_cuda
def test_cuda_model_calibrates_on_cpu_batches(tmp_path):
    model, samples = tiny_decoder.build()
    art = _export(
        model.cuda(),
        samples,  # CPU samples and calibration for a CUDA model
        tmp_path,
        gb.Cache(tmp_path / "c"),
        quantizer="w8a8",
        calibration=tiny_decoder.calibration(),
        check_numerics=True,
    )
    for out in art.report.extra["numerics"]["outputs"]:
        assert out["sqnr_db"] > 30, out


@pytest.mark.gpu
@needs_cuda
def test_cuda_model_with_container_tensors_and_a_device_attribute_shares_the_cpu_cache(
    tmp_path,
):
    """On CUDA with its list and dict tensors and its device attribute too (which ``.to()``
    does not move): exports without mixing devices, with the CPU model's keys and encodings."""
    torch.manual_seed(0)
    cpu = _Holder().eval()
    gpu = copy.deepcopy(cpu).to("cuda")  # the same values; then what .to() leaves behind
    gpu.device = torch.device("cuda", 0)
    gpu.tables = [t.cuda() for t in cpu.tables]
    gpu.masks = {k: v.cuda() for k, v in cpu.masks.items()}
    gpu.flat = [gpu.proj.weight]
    samples = (torch.randn(2, 8),)
    options = dict(quantizer="w8a16", calibration=[samples] * 2)
    cache = gb.Cache(tmp_path / "c")
    _export(cpu, samples, tmp_path / "cpu", cache, **options)
    shared = _export(gpu, to_device(samples, "cuda"), tmp_path / "gpu", cache, **options).report
    assert set(shared.statuses.values()) == {"hit"}, shared.statuses
    fresh = _export(gpu, samples, tmp_path / "gpu2", gb.Cache(tmp_path / "c2"), **options)
    assert "ran" in set(fresh.report.statuses.values())
    _assert_same_encodings(tmp_path / "cpu", tmp_path / "gpu2")


@pytest.mark.gpu
@needs_cuda
def test_cuda_fp32_reference_matches_the_cpu_runtime_without_tf32(tmp_path):
    """CUDA lets cuDNN convolutions use TF32 by default (about 60 dB against float32); the
    numerics reference must be float32 at full precision."""
    model, samples = convnet.build()
    art = _export(model.cuda(), samples, tmp_path, False, check_numerics=True)
    for out in art.report.extra["numerics"]["outputs"]:
        assert out["sqnr_db"] > 80, out
    if hasattr(torch.backends.cudnn.conv, "fp32_precision"):
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"  # CUDA's default, restored
