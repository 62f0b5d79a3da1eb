"""The target seam: config, API and CLI take formats, options and presets from a Target."""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass

import pytest

import graphbuild as gb
from examples import convnet
from graphbuild.api import ExportRequest
from graphbuild.config import load_config
from graphbuild.engine.codecs import FileArtifact
from graphbuild.engine.pipeline import Pipeline
from graphbuild.errors import ConfigError
from graphbuild.targets import registry
from graphbuild.targets.base import BOOL, STR, ExportFlag, Target
from graphbuild.targets.registry import get_target, register_target


@dataclass
class _EchoOptions:
    greeting: str = "hello"
    loud: bool = False

    def to_context(self) -> dict:
        return {"greeting": self.greeting, "loud": self.loud}


def _echo(inputs, samples, context):
    text = context["greeting"].upper() if context["loud"] else context["greeting"]
    return FileArtifact(f"{context['model_name']}.txt", text.encode())


def _echo_pipeline(request, fmt):
    p = Pipeline(name=f"{request.target}/{fmt}")
    p.register_stage(_echo, "echo", reads=("ctx.greeting", "ctx.loud", "ctx.model_name"))
    p.products = ["echo"]
    return p


ECHO = Target(
    name="echo",
    description="writes a greeting",
    formats=("txt",),
    options_type=_EchoOptions,
    build_pipeline=_echo_pipeline,
    config_schema={"greeting": STR, "loud": BOOL},
)


@pytest.fixture
def echo_target():
    register_target(ECHO, replace=True)
    yield ECHO
    registry._TARGETS.pop("echo", None)


def test_a_registered_target_exports_through_the_api_with_its_default_format(tmp_path, echo_target):
    model, samples = convnet.build()
    cache = gb.Cache(tmp_path / "cache")
    art = gb.export(
        model, samples, tmp_path, "m", target="echo", options={"loud": True}, cache=cache
    )
    assert (tmp_path / "m.txt").read_text() == "HELLO"
    assert art.report.statuses == {"echo": "ran"}


def test_a_registered_targets_options_are_checked_in_config_files(tmp_path, echo_target):
    (tmp_path / "graphbuild.toml").write_text(
        textwrap.dedent(
            """\
            model = "m.py:build"
            target = "echo"
            [options]
            greeting = "hi"
            """
        )
    )
    cfg = load_config(cwd=tmp_path)
    assert cfg.format == "txt"
    assert cfg.export_options() == _EchoOptions(greeting="hi")
    with pytest.raises(ConfigError, match=r"'options.loud' must be true or false"):
        load_config(cwd=tmp_path, overrides=["options.loud=3"])
    with pytest.raises(ConfigError, match=r"unknown key 'gretting' in \[options\]; did you mean"):
        load_config(cwd=tmp_path, overrides=["options.gretting=x"])


def test_options_of_one_target_are_refused_for_another(tmp_path):
    (tmp_path / "graphbuild.toml").write_text(
        'model = "m.py:build"\ntarget = "executorch"\n[options]\nopset = 17\n'
    )
    with pytest.raises(ConfigError, match=r"unknown key 'opset' in \[options\]"):
        load_config(cwd=tmp_path)


def test_unknown_target_lists_the_known_ones(tmp_path):
    (tmp_path / "graphbuild.toml").write_text('model = "m.py:build"\ntarget = "tflite"\n')
    with pytest.raises(ConfigError, match="unknown target 'tflite'; known: executorch, gguf, qnn"):
        load_config(cwd=tmp_path)


def test_recipe_is_executorchs_and_the_qnn_target_ignores_it(tmp_path):
    (tmp_path / "graphbuild.toml").write_text(
        'model = "m.py:build"\nrecipe = "xnnpack_int8_dynamic"\n[quantization]\npreset = "w8a8"\n'
    )
    qnn = load_config(cwd=tmp_path).export_options()
    assert qnn.quantizer == "w8a8"
    et = load_config(cwd=tmp_path, overrides=["target=executorch"]).export_options()
    assert et.recipe == "xnnpack_int8_dynamic" and et.quantizer is None


def test_a_qnn_preset_without_a_recipe_is_an_error_for_executorch(tmp_path):
    (tmp_path / "graphbuild.toml").write_text(
        'model = "m.py:build"\ntarget = "executorch"\n[quantization]\npreset = "w8a8"\n'
    )
    with pytest.raises(ConfigError, match="no quantization presets.*set recipe"):
        load_config(cwd=tmp_path).export_options()


def test_request_format_defaults_to_the_targets_first():
    assert ExportRequest(None, None, "out", "m", target="executorch").format == "xnnpack"
    assert ExportRequest(None, None, "out", "m").format == "onnx"
    with pytest.raises(ConfigError, match="not registered: give its format"):
        ExportRequest(None, None, "out", "m", target="nowhere")


def test_qnn_presets_named_in_the_declaration_are_the_registered_ones():
    from graphbuild.targets.qnn.presets.quantizer import PRESETS

    assert get_target("qnn").presets == PRESETS


def test_declaring_the_builtin_targets_imports_no_torch_or_backend():
    import subprocess
    import sys

    code = (
        "import sys; from graphbuild.targets.registry import all_targets; all_targets();"
        "print(sorted(m for m in ('torch', 'torchao', 'executorch', 'onnx') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- export flags

LOUD_ECHO = dataclasses.replace(
    ECHO, export_flags=(ExportFlag("loud", "loud", "Shout the greeting."),)
)


@pytest.fixture
def loud_echo_target():
    register_target(LOUD_ECHO, replace=True)
    yield LOUD_ECHO
    registry._TARGETS.pop("echo", None)


def _cli(*args: str):
    from typer.testing import CliRunner

    from graphbuild.cli.app import app

    return CliRunner().invoke(app, list(args))


def test_the_export_help_lists_each_targets_flags_with_its_target(loud_echo_target):
    shown = " ".join(_cli("export", "--help").output.replace("│", " ").split())

    assert "--loud" in shown and "Shout the greeting (target echo)." in shown
    assert "--check-htp" in shown and "--strict-coverage" in shown
    assert "onnxruntime's CPU (target qnn)." in shown


def test_a_targets_flag_turns_its_option_on(tmp_path, monkeypatch, loud_echo_target):
    (tmp_path / "m.py").write_text(
        "import torch\n\n\ndef build():\n    return torch.nn.Linear(2, 2), (torch.randn(1, 2),)\n"
    )
    monkeypatch.chdir(tmp_path)
    common = ("export", "--target", "echo", "--model", "m.py:build", "--no-cache", "--json")

    quiet = _cli(*common, "--name", "m", "--output-dir", "quiet")
    loud = _cli(*common, "--name", "m", "--output-dir", "loud", "--loud")

    assert quiet.exit_code == 0 and loud.exit_code == 0, quiet.output + loud.output
    assert (tmp_path / "quiet" / "m.txt").read_text() == "hello"
    assert (tmp_path / "loud" / "m.txt").read_text() == "HELLO"


def test_a_flag_of_another_target_is_refused_as_its_option_is(tmp_path, monkeypatch):
    (tmp_path / "graphbuild.toml").write_text('model = "m.py:build"\ntarget = "executorch"\n')
    monkeypatch.chdir(tmp_path)

    result = _cli("export", "--check-htp", "--dry-run")

    assert result.exit_code == 2, result.output
    assert "check_htp" in result.output


def test_a_flag_must_switch_a_true_or_false_option():
    with pytest.raises(ConfigError, match="'greeting' must be a true/false option"):
        dataclasses.replace(ECHO, export_flags=(ExportFlag("hi", "greeting", "Greet."),))
    with pytest.raises(ConfigError, match="'volume' must be a true/false option"):
        dataclasses.replace(ECHO, numerics_option="volume")


def test_a_sweep_turns_on_the_numerics_option_its_target_declares(tmp_path, echo_target):
    from graphbuild.sweeps.runner import _spec
    from graphbuild.sweeps.variants import Variant

    (tmp_path / "graphbuild.toml").write_text('model = "m.py:build"\ntarget = "echo"\n')
    variant = Variant("v", (), ())

    undeclared = _spec(variant, None, tmp_path, [], tmp_path / "v", check_numerics=True)
    register_target(dataclasses.replace(ECHO, numerics_option="loud"), replace=True)
    declared = _spec(variant, None, tmp_path, [], tmp_path / "v", check_numerics=True)
    off = _spec(variant, None, tmp_path, [], tmp_path / "v", check_numerics=False)

    assert ("options.loud", True) not in undeclared.overrides
    assert ("options.loud", True) in declared.overrides
    assert declared.load_config().options["loud"] is True
    assert ("options.loud", True) not in off.overrides
