"""One graphbuild.toml for every target: ``[targets.<name>]`` tables hold what one target
uses, the shared keys are read by every target that takes them, and a shared key a target
cannot take is left out with one warning naming it, never silently."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from graphbuild.config import load_config
from graphbuild.errors import ConfigError, IgnoredConfigWarning

ROOT = Path(__file__).resolve().parents[1]

SHARED = """\
model = "m.py:build"
calibration = "m.py:calibration"
[quantization]
preset = "w8a16"
[options]
check_numerics = true
opset = 21
[targets.qnn]
format = "onnx_qdq"
encodings_version = "2.0.0"
[targets.gguf]
preset = "q8_0"
tokenizer = "tokenizer.json"
output_dir = "out-gguf"
[targets.executorch]
format = "portable"
recipe = "fp32"
"""


def write(tmp_path: Path, text: str = SHARED) -> Path:
    (tmp_path / "m.py").write_text("def build(): ...\ndef calibration(): ...\n")
    path = tmp_path / "graphbuild.toml"
    path.write_text(text)
    return path


def load(tmp_path: Path, *overrides: str):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(cwd=tmp_path, overrides=list(overrides))
    said = [str(w.message) for w in caught if issubclass(w.category, IgnoredConfigWarning)]
    return cfg, said


def test_each_target_reads_its_own_table_over_the_shared_keys(tmp_path):
    write(tmp_path)
    qnn, said = load(tmp_path)
    assert (qnn.format, qnn.preset, qnn.calibration) == ("onnx_qdq", "w8a16", "m.py:calibration")
    assert qnn.options == {"check_numerics": True, "opset": 21, "encodings_version": "2.0.0"}
    assert said == []
    gguf, _ = load(tmp_path, "target=gguf")
    assert (gguf.format, gguf.preset, gguf.calibration) == ("llama_cpp", "q8_0", None)
    assert gguf.options == {"check_numerics": True, "tokenizer": "tokenizer.json"}
    assert gguf.output_dir == tmp_path / "out-gguf"
    et, _ = load(tmp_path, "target=executorch")
    assert (et.format, et.preset, et.calibration) == ("portable", None, "m.py:calibration")
    assert et.options == {"check_numerics": True, "recipe": "fp32"}


def test_a_shared_key_a_target_cannot_take_is_said_once_and_left_out(tmp_path):
    write(tmp_path)
    gguf, said = load(tmp_path, "target=gguf")
    assert len(said) == 2, said  # the gguf table's preset replaces the shared one: not said
    assert any("gguf ignores calibration" in s for s in said), said
    assert any("gguf ignores [options] opset (qnn's; [targets.qnn] keeps it" in s for s in said)
    assert tuple(f"graphbuild: {s}" for s in gguf.ignored) == tuple(said)
    et, said = load(tmp_path, "target=executorch")
    assert [s.split(": ", 2)[-1] for s in said] == [
        "executorch ignores [quantization] preset 'w8a16' (qnn's; [targets.executorch] "
        "recipe = ... sets its own)",
        "executorch ignores [options] opset (qnn's; [targets.qnn] keeps it there)",
    ]


def test_a_key_the_command_line_gives_is_never_dropped(tmp_path):
    write(tmp_path)
    with pytest.raises(ConfigError, match=r"unknown key 'opset' in \[options\]"):
        load(tmp_path, "target=gguf", "options.opset=17")
    cfg, _ = load(tmp_path, "format=onnx")  # over [targets.qnn]'s onnx_qdq
    assert cfg.format == "onnx"
    cfg, _ = load(tmp_path, "target=gguf", "quantization.preset=q4_0")
    assert cfg.preset == "q4_0"


def test_another_targets_format_is_left_out_with_a_warning(tmp_path):
    write(tmp_path, 'model = "m.py:build"\nformat = "onnx_qdq"\n')
    cfg, said = load(tmp_path, "target=executorch")
    assert cfg.format == "xnnpack"
    assert said and "executorch ignores format 'onnx_qdq' (qnn's" in said[0]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[targets.qnnn]\nopset = 17\n", r"\[targets.qnnn\] names no target; did you mean 'qnn'"),
        ("[targets.qnn]\nopsett = 17\n", r"unknown key 'opsett' in \[targets.qnn\]; did you"),
        ("[targets.qnn]\nopset = 'x'\n", r"'targets.qnn.opset' must be"),
        ("[targets]\nqnn = 3\n", r"\[targets.qnn\] must be a table"),
        ("[options]\nopsett = 17\n", r"unknown key 'opsett' in \[options\]"),
    ],
)
def test_target_tables_are_checked_like_the_rest(tmp_path, text, match):
    write(tmp_path, 'model = "m.py:build"\n' + text)
    with pytest.raises(ConfigError, match=match):
        load(tmp_path)


def test_target_tables_are_validated_without_importing_torch(tmp_path):
    write(tmp_path)
    code = (
        "import sys; from graphbuild.config import load_config; "
        f"c = load_config(cwd={str(tmp_path)!r}, overrides=['target=gguf']); c.check(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        check=True,
    )
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_one_config_exports_qnn_gguf_and_executorch(tmp_path, monkeypatch):
    """The command line, three times over one graphbuild.toml: each target's files, and
    the keys a target ignores said once each as a ``warning:`` line."""
    pytest.importorskip("executorch", reason="exports the executorch target (the executorch extra)")
    from typer.testing import CliRunner

    from graphbuild.cli import app
    from tests import gguf_models as gm

    gm.tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "cal.py").write_text(
        "from examples.tiny_gguf import token_ids\n"
        "def batches():\n    return [(token_ids(),), (token_ids().flip(-1),)]\n"
    )
    (tmp_path / "graphbuild.toml").write_text(
        f'model = "{ROOT / "examples" / "tiny_gguf.py"}:llama"\n'
        'model_name = "tiny"\ncalibration = "cal.py:batches"\n'
        '[quantization]\npreset = "w8a16"\n'
        "[targets.qnn]\noutput_dir = 'out/qnn'\n"
        "[targets.gguf]\npreset = 'q8_0'\ntokenizer = 'tokenizer.json'\noutput_dir = 'out/gguf'\n"
        "[targets.executorch]\nformat = 'portable'\nrecipe = 'fp32'\noutput_dir = 'out/et'\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    files = {}
    for target, folder in (("qnn", "qnn"), ("gguf", "gguf"), ("executorch", "et")):
        result = CliRunner().invoke(app, ["export", "--no-cache", "--json", "--target", target])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert doc["target"] == target
        files[target] = sorted(p.name for p in (tmp_path / "out" / folder).iterdir())
        warned = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
        if target == "gguf":  # its own preset replaces the shared one: that is not said
            assert warned == [
                f"warning: {tmp_path / 'graphbuild.toml'}: gguf ignores calibration (it takes "
                "no calibration batches)"
            ], result.stderr
        elif target == "executorch":
            assert [w for w in warned if "ignores" in w] == [
                f"warning: {tmp_path / 'graphbuild.toml'}: executorch ignores [quantization] "
                "preset 'w8a16' (qnn's; [targets.executorch] recipe = ... sets its own)"
            ], result.stderr
    assert "tiny.onnx" in files["qnn"] and "tiny.encodings" in files["qnn"]
    assert "tiny.gguf" in files["gguf"]
    assert "tiny.pte" in files["executorch"]


ET_RECIPES = """\
model = "m.py:build"
target = "executorch"
recipe = "fp32"
[targets.executorch]
recipe = "xnnpack_fp32"
"""


def test_the_targets_table_wins_over_a_shared_top_level_option(tmp_path):
    """``recipe`` beside ``model`` is shared; ``[targets.executorch] recipe`` is the
    target's own, and wins (as its ``format`` does), not a conflict."""
    write(tmp_path, ET_RECIPES)
    cfg, said = load(tmp_path)
    assert cfg.options["recipe"] == "xnnpack_fp32"
    assert said == []


@pytest.mark.parametrize("override", ["recipe=int8", "options.recipe=int8"])
def test_the_command_line_wins_over_the_table_and_the_top_level(tmp_path, override):
    write(tmp_path, ET_RECIPES)
    cfg, _ = load(tmp_path, override)
    assert cfg.options["recipe"] == "int8"


def test_a_top_level_option_and_its_options_spelling_in_the_shared_keys_still_disagree(tmp_path):
    """Both spellings in the file's shared keys: the file's own mistake, still refused."""
    write(
        tmp_path,
        'model = "m.py:build"\ntarget = "executorch"\nrecipe = "fp32"\n'
        '[options]\nrecipe = "int8"\n',
    )
    with pytest.raises(ConfigError, match=r"'recipe' and 'options.recipe' disagree"):
        load(tmp_path)
