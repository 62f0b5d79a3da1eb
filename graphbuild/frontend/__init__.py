"""The torch.export front end: capture, PT2E quantization, and quantizer normalization to
markers described by a quant map (both in :mod:`graphbuild.quant`, below front ends and
formats)."""

from graphbuild.engine.fingerprint import register_registry


def _recognizers() -> tuple:
    from graphbuild.frontend.normalize import recognizers

    return recognizers()


def _quantizer_presets() -> dict:
    from graphbuild.frontend.presets import preset_entries

    return preset_entries()


# What the front end's stages consult besides their inputs, as reads a stage declares
# ("registry.recognizers" for normalize, "registry.quantizer_presets" for quantize): the code
# and configuration of every entry are part of their keys. Read lazily: a warm run that never
# normalizes need not import the recognisers before it computes a key, nor torchao for the
# built-in presets (see frontend.presets).
register_registry("recognizers", _recognizers)
register_registry("quantizer_presets", _quantizer_presets)
