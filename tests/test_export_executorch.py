"""The ExecuTorch target end to end: `.pte` files run in ExecuTorch's runtime, shared capture
entries with the QNN target, the rerun table, and clear errors.

Needs the ``executorch`` extra; skipped without it.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

import graphbuild as gb
from examples import convnet, tiny_decoder
from graphbuild.errors import ConfigError

pytest.importorskip("executorch.exir", reason="needs the executorch extra")

from graphbuild.targets.executorch.runtime import run_pte  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> gb.Cache:
    return gb.Cache(tmp_path_factory.mktemp("cache"))


def export(model, samples, out: Path, cache, fmt="xnnpack", **options) -> gb.ExportArtifacts:
    options.setdefault("check_numerics", True)
    return gb.export(
        model, samples, out, "model", target="executorch", format=fmt, options=options, cache=cache
    )


def sqnr(art: gb.ExportArtifacts) -> float:
    outputs = art.report.extra["numerics"]["outputs"]
    assert outputs, "the numerics check compared no output"
    return min(o["sqnr_db"] for o in outputs)


def ran(art: gb.ExportArtifacts) -> set[str]:
    return {s for s, status in art.report.statuses.items() if status == "ran"}


def test_convnet_fp32_pte_runs_in_the_executorch_runtime_like_torch(tmp_path, cache):
    model, samples = convnet.build()
    art = export(model, samples, tmp_path, cache)
    pte = tmp_path / "model.pte"
    assert art.files["pte"] == pte and pte.read_bytes()[4:8] == b"ET12"  # flatbuffer id
    out = run_pte(pte.read_bytes(), samples)[0]
    torch.testing.assert_close(out, model(*samples), atol=1e-5, rtol=1e-4)
    assert sqnr(art) > 80


def test_xnnpack_delegates_and_the_report_says_what(tmp_path, cache):
    model, samples = convnet.build()
    summary = export(model, samples, tmp_path, cache).report.extra["delegation"]
    assert summary["delegated_subgraphs"] >= 1 and summary["delegated_ops"] > 0
    convs = sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    assert summary["ops"]["aten_convolution_default"] == {"delegated": convs, "portable": 0}


def test_portable_format_delegates_nothing_and_still_runs(tmp_path, cache):
    model, samples = convnet.build()
    art = export(model, samples, tmp_path, cache, fmt="portable")
    assert art.report.extra["delegation"]["delegated_ops"] == 0
    assert sqnr(art) > 80


def test_int8_static_recipe_calibrates_and_stays_close_to_the_float_model(tmp_path, cache):
    model, samples = convnet.build()
    art = export(
        model,
        samples,
        tmp_path,
        cache,
        recipe="xnnpack_int8_static",
        calibration=convnet.calibration(),
    )
    assert art.report.statuses["quantize"] == "ran" or art.report.statuses["quantize"] == "hit"
    assert sqnr(art) > 30  # against the quantized program
    out = run_pte((tmp_path / "model.pte").read_bytes(), samples)[0]
    with torch.no_grad():
        ref = model(*samples)
    noise = (out - ref).pow(2).sum() / ref.pow(2).sum()
    assert float(10 * torch.log10(1 / noise)) > 20  # int8 against float: close, not equal
    assert (out - ref).abs().max() > 0
    numerics = art.report.extra["numerics"]
    (row,) = numerics["outputs"]
    assert numerics["reference"] == "quantized program"  # the figures above
    assert row["sqnr_db_vs_float"] == pytest.approx(float(10 * torch.log10(1 / noise)), abs=0.01)
    assert row["max_abs_error_vs_float"] == pytest.approx(float((out - ref).abs().max()))


def test_int8_dynamic_recipe_exports_and_runs(tmp_path, cache):
    model, samples = convnet.build()
    art = export(model, samples, tmp_path, cache, recipe="xnnpack_int8_dynamic")
    assert art.report.extra["delegation"]["delegated_ops"] > 0
    assert sqnr(art) > 20


def test_second_export_is_all_hits_and_rewrites_nothing(tmp_path, cache):
    model, samples = convnet.build()
    export(model, samples, tmp_path, cache)
    before = (tmp_path / "model.pte").stat().st_mtime_ns
    art = export(model, samples, tmp_path, cache)
    assert set(art.report.statuses.values()) == {"hit"}
    assert (tmp_path / "model.pte").stat().st_mtime_ns == before


def test_capture_is_shared_with_the_qnn_target(tmp_path):
    model, samples = convnet.build()
    shared = gb.Cache(tmp_path / "cache")
    gb.export(model, samples, tmp_path / "qnn", "model", cache=shared)
    art = export(model, samples, tmp_path / "et", shared)
    assert art.report.statuses["capture"] == "hit"


# --------------------------------------------------------------------------- rerun table


def test_weights_only_change_relowers_without_a_retrace(tmp_path, cache):
    model, samples = convnet.build()
    export(model, samples, tmp_path, cache)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.conv1.weight.mul_(1.5)
    art = export(changed, samples, tmp_path, cache)
    assert art.report.statuses["capture"] == "hit"
    assert {"lower", "pte"} <= ran(art)
    torch.testing.assert_close(
        run_pte((tmp_path / "model.pte").read_bytes(), samples)[0],
        changed(*samples),
        atol=1e-5,
        rtol=1e-4,
    )


def test_weights_only_change_under_a_recipe_requantizes_without_a_retrace(tmp_path, cache):
    model, samples = convnet.build()
    opts = dict(recipe="xnnpack_int8_static", calibration=convnet.calibration())
    export(model, samples, tmp_path, cache, **opts)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.conv2.weight.mul_(0.5)
    art = export(changed, samples, tmp_path, cache, **opts)
    assert art.report.statuses["capture"] == "hit"
    assert {"quantize", "lower", "pte"} <= ran(art)


def test_recipe_change_reruns_from_quantize(tmp_path):
    model, samples = convnet.build()
    cache = gb.Cache(tmp_path / "cache")
    export(model, samples, tmp_path, cache, recipe="xnnpack_int8_static")
    art = export(model, samples, tmp_path, cache, recipe="xnnpack_int8_dynamic")
    assert art.report.statuses["capture"] == "hit"
    assert {"quantize", "lower", "pte"} <= ran(art)


def test_calibration_change_reruns_quantize_only_downstream(tmp_path, cache):
    model, samples = convnet.build()
    export(
        model,
        samples,
        tmp_path,
        cache,
        recipe="xnnpack_int8_static",
        calibration=convnet.calibration(seed=1),
    )
    art = export(
        model,
        samples,
        tmp_path,
        cache,
        recipe="xnnpack_int8_static",
        calibration=convnet.calibration(seed=2),
    )
    assert art.report.statuses["capture"] == "hit" and "quantize" in ran(art)


@pytest.mark.slow
def test_tiny_decoder_int8_static_runs_in_the_runtime(tmp_path, cache):
    model, samples = tiny_decoder.build()
    art = export(
        model,
        samples,
        tmp_path,
        cache,
        recipe="xnnpack_int8_static",
        calibration=tiny_decoder.calibration(),
    )
    assert sqnr(art) > 30


def test_tiny_decoder_fp32_runs_in_the_runtime(tmp_path, cache):
    model, samples = tiny_decoder.build()
    art = export(model, samples, tmp_path, cache)
    assert sqnr(art) > 80
    assert art.report.extra["delegation"]["delegated_ops"] > 0


# --------------------------------------------------------------------------- errors


def test_unknown_recipe_lists_the_known_ones(tmp_path):
    model, samples = convnet.build()
    with pytest.raises(ConfigError, match="unknown ExecuTorch recipe 'int3'.*xnnpack_int8_static"):
        export(model, samples, tmp_path, False, recipe="int3")


def test_a_qnn_preset_is_refused_with_a_pointer_to_recipes(tmp_path):
    model, samples = convnet.build()
    with pytest.raises(ConfigError, match="takes no quantizer preset.*recipe"):
        export(model, samples, tmp_path, False, quantizer="w8a16")


def test_unknown_option_names_the_target_and_its_options(tmp_path):
    model, samples = convnet.build()
    with pytest.raises(ConfigError, match="unknown option.*opset.*target 'executorch'.*recipe"):
        export(model, samples, tmp_path, False, opset=17)


def test_vgf_without_arms_tools_names_what_to_install(tmp_path):
    from graphbuild.targets.executorch.lowering import _vgf_missing

    if _vgf_missing() is None:
        pytest.skip("Arm's VGF tools are installed here")
    model, samples = convnet.build()
    with pytest.raises(ConfigError, match=r"graphbuild\[vgf\]"):
        export(model, samples, tmp_path, False, fmt="vgf")


def test_vgf_exports_int8_with_arms_quantizer_when_the_tools_are_installed(tmp_path):
    from graphbuild.targets.executorch.lowering import _vgf_missing

    missing = _vgf_missing()
    if missing is not None:
        pytest.skip(f"Arm's VGF tools are not usable here: {missing}")
    model, samples = convnet.build()
    art = export(
        model,
        samples,
        tmp_path,
        False,
        fmt="vgf",
        recipe="int8_static",
        check_numerics=False,
        calibration=convnet.calibration(),
    )
    assert (tmp_path / "model.pte").stat().st_size > 0
    assert art.report.extra["delegation"]["delegated_ops"] > 0


# --------------------------------------------------------------------------- methods, shapes


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x))


def _two_heads():
    torch.manual_seed(0)
    return _TwoHeads().eval(), (torch.randn(2, 8),)


@pytest.mark.parametrize("recipe", ["fp32", "int8_static"])
def test_multi_method_program_has_every_method_and_constant(tmp_path, recipe):
    from executorch.runtime import Runtime

    model, samples = _two_heads()
    x = torch.randn(3, 8)  # the method's sample input, its calibration under int8
    export(
        model,
        samples,
        tmp_path,
        gb.Cache(tmp_path / "c"),
        recipe=recipe,
        methods={"encode": (x,)},
        constant_methods={"max_batch": 3},
    )
    program = Runtime.get().load_program((tmp_path / "model.pte").read_bytes())
    assert set(program.method_names) == {"forward", "encode", "max_batch"}
    encoded = program.load_method("encode").execute([x])[0]
    with torch.no_grad():
        expected = model.encode(x)
    tolerance = 1e-5 if recipe == "fp32" else 0.1
    torch.testing.assert_close(encoded, expected, atol=tolerance, rtol=tolerance)
    assert program.load_method("max_batch").execute([])[0] == 3


def test_multi_method_weights_change_recaptures_nothing(tmp_path):
    model, samples = _two_heads()
    cache = gb.Cache(tmp_path / "c")
    methods = {"encode": (torch.randn(3, 8),)}
    export(model, samples, tmp_path, cache, methods=methods)
    with torch.no_grad():
        model.body.weight.add_(0.5)
    art = export(model, samples, tmp_path, cache, methods=methods)
    assert art.report.statuses["capture"] == "hit"
    assert art.report.statuses["capture_methods"] == "hit"
    assert "lower" in ran(art)


def test_a_missing_method_is_named(tmp_path):
    model, samples = _two_heads()
    with pytest.raises(gb.StageError, match="no method 'decode'"):
        export(model, samples, tmp_path, False, methods={"decode": samples})


def test_dynamic_dims_give_a_program_that_runs_at_other_batch_sizes(tmp_path):
    model, samples = _two_heads()
    export(model, samples, tmp_path, gb.Cache(tmp_path / "c"), dynamic_dims=[{0: ["batch", 1, 16]}])
    pte = (tmp_path / "model.pte").read_bytes()
    for batch in (1, 5, 16):
        x = torch.randn(batch, 8)
        with torch.no_grad():
            torch.testing.assert_close(run_pte(pte, (x,))[0], model(x), atol=1e-5, rtol=1e-4)


def _readme_block(marker: str) -> str:
    """docs/executorch.md's Python example that contains ``marker``."""
    readme = (Path(__file__).resolve().parents[1] / "docs" / "executorch.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def test_the_readme_example_keeps_dynamic_dims_under_int8_static(tmp_path, monkeypatch):
    """The README's multi-method, dynamic-shape example (``int8_static``) as written: the
    program runs at batch sizes other than the sample's, ``encode`` and the constant too."""
    from executorch.runtime import Runtime

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRAPHBUILD_CACHE_DIR", str(tmp_path / "cache"))  # the default cache
    model, samples = _two_heads()
    exec(
        _readme_block("dynamic_dims=["),
        {"gb": gb, "torch": torch, "model": model, "samples": samples},
    )
    program = Runtime.get().load_program((tmp_path / "out" / "model.pte").read_bytes())
    assert set(program.method_names) == {"forward", "encode", "max_batch"}
    generator = torch.Generator().manual_seed(3)
    for batch in (1, 5, 16):
        x = torch.randn(batch, 8, generator=generator)
        (out,) = program.load_method("forward").execute([x])  # a static program refuses it
        assert out.shape == (batch, 4)
        with torch.no_grad():
            expected = model(x)
        assert 20 * torch.log10(expected.norm() / (out - expected).norm()) > 25  # SQNR, dB


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["int8_static", "int8_dynamic"])
def test_dynamic_dims_hold_under_a_quantizing_recipe(tmp_path, recipe):
    """Quantize re-exports the converted program, which must keep the dims the capture traced;
    calibration batches of several sizes."""
    model, samples = _two_heads()
    calibration = [(torch.randn(b, 8),) for b in (1, 3, 7)]
    dims = [{0: ["batch", 1, 16]}]
    export(
        model, samples, tmp_path, False, recipe=recipe, calibration=calibration, dynamic_dims=dims
    )
    pte = (tmp_path / "model.pte").read_bytes()
    for batch in (1, 5, 16):
        x = torch.randn(batch, 8)
        (out,) = run_pte(pte, (x,))
        assert out.shape == (batch, 4)
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), atol=0.1, rtol=0.1)


def test_dynamic_dims_from_a_config_file_use_string_dims(tmp_path):
    from graphbuild.config import load_config

    (tmp_path / "graphbuild.toml").write_text(
        'model = "m.py:build"\ntarget = "executorch"\n'
        '[options]\ndynamic_dims = [{"0" = ["batch", 1, 8]}]\n'
    )
    options = load_config(cwd=tmp_path).export_options()
    assert options.to_context()["dynamic_dims"] == [[[0, "batch", 1, 8]]]


def test_malformed_dynamic_dims_are_a_config_error():
    from graphbuild.targets.executorch import ExecuTorchOptions

    with pytest.raises(ConfigError, match=r"dynamic_dims\[0\]\[0\] must be \[name, min, max\]"):
        ExecuTorchOptions(dynamic_dims=[{0: "batch"}])


def test_cli_export_prints_the_delegation_and_puts_it_in_json(tmp_path, monkeypatch):
    import json
    import textwrap

    from typer.testing import CliRunner

    from graphbuild.cli.app import app

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "graphbuild.toml").write_text(
        textwrap.dedent(
            f"""\
            model = "{(root / "examples" / "convnet.py").as_posix()}:build"
            model_name = "convnet"
            target = "executorch"
            [options]
            check_numerics = true
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRAPHBUILD_CACHE_DIR", str(tmp_path / "cache"))
    plain = CliRunner().invoke(app, ["export"])
    assert plain.exit_code == 0, plain.output
    assert re.search(r"delegation \d+ ops delegated in 1 subgraph\(s\)", plain.stdout)
    assert re.search(r"numerics   output_0: SQNR \d+\.\d dB", plain.stdout)
    doc = json.loads(CliRunner().invoke(app, ["export", "--json"]).stdout)
    assert doc["files"]["pte"].endswith("convnet.pte")
    assert doc["reports"]["delegation"]["delegated_ops"] > 0


@pytest.mark.slow
def test_cli_model_override_does_not_calibrate_on_the_files_model_batches(tmp_path, monkeypatch):
    """The repo's graphbuild.toml calibrates the ConvNet; --model tiny_decoder must not feed
    those image batches to the decoder's embedding."""
    import shutil

    from typer.testing import CliRunner

    from graphbuild.cli.app import app

    root = Path(__file__).resolve().parents[1]
    shutil.copy(root / "graphbuild.toml", tmp_path / "graphbuild.toml")
    shutil.copytree(root / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRAPHBUILD_CACHE_DIR", str(tmp_path / "cache"))
    args = ["export", "--target", "executorch", "--model", "examples/tiny_decoder.py:build"]
    result = CliRunner().invoke(app, [*args, "--set", "recipe=xnnpack_int8_static"])
    assert result.exit_code == 0, result.output
    assert "its calibration, model_name are not used" in result.stderr
    assert "falls back to the sample inputs" in result.stderr
    assert (tmp_path / "graphbuild-out" / "tiny_decoder.pte").is_file()


# --------------------------------------------------------------------------- methods in config

_TWO_HEADS_MODULE = """\
import torch


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))

    def encode(self, x):
        return torch.relu(self.body(x))


def build():
    torch.manual_seed(0)
    return TwoHeads().eval(), (torch.randn(2, 8),)


def encode_samples():
    return (torch.ones(3, 8),)


def methods():
    return {"encode": encode_samples()}


def not_a_table():
    return [encode_samples()]
"""


def _two_heads_project(directory: Path, options: str) -> Path:
    (directory / "two_heads.py").write_text(_TWO_HEADS_MODULE)
    (directory / "graphbuild.toml").write_text(
        'model = "two_heads.py:build"\ntarget = "executorch"\n' + options
    )
    return directory


def test_methods_and_constant_methods_from_a_config_file_reach_the_pte(tmp_path, monkeypatch):
    from executorch.runtime import Runtime
    from typer.testing import CliRunner

    from graphbuild.cli.app import app

    _two_heads_project(
        tmp_path,
        '[options.methods]\nencode = "two_heads.py:encode_samples"\n'
        '[options.constant_methods]\nmax_batch = 3\nlabels = ["cat", "dog"]\n',
    )
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["export", "--no-cache"])
    assert result.exit_code == 0, result.output
    program = Runtime.get().load_program(
        (tmp_path / "graphbuild-out" / "two_heads.pte").read_bytes()
    )
    assert set(program.method_names) == {"forward", "encode", "max_batch", "labels"}
    assert program.load_method("max_batch").execute([])[0] == 3
    assert list(program.load_method("labels").execute([])) == ["cat", "dog"]
    model, _ = _load_module(tmp_path / "two_heads.py").build()
    x = torch.ones(3, 8)
    with torch.no_grad():
        expected = model.encode(x)
    encoded = program.load_method("encode").execute([x])[0]
    torch.testing.assert_close(encoded, expected, atol=1e-5, rtol=1e-4)


def _load_module(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("two_heads_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_methods_as_one_factory_returning_a_table(tmp_path):
    from graphbuild.config import load_config

    _two_heads_project(tmp_path, '[options]\nmethods = "two_heads.py:methods"\n')
    options = load_config(cwd=tmp_path).export_options()
    assert list(options.methods) == ["encode"]
    torch.testing.assert_close(options.methods["encode"][0], torch.ones(3, 8))


def test_methods_and_constants_by_set(tmp_path):
    from graphbuild.config import load_config

    _two_heads_project(tmp_path, "")
    sets = [
        "options.methods.encode=two_heads.py:encode_samples",
        "options.constant_methods.max_batch=4",
        'options.dynamic_dims=[{"0" = ["batch", 1, 8]}]',
    ]
    options = load_config(cwd=tmp_path, overrides=sets).export_options()
    assert list(options.methods) == ["encode"] and options.constant_methods == {"max_batch": 4}
    assert options.to_context()["dynamic_dims"] == [[[0, "batch", 1, 8]]]


@pytest.mark.parametrize(
    "options, message",
    [
        ("[options.constant_methods]\nwhen = 1979-05-27\n", "must be a table of method = value"),
        ("[options]\nconstant_methods = 3\n", "must be a table of method = value"),
        ("[options]\nmethods = 3\n", "'options.methods' must be a 'file.py:fn' spec"),
        ('[options]\nmethods = "two_heads.py:not_a_table"\n', "methods must map method names"),
        ('[options.methods]\nencode = "two_heads.py:nowhere"\n', "options.methods.encode"),
        ("[options.constant_methods]\nforward = 1\n", "identifier other than 'forward'"),
    ],
)
def test_bad_methods_in_a_config_file_are_config_errors(tmp_path, options, message):
    from graphbuild.config import load_config

    _two_heads_project(tmp_path, options)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(cwd=tmp_path).export_options()


# --------------------------------------------------------------------------- torchao recipes


class _Mlp(torch.nn.Module):
    """Linear layers whose input channels groups of 32 divide, and one they do not."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 96)
        self.down = torch.nn.Linear(96, 24)
        self.odd = torch.nn.Linear(24, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(torch.relu(self.down(torch.relu(self.up(x)))))


def _mlp():
    torch.manual_seed(0)
    return _Mlp().eval(), (torch.randn(4, 64),)


def _eager_transformed(model: torch.nn.Module, recipe: str) -> torch.nn.Module:
    from graphbuild.targets.executorch.recipes import apply_source_transform

    transformed = copy.deepcopy(model)
    apply_source_transform(transformed, recipe)
    return transformed


def _sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    noise = (reference - actual).pow(2).sum()
    return float(10 * torch.log10(reference.pow(2).sum() / noise))


@pytest.mark.parametrize(
    "recipe", ["int8da_int4w", "xnnpack_torchao_int8da_int4w_per_channel", "int8da_int8w"]
)
def test_torchao_recipe_runs_in_the_runtime_like_torchaos_eager_model(tmp_path, recipe):
    model, samples = _mlp()
    art = export(model, samples, tmp_path, gb.Cache(tmp_path / "c"), recipe=recipe)
    out = run_pte((tmp_path / "model.pte").read_bytes(), samples)[0]
    with torch.no_grad():
        eager = _eager_transformed(model, recipe)(*samples)
        floats = model(*samples)
    assert _sqnr(eager, out) > 35  # what torchao's quantize_ computes, up to kernel rounding
    numerics = art.report.extra["numerics"]
    assert numerics["reference"] == "quantized program"
    (row,) = numerics["outputs"]
    assert row["sqnr_db"] > 35
    assert 15 < row["sqnr_db_vs_float"] < row["sqnr_db"]  # the quantization error, reported
    assert row["max_abs_error_vs_float"] == pytest.approx(float((out - floats).abs().max()))


def test_int4_groupwise_linears_go_to_xnnpacks_dynamic_linear_and_odd_ones_stay_float(tmp_path):
    model, samples = _mlp()
    art = export(model, samples, tmp_path, False, recipe="int8da_int4w", check_numerics=False)
    ops = art.report.extra["delegation"]["ops"]
    assert ops["aten_linear_default"] == {"delegated": 3, "portable": 0}
    # up and down take int8 activations quantized at run time; odd (24 inputs) stays float
    assert ops["torchao_choose_qparams_affine_default"] == {"delegated": 2, "portable": 0}
    quantized = _eager_transformed(model, "int8da_int4w")
    weights = dict(quantized.named_parameters())
    assert weights["up.parametrizations.weight.original0"].dtype == torch.int8
    assert weights["up.parametrizations.weight.original0"].min() >= -8
    assert weights["up.parametrizations.weight.original0"].max() <= 7
    assert weights["up.parametrizations.weight.original1"].shape == (96, 2)  # 64 / 32 groups
    assert "odd.weight" in weights


def test_torchao_recipe_weights_change_requantizes_without_a_retrace(tmp_path):
    model, samples = _mlp()
    cache = gb.Cache(tmp_path / "c")
    export(model, samples, tmp_path, cache, recipe="int8da_int4w")
    with torch.no_grad():
        model.up.weight.mul_(-0.5)
    art = export(model, samples, tmp_path, cache, recipe="int8da_int4w")
    assert art.report.statuses["capture_transformed"] == "hit"
    assert {"quantize", "lower", "pte", "float_reference"} <= ran(art)
    out = run_pte((tmp_path / "model.pte").read_bytes(), samples)[0]
    with torch.no_grad():
        assert _sqnr(_eager_transformed(model, "int8da_int4w")(*samples), out) > 35


def test_torchao_recipe_graph_does_not_depend_on_the_weights(tmp_path):
    """capture_transformed reads no weights: with other weights it is a hit, and recomputing
    it (--check-fingerprints) reproduces the cached program. (That the graph traced on zero
    weights computes what torchao's eager model computes, the numerics tests check.)"""
    model, samples = _mlp()
    cache = gb.Cache(tmp_path / "c")
    export(model, samples, tmp_path, cache, recipe="int8da_int4w", check_numerics=False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    art = gb.export(
        model,
        samples,
        tmp_path,
        "model",
        target="executorch",
        options={"recipe": "int8da_int4w"},
        cache=cache,
        check_fingerprints=True,
    )
    assert art.report.statuses["capture_transformed"] == "hit"


def test_torchao_recipe_with_methods_quantizes_every_method(tmp_path):
    from executorch.runtime import Runtime

    class _Encoder(_Mlp):
        def encode(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    model, samples = _Encoder().eval(), (torch.randn(4, 64),)
    x = torch.randn(2, 64)
    export(model, samples, tmp_path, False, recipe="int8da_int4w", methods={"encode": (x,)})
    program = Runtime.get().load_program((tmp_path / "model.pte").read_bytes())
    encoded = program.load_method("encode").execute([x])[0]
    with torch.no_grad():
        assert _sqnr(_eager_transformed(model, "int8da_int4w").encode(x), encoded) > 35


def test_torchao_recipe_is_refused_for_other_formats(tmp_path):
    model, samples = _mlp()
    with pytest.raises(ConfigError, match="lowers through XNNPACK only"):
        export(model, samples, tmp_path, False, fmt="portable", recipe="int8da_int4w")


@pytest.mark.parametrize("recipe", ["int4_weight_only", "int8_weight_only"])
def test_weight_only_recipes_say_why_not_and_what_instead(recipe):
    from graphbuild.targets.executorch import ExecuTorchOptions

    with pytest.raises(ConfigError, match="does not lower in ExecuTorch 1.4.*use int8da_int4w"):
        ExecuTorchOptions(recipe=recipe)


def test_a_pt2e_quantizer_with_a_torchao_recipe_is_refused():
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer

    from graphbuild.targets.executorch import ExecuTorchOptions

    with pytest.raises(ConfigError, match="torchao's quantize_"):
        ExecuTorchOptions(recipe="int8da_int4w", quantizer=XNNPACKQuantizer())


@pytest.mark.slow
def test_tiny_decoder_int8da_int4w_runs_in_the_runtime(tmp_path, cache):
    model, samples = tiny_decoder.build()
    art = export(model, samples, tmp_path, cache, recipe="int8da_int4w")
    (row,) = art.report.extra["numerics"]["outputs"]
    assert row["sqnr_db"] > 35 and row["sqnr_db_vs_float"] > 15


def test_cli_numerics_line_names_both_references_under_a_quantizing_recipe():
    from graphbuild.cli.export import _report_lines

    report = {
        "reference": "quantized program",
        "outputs": [
            {
                "name": "output_0",
                "sqnr_db": float("inf"),
                "max_abs_error": 0.0,
                "sqnr_db_vs_float": 31.25,
                "max_abs_error_vs_float": 0.0123,
            }
        ],
    }
    assert _report_lines({"numerics": report}) == [
        "numerics   output_0: SQNR inf dB, max abs error 0 against the quantized program; "
        "SQNR 31.2 dB, max abs error 0.0123 against the float model"
    ]


def test_executorchs_per_tensor_static_recipe_quantizes_weights_per_tensor(tmp_path):
    from graphbuild.targets.executorch.recipes import recipe_quantizer

    quantizer = recipe_quantizer("xnnpack_pt2e_int8_static_per_tensor", "xnnpack")
    assert quantizer.global_config.weight.qscheme == torch.per_tensor_symmetric
    assert recipe_quantizer("int8_static", "xnnpack").global_config.weight.qscheme == (
        torch.per_channel_symmetric
    )
    model, samples = _mlp()
    art = export(model, samples, tmp_path, False, recipe="xnnpack_pt2e_int8_static_per_tensor")
    (row,) = art.report.extra["numerics"]["outputs"]
    assert row["sqnr_db"] > 30 and 15 < row["sqnr_db_vs_float"] < 60
    assert art.report.extra["delegation"]["ops"]["aten_linear_default"]["delegated"] == 3


class _Scaled(_Mlp):
    """A non-persistent buffer: torch.export keeps its value in the program as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.linspace(0.5, 2.0, 64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * self.gain)


def test_torchao_recipe_keeps_non_persistent_buffer_values(tmp_path):
    torch.manual_seed(0)
    model, samples = _Scaled().eval(), (torch.randn(4, 64),)
    export(model, samples, tmp_path, False, recipe="int8da_int4w", check_numerics=False)
    out = run_pte((tmp_path / "model.pte").read_bytes(), samples)[0]
    with torch.no_grad():
        assert _sqnr(_eager_transformed(model, "int8da_int4w")(*samples), out) > 35
