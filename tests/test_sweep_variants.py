"""What a sweep varies: --vary axes, the [sweep] table, grid and list, named calibration sets,
and the errors a person gets for a sweep that cannot be run."""

from __future__ import annotations

import pytest

from graphbuild.config import load_config
from graphbuild.errors import ConfigError
from graphbuild.sweeps.variants import Axis, SweepSettings, parse_vary, split_values, sweep_settings


def test_vary_values_are_toml_values_or_plain_strings():
    axis = parse_vary("options.opset=17, 21")
    assert axis == Axis("options.opset", (17, 21))
    assert parse_vary("quantization.preset=w8a16,w8a8").values == ("w8a16", "w8a8")
    assert parse_vary("options.strict_coverage=true,false").values == (True, False)


def test_commas_inside_quotes_brackets_and_braces_belong_to_the_value():
    assert split_values('a,"b,c",[1, 2],{x = 1, y = "z"}') == [
        "a",
        '"b,c"',
        "[1, 2]",
        '{x = 1, y = "z"}',
    ]
    axis = parse_vary('options.layer_overrides={"lm_head" = "float"},{"blocks.*" = "w4"}')
    assert axis.values == ({"lm_head": "float"}, {"blocks.*": "w4"})


@pytest.mark.parametrize("text", ["options.opset", "=17", "options.opset=", "k=a,,b"])
def test_a_vary_that_is_not_key_equals_values_is_an_error(text):
    with pytest.raises(ConfigError, match="--vary"):
        parse_vary(text)


def test_a_grid_crosses_the_axes_first_axis_slowest():
    settings = SweepSettings(
        axes=(Axis("quantization.preset", ("w8a16", "w4a16")), Axis("options.opset", (17, 21)))
    )
    variants = settings.variants()

    assert [v.name for v in variants] == ["w8a16-17", "w8a16-21", "w4a16-17", "w4a16-21"]
    assert variants[1].overrides == (("quantization.preset", "w8a16"), ("options.opset", 21))


def test_a_list_zips_the_axes_which_need_as_many_values():
    axes = (Axis("quantization.preset", ("w8a16", "w4a16")), Axis("options.opset", (17, 21)))
    assert [v.name for v in SweepSettings(axes, mode="list").variants()] == [
        "w8a16-17",
        "w4a16-21",
    ]
    uneven = (axes[0], Axis("options.opset", (17,)))
    with pytest.raises(ConfigError, match="as many values"):
        SweepSettings(uneven, mode="list").variants()


def test_named_calibration_sets_become_their_specs_and_keep_their_names():
    settings = SweepSettings(
        axes=(Axis("calibration", ("default", "m.py:other")),),
        calibrations={"default": "m.py:calibration"},
    )
    a, b = settings.variants()

    assert (a.name, a.values, a.overrides) == (
        "default",
        (("calibration", "default"),),
        (("calibration", "m.py:calibration"),),
    )
    assert b.name == "other" and b.overrides == (("calibration", "m.py:other"),)


def test_an_unknown_calibration_name_lists_the_known_ones():
    settings = SweepSettings(axes=(Axis("calibration", ("typo",)),), calibrations={"large": "m:x"})
    with pytest.raises(ConfigError, match="known: large"):
        settings.variants()


@pytest.mark.parametrize("key", ["output_dir", "cache.url", "cache_dir"])
def test_where_the_sweep_places_and_caches_cannot_vary(key):
    with pytest.raises(ConfigError, match="cannot vary"):
        SweepSettings(axes=(Axis(key, ("a", "b")),)).variants()


def test_nothing_to_vary_says_how_to_give_axes():
    with pytest.raises(ConfigError, match="--vary"):
        SweepSettings().variants()


def test_names_stay_unique_and_identical_variants_are_refused():
    settings = SweepSettings(axes=(Axis("model_name", ("a/b", "a_b")),))
    assert [v.name for v in settings.variants()] == ["a_b", "a_b-2"]
    with pytest.raises(ConfigError, match="same values"):
        SweepSettings(axes=(Axis("options.opset", (17, 17)),)).variants()


def test_the_sweep_table_of_the_config_file(tmp_path):
    (tmp_path / "graphbuild.toml").write_text(
        'model = "m.py:build"\n'
        "[sweep]\n"
        'mode = "list"\n'
        'output_dir = "out"\n'
        "jobs = 3\n"
        'vary = { "quantization.preset" = ["w8a8", "w4a16"], calibration = ["a", "b"] }\n'
        "[sweep.calibrations]\n"
        'a = "m.py:ca"\n'
        'b = "m.py:cb"\n'
    )
    cfg = load_config(cwd=tmp_path)
    settings = sweep_settings(cfg.sweep)

    assert (settings.mode, settings.output_dir, settings.jobs) == ("list", "out", 3)
    assert [v.name for v in settings.variants()] == ["w8a8-a", "w4a16-b"]
    assert sweep_settings(cfg.sweep, ["options.opset=17,21"]).axes == (
        Axis("options.opset", (17, 21)),
    )  # the command line's axes replace the file's


def test_an_explicit_list_of_variants(tmp_path):
    table = {"variants": [{"quantization.preset": "w8a8"}, {"options.opset": 17}]}
    names = [v.name for v in sweep_settings(table).variants()]
    assert names == ["w8a8", "17"]


def test_an_unknown_key_in_the_sweep_table_is_an_error():
    with pytest.raises(ConfigError, match="unknown key"):
        sweep_settings({"varry": {}})


def test_the_example_sweep_has_the_nine_variants_the_readme_shows():
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "sweep.toml"
    settings = sweep_settings(load_config(example).sweep)

    assert [v.name for v in settings.variants()] == [
        f"{p}-{c}" for p in ("w8a16", "w8a8", "w4a16") for c in ("default", "large", "narrow")
    ]
