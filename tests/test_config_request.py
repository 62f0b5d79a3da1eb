"""One configuration, one export request: ``graphbuild export`` and a sweep's variant turn a
config into a request through the same function (``graphbuild.config.request``), so the two
build the same pipeline with the same context and keys."""

from __future__ import annotations

import dataclasses

import graphbuild as gb
from graphbuild.api import status
from graphbuild.cli.options import build_request, load_cli_config
from graphbuild.config import parse_override
from graphbuild.engine.fingerprint.walk import fingerprint
from graphbuild.sweeps.builds import VariantBuilds, VariantSpec
from tests.sweep_helpers import write_config


def _described(request, pipeline):
    """What an export of ``request`` does, without the objects only a process holds."""
    fields = {
        f.name: getattr(request, f.name)
        for f in dataclasses.fields(request)
        if f.name not in ("model", "data", "options", "cache", "listeners", "pipeline_factory")
    }
    return {
        "fields": fields,
        "context": fingerprint(request.context()),
        "stages": [_stage(pipeline, name) for name in pipeline.order()],
        "products": list(pipeline.products),
    }


def _stage(pipeline, name):
    ref = pipeline.get_stage(name)
    return name, ref.stage.reads, ref.dependencies


def test_the_cli_and_a_sweep_build_the_same_request_from_one_config(tmp_path):
    config = write_config(tmp_path / "project")
    cache = gb.Cache(tmp_path / "cache")

    cli_request, cli_pipeline = build_request(load_cli_config(config), cache)
    variant = VariantBuilds([VariantSpec("only", str(config), str(config.parent), ())], cache)
    built = variant["only"]

    assert _described(cli_request, cli_pipeline) == _described(built.request, built.pipeline)
    assert cli_request.target_options().calibration  # the configured batches, not the samples
    # the same keys: the capture stage's key covers the model, the samples and the context
    cli_keys = {s.name: s.key for s in status(cli_request).stages}
    sweep_keys = {s.name: s.key for s in status(built.request).stages}
    assert cli_keys == sweep_keys and cli_keys["capture"] is not None


def test_a_config_option_reaches_both_requests(tmp_path):
    config = write_config(tmp_path / "project")
    sets = ["quantization.preset=w4a16", "options.opset=20"]
    cli_request, _ = build_request(load_cli_config(config, sets=sets), None)
    spec = VariantSpec(
        "w4", str(config), str(config.parent), tuple(parse_override(s) for s in sets)
    )
    built = VariantBuilds([spec], None)["w4"]

    for request in (cli_request, built.request):
        assert request.context()["opset"] == 20
        assert request.cache is False
    assert fingerprint(cli_request.context()) == fingerprint(built.request.context())
