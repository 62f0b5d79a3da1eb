"""graphbuild.toml / [tool.graphbuild]: finding, overriding, validating, importing the model."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from graphbuild.config import Config, find_config, load_config, parse_override
from graphbuild.errors import ConfigError

CONVNET = Path(__file__).resolve().parents[1] / "examples" / "convnet.py"


@pytest.fixture(autouse=True)
def _restore_import_state(tmp_path):
    """Loading a config puts its directory on sys.path; undo that, and forget the modules
    imported from this test's directory."""
    saved = list(sys.path)
    yield
    sys.path[:] = saved
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def convnet_config(directory: Path, extra: str = "") -> Path:
    return write(
        directory / "graphbuild.toml",
        f"""\
        model = "{CONVNET.as_posix()}:build"
        calibration = "{CONVNET.as_posix()}:calibration"
        model_name = "convnet"
        [quantization]
        preset = "w8a16"
        """
        + textwrap.dedent(extra),
    )


# --------------------------------------------------------------------------- finding


def test_config_is_found_from_a_subdirectory_and_paths_are_relative_to_it(tmp_path):
    write(tmp_path / "graphbuild.toml", 'model = "m.py:build"\ncache_dir = "c"\n')
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    cfg = load_config(cwd=sub)
    assert cfg.source == tmp_path / "graphbuild.toml"
    assert cfg.root == tmp_path
    assert cfg.output_dir == tmp_path / "graphbuild-out"
    assert cfg.cache_dir == tmp_path / "c"


def test_defaults_and_model_name_from_the_factory_stem(tmp_path):
    write(tmp_path / "graphbuild.toml", 'model = "models/resnet_q.py:build"\n')
    cfg = load_config(cwd=tmp_path)
    assert (cfg.target, cfg.format, cfg.model_name) == ("qnn", "onnx", "resnet_q")
    assert cfg.preset is None and cfg.quantizer is None and cfg.cache_dir is None
    assert cfg.run_id == "qnn:resnet_q"
    write(tmp_path / "graphbuild.toml", 'model = "pkg.nets.decoder:make"\n')
    assert load_config(cwd=tmp_path).model_name == "decoder"


def test_graphbuild_toml_wins_over_pyproject_in_the_same_directory(tmp_path):
    write(tmp_path / "pyproject.toml", '[tool.graphbuild]\nmodel = "p.py:build"\n')
    assert find_config(tmp_path) == tmp_path / "pyproject.toml"
    assert load_config(cwd=tmp_path).model == "p.py:build"
    write(tmp_path / "graphbuild.toml", 'model = "g.py:build"\n')
    assert load_config(cwd=tmp_path).model == "g.py:build"


def test_pyproject_without_tool_graphbuild_is_passed_over(tmp_path):
    write(tmp_path / "pyproject.toml", '[tool.graphbuild]\nmodel = "outer.py:build"\n')
    inner = tmp_path / "inner"
    write(inner / "pyproject.toml", '[project]\nname = "x"\n')
    assert load_config(cwd=inner).model == "outer.py:build"


def test_explicit_config_file_overrides_the_search(tmp_path):
    write(tmp_path / "graphbuild.toml", 'model = "found.py:build"\n')
    other = write(tmp_path / "conf" / "export.toml", 'model = "given.py:build"\n')
    cfg = load_config(other, cwd=tmp_path)
    assert cfg.model == "given.py:build" and cfg.root == other.parent
    pyproject = write(tmp_path / "conf" / "pyproject.toml", '[project]\nname = "x"\n')
    with pytest.raises(ConfigError, match=r"has no \[tool.graphbuild\] table"):
        load_config(pyproject, cwd=tmp_path)


def test_missing_config_says_where_it_looked_and_how_to_create_one(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(cwd=tmp_path)
    text = str(err.value)
    assert str(tmp_path) in text and "any parent directory" in text
    assert "graphbuild.toml" in text and 'model = "' in text and "--model" in text
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", cwd=tmp_path)


def test_no_file_is_fine_with_a_model_override_or_when_not_required(tmp_path):
    cfg = load_config(cwd=tmp_path, overrides=[("model", "m.py:build")])
    assert cfg.source is None and cfg.root == tmp_path and cfg.model_name == "m"
    assert load_config(cwd=tmp_path, required=False).model is None


def test_invalid_toml_names_the_file(tmp_path):
    write(tmp_path / "graphbuild.toml", "model = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(cwd=tmp_path)


# --------------------------------------------------------------------------- overrides


def test_override_values_parse_as_toml_else_as_strings():
    assert parse_override("options.opset=17") == ("options.opset", 17)
    assert parse_override("quantization.preset=w8a8") == ("quantization.preset", "w8a8")
    assert parse_override("format=onnx_qdq") == ("format", "onnx_qdq")
    assert parse_override("options.check_numerics=true") == ("options.check_numerics", True)
    assert parse_override('options.input_names=["x"]') == ("options.input_names", ["x"])
    assert parse_override('model_name="a b"') == ("model_name", "a b")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("options.opset")


def test_overrides_apply_over_the_file(tmp_path):
    convnet_config(tmp_path)
    cfg = load_config(
        cwd=tmp_path,
        overrides=["options.opset=17", "quantization.preset=w8a8", "format=onnx_qdq"],
    )
    assert cfg.options == {"opset": 17}
    assert (cfg.preset, cfg.format) == ("w8a8", "onnx_qdq")


def test_override_of_preset_replaces_a_configured_quantizer(tmp_path):
    write(
        tmp_path / "graphbuild.toml",
        'model = "m.py:build"\n[quantization]\nquantizer = "mine:Q"\n',
    )
    cfg = load_config(cwd=tmp_path, overrides=["quantization.preset=w4a16"])
    assert (cfg.preset, cfg.quantizer) == ("w4a16", None)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "text, where, suggestion",
    [
        ('modle = "m.py:build"\n', "top-level key 'modle'", "'model'"),
        ('model = "m.py:build"\n[options]\nopsett = 17\n', "'opsett' in [options]", "'opset'"),
        ('model = "m.py:build"\n[quantization]\npresett = "w8a8"\n', "[quantization]", "'preset'"),
    ],
)
def test_unknown_key_names_key_and_table_and_suggests_the_closest(
    tmp_path, text, where, suggestion
):
    write(tmp_path / "graphbuild.toml", text)
    with pytest.raises(ConfigError) as err:
        load_config(cwd=tmp_path)
    assert where in str(err.value)
    assert f"did you mean {suggestion}?" in str(err.value)


def test_unknown_override_key_suggests_the_closest(tmp_path):
    convnet_config(tmp_path)
    with pytest.raises(ConfigError, match=r"'opst' in \[options\]; did you mean 'opset'"):
        load_config(cwd=tmp_path, overrides=["options.opst=17"])
    with pytest.raises(ConfigError, match="did you mean 'format'"):
        load_config(cwd=tmp_path, overrides=["fromat=onnx"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("model = 3\n", "'model' must be a string, got 3 (an integer)"),
        ('model = "m.py:b"\n[options]\nopset = "17"\n', "'options.opset' must be an integer"),
        ('model = "m.py:b"\n[options]\nopset = true\n', "'options.opset' must be an integer"),
        ('model = "m.py:b"\n[options]\ninput_names = [1]\n', "must be a list of strings"),
        ('model = "m.py:b"\n[options]\ncheck_numerics = "yes"\n', "must be true or false"),
        ('model = "m.py:b"\nquantization = "w8a8"\n', "'quantization' must be a table"),
        ('model = "m.py:b"\noptions = {}\ntarget = []\n', "'target' must be a string"),
        ('model = "m.py:b"\n[cache]\nreadonly = "yes"\n', "'cache.readonly' must be true or"),
        ('model = "m.py:b"\n[cache]\nurl = 6379\n', "'cache.url' must be a string"),
    ],
)
def test_wrong_type_names_key_expected_type_and_value(tmp_path, text, message):
    write(tmp_path / "graphbuild.toml", text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(cwd=tmp_path)


def test_the_cache_table_gives_the_directory_the_url_and_read_only(tmp_path):
    write(
        tmp_path / "graphbuild.toml",
        'model = "m.py:b"\n[cache]\ndir = "c"\nurl = "redis://h:6379/1"\nreadonly = true\n',
    )
    cfg = load_config(cwd=tmp_path)
    assert cfg.cache_dir == tmp_path / "c"
    assert (cfg.cache_url, cfg.cache_readonly) == ("redis://h:6379/1", True)


def test_cache_dir_and_cache_table_dir_that_disagree_are_refused(tmp_path):
    write(tmp_path / "graphbuild.toml", 'model = "m.py:b"\ncache_dir = "a"\n[cache]\ndir = "b"\n')
    with pytest.raises(ConfigError, match="'cache_dir' and 'cache.dir' disagree"):
        load_config(cwd=tmp_path)


def test_wrong_type_through_an_override(tmp_path):
    convnet_config(tmp_path)
    with pytest.raises(ConfigError, match=r"'options.opset' must be an integer, got 'x1'"):
        load_config(cwd=tmp_path, overrides=["options.opset=x1"])


def test_preset_and_quantizer_together_are_refused(tmp_path):
    write(
        tmp_path / "graphbuild.toml",
        'model = "m.py:b"\n[quantization]\npreset = "w8a8"\nquantizer = "q:Q"\n',
    )
    with pytest.raises(ConfigError, match="both 'preset' and 'quantizer'"):
        load_config(cwd=tmp_path)


def test_spec_without_an_attribute_is_refused_at_load(tmp_path):
    write(tmp_path / "graphbuild.toml", 'model = "examples/convnet.py"\n')
    with pytest.raises(ConfigError, match=r"'model' must look like 'path/to/file.py:name'"):
        load_config(cwd=tmp_path)


def test_option_values_are_checked_when_building_export_options(tmp_path):
    convnet_config(tmp_path, "[options]\nopset = 17\ninput_names = ['image']\n")
    opts = load_config(cwd=tmp_path).export_options(calibration=[1])
    assert (opts.opset, tuple(opts.input_names), opts.quantizer) == (17, ("image",), "w8a16")
    bad = load_config(cwd=tmp_path, overrides=["options.opset=99"])
    with pytest.raises(ConfigError, match="opset must be an integer from 13 to 23"):
        bad.export_options()


def test_unknown_preset_suggests_a_known_one(tmp_path):
    cfg = load_config(cwd=convnet_config(tmp_path).parent, overrides=["quantization.preset=w8a6"])
    with pytest.raises(ConfigError, match="unknown quantization preset 'w8a6'; did you mean"):
        cfg.quantizer_object()


# --------------------------------------------------------------------------- loading the model


def test_file_factory_returns_model_samples_and_calibration(tmp_path):
    cfg = load_config(cwd=convnet_config(tmp_path).parent)
    model, samples, calibration = cfg.load_model()
    assert isinstance(model, torch.nn.Module) and type(model).__name__ == "ConvNet"
    assert samples[0].shape == (1, 3, 16, 16)
    assert len(calibration) == 8 and calibration[0][0].shape == (1, 3, 16, 16)


def test_a_file_loads_under_one_stable_module_name_from_any_config(tmp_path):
    first = load_config(cwd=convnet_config(tmp_path / "a").parent).load_model()[0]
    second = load_config(cwd=convnet_config(tmp_path / "b").parent).load_model()[0]
    name = type(first).__module__
    assert name == type(second).__module__ == "examples.convnet"
    assert Path(sys.modules[name].__file__) == CONVNET


def test_a_model_file_loads_as_the_module_a_python_import_gives(tmp_path):
    from examples import convnet

    model = load_config(cwd=convnet_config(tmp_path).parent).load_model()[0]

    assert type(model) is convnet.ConvNet  # one module: the API and the CLI key alike


CLONED_NET = """\
    import torch


    class ClonedNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x)


    def build():
        return ClonedNet(), (torch.ones(1, 4),)
    """


def _fresh_process_imports(prefix: str) -> None:
    """Forget modules as a new process would not have them."""
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


def test_two_checkouts_of_a_project_give_its_model_one_module_name_and_structure_key(tmp_path):
    from graphbuild.engine.fingerprint import structure_fingerprint

    names, digests = [], []
    for clone in (tmp_path / "alice" / "proj", tmp_path / "ci" / "builds" / "7" / "proj"):
        write(clone / "gbclone_nets" / "__init__.py", "")
        write(clone / "gbclone_nets" / "net.py", CLONED_NET)
        write(clone / "graphbuild.toml", 'model = "gbclone_nets/net.py:build"\n')
        _fresh_process_imports("gbclone_nets")
        model = load_config(cwd=clone).load_model()[0]
        names.append(type(model).__module__)
        digests.append(structure_fingerprint(model).digest)

    assert names == ["gbclone_nets.net", "gbclone_nets.net"]
    assert digests[0] == digests[1]


def test_a_file_whose_name_is_taken_loads_under_a_name_from_its_contents(tmp_path):
    names = []
    for clone in (tmp_path / "one", tmp_path / "two" / "deeper"):
        write(clone / "json.py", CLONED_NET)  # the standard library's json is imported
        write(clone / "graphbuild.toml", 'model = "json.py:build"\n')
        names.append(type(load_config(cwd=clone).load_model()[0]).__module__)

    assert names[0] == names[1] and names[0].startswith("graphbuild_user_json_")
    assert sys.modules["json"].__file__ != str(tmp_path / "one" / "json.py")


def test_module_factory_imports_from_the_config_directory(tmp_path):
    write(tmp_path / "gbtest_pkg" / "__init__.py", "")
    write(
        tmp_path / "gbtest_pkg" / "nets.py",
        """\
        import torch

        def make():
            return torch.nn.Linear(4, 2)

        def samples():
            return (torch.randn(1, 4),)
        """,
    )
    write(
        tmp_path / "graphbuild.toml",
        'model = "gbtest_pkg.nets:make"\nsamples = "gbtest_pkg.nets:samples"\n',
    )
    model, samples, calibration = load_config(cwd=tmp_path).load_model()
    assert isinstance(model, torch.nn.Linear) and samples[0].shape == (1, 4)
    assert calibration is None


def _bad_models(tmp_path: Path) -> Path:
    return write(
        tmp_path / "bad_models.py",
        """\
        import torch

        def raises():
            raise RuntimeError("weights not found at /nowhere/w.pt")

        def number():
            return 42

        def only_module():
            return torch.nn.Linear(2, 2)

        def needs_args(size):
            return torch.nn.Linear(size, size)

        not_callable = 7
        """,
    )


@pytest.mark.parametrize(
    "spec, message",
    [
        ("missing.py:build", r"file .*missing.py does not exist"),
        ("bad_models.py:rases", r"has no attribute 'rases'; did you mean 'raises'"),
        ("bad_models.py:not_callable", "is int, not a callable factory"),
        ("bad_models.py:number", r"returned int 42; expected a torch.nn.Module or a \(module"),
        ("bad_models.py:only_module", "returned only a module; return .* or set samples"),
        ("bad_models.py:needs_args", "must take no arguments"),
        ("no_such_pkg.models:build", "no module named 'no_such_pkg'"),
    ],
)
def test_bad_model_spec_is_a_clear_config_error(tmp_path, spec, message):
    _bad_models(tmp_path)
    write(tmp_path / "graphbuild.toml", f'model = "{spec}"\n')
    with pytest.raises(ConfigError, match=message):
        load_config(cwd=tmp_path).load_model()


def test_factory_that_raises_carries_its_message_and_exception_type(tmp_path):
    _bad_models(tmp_path)
    write(tmp_path / "graphbuild.toml", 'model = "bad_models.py:raises"\n')
    with pytest.raises(ConfigError) as err:
        load_config(cwd=tmp_path).load_model()
    assert "raised RuntimeError: weights not found at /nowhere/w.pt" in str(err.value)
    assert isinstance(err.value.__cause__, RuntimeError)


def test_importing_a_broken_file_is_a_config_error(tmp_path):
    write(tmp_path / "broken.py", "import torch\ndef broken(:\n")
    write(tmp_path / "graphbuild.toml", 'model = "broken.py:build"\n')
    with pytest.raises(ConfigError, match="raised SyntaxError"):
        load_config(cwd=tmp_path).load_model()


def test_no_model_configured(tmp_path):
    with pytest.raises(ConfigError, match="no model configured"):
        Config(root=tmp_path).load_model()


def test_quantizer_spec_accepts_a_factory_and_refuses_other_objects(tmp_path):
    from torchao.quantization.pt2e.quantizer import Quantizer

    write(
        tmp_path / "graphbuild.toml",
        'model = "m.py:b"\n[quantization]\nquantizer = "graphbuild.targets.qnn.presets.quantizer:QnnQuantizer"\n',
    )
    assert isinstance(load_config(cwd=tmp_path).quantizer_object(), Quantizer)
    cfg = load_config(
        cwd=tmp_path, overrides=["quantization.quantizer=graphbuild.config:CONFIG_FILE"]
    )
    with pytest.raises(ConfigError, match="expected a torchao Quantizer"):
        cfg.quantizer_object()


def test_int32_bias_is_an_options_key_of_the_qnn_target(tmp_path):
    convnet_config(tmp_path, "[options]\nint32_bias = false\n")
    assert load_config(cwd=tmp_path).export_options(calibration=[1]).int32_bias is False
    assert load_config(cwd=convnet_config(tmp_path).parent).export_options().int32_bias is None
    with pytest.raises(ConfigError, match="'options.int32_bias' must be true or false"):
        load_config(cwd=tmp_path, overrides=["options.int32_bias=1"])


# --------------------------------------------------------------------------- a model override


def test_a_model_override_drops_what_belonged_to_the_files_model(tmp_path):
    path = convnet_config(tmp_path)
    path.write_text('samples = "s.py:samples"\n' + path.read_text())
    cfg = load_config(cwd=tmp_path, overrides=[("model", "/elsewhere/decoder.py:build")])
    assert cfg.calibration is None and cfg.samples is None
    assert cfg.model_name == "decoder"  # from the new model, not the file's "convnet"
    assert cfg.dropped == ("samples", "calibration", "model_name")
    assert cfg.preset == "w8a16"  # how to quantize is not the model's


def test_a_model_override_keeps_what_the_command_line_gives_with_it(tmp_path):
    convnet_config(tmp_path)
    cfg = load_config(
        cwd=tmp_path,
        overrides=[("model", "/elsewhere/decoder.py:build"), "calibration=c.py:batches"],
    )
    assert cfg.calibration == "c.py:batches" and cfg.dropped == ("model_name",)


def test_naming_the_files_own_model_again_drops_nothing(tmp_path):
    convnet_config(tmp_path)
    cfg = load_config(cwd=tmp_path, overrides=[("model", f"{CONVNET.as_posix()}:build")])
    assert cfg.dropped == () and cfg.calibration is not None and cfg.model_name == "convnet"


# --------------------------------------------------------------------------- target keys


def test_a_targets_top_level_option_is_its_option_and_other_targets_ignore_it(tmp_path):
    path = convnet_config(tmp_path)
    path.write_text('recipe = "int8_dynamic"\n' + path.read_text())
    assert "recipe" not in load_config(cwd=tmp_path).options  # qnn declares no recipe
    et = load_config(cwd=tmp_path, overrides=["target=executorch"])
    assert et.options["recipe"] == "int8_dynamic"


def test_a_top_level_option_and_the_same_option_in_options_must_agree(tmp_path):
    write(
        tmp_path / "graphbuild.toml",
        'model = "m.py:b"\ntarget = "executorch"\nrecipe = "fp32"\n[options]\nrecipe = "int8_static"\n',
    )
    with pytest.raises(ConfigError, match="'recipe' and 'options.recipe' disagree"):
        load_config(cwd=tmp_path)


def test_set_of_a_bare_option_name_goes_to_options(tmp_path):
    convnet_config(tmp_path)
    cfg = load_config(cwd=tmp_path, overrides=["target=executorch", "check_numerics=true"])
    assert cfg.options["check_numerics"] is True
    qnn = load_config(cwd=tmp_path, overrides=["opset=17"])
    assert qnn.options["opset"] == 17


def test_a_bare_option_name_in_the_file_points_to_options(tmp_path):
    write(tmp_path / "graphbuild.toml", 'model = "m.py:b"\ncheck_numerics = true\n')
    with pytest.raises(ConfigError, match=r"'check_numerics' is not a top-level key.*\[options\]"):
        load_config(cwd=tmp_path)


def test_a_bare_option_of_another_target_names_the_table_it_is_unknown_in(tmp_path):
    convnet_config(tmp_path)
    with pytest.raises(ConfigError, match=r"unknown key 'opset' in \[options\]"):
        load_config(cwd=tmp_path, overrides=["target=executorch", "opset=17"])


def test_a_target_of_the_wrong_type_is_named_before_options_are_checked(tmp_path):
    write(tmp_path / "graphbuild.toml", "options = {}\ntarget = []\n")
    with pytest.raises(ConfigError, match=r"'target' must be a string, got \[\]"):
        load_config(cwd=tmp_path)
