"""The QNN target's options: one dataclass, the formats, and the keys a config file may set."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from graphbuild.errors import ConfigError
from graphbuild.quant.range_methods import DEFAULT_RANGE_METHOD, needs_histograms, range_config
from graphbuild.targets.base import BOOL, FLOAT, INT, STR, STRS, OptionType, check_calibration
from graphbuild.targets.qnn.arch.targets import HtpTarget, parse_targets

#: The formats of one ONNX graph (:mod:`.pipeline.build`); ``llm`` builds many (:mod:`.llm`).
ONNX_FORMATS = ("onnx", "onnx_qdq", "context")
FORMATS = (*ONNX_FORMATS, "llm")
KV_BITS = (8, 16)
ENCODINGS_VERSIONS = ("1.0.0", "0.6.1", "2.0.0")
DEFAULT_ENCODINGS_VERSION = "1.0.0"


@dataclass
class QnnOnnxOptions:
    """Options of the QNN export; each becomes one context key that stages declare.

    ``quantizer`` is a preset name (``w8a8``, ``w8a16``, ``w4a16``, ``w4a16_lpbq``) or a torchao
    ``Quantizer``; with it graphbuild runs PT2E on ``calibration`` (batches of positional
    inputs). Without it the model is taken as already quantized (fake-quant or q/dq ops).
    ``lpbq`` writes a model's own blocked int4 weight quantizers (FastForward's, say) as LPBQ:
    integer block scales under a float scale per channel, as FastForward's export with an
    ``LPBQProcessor(compressed_bw=4, decompressed_bw=8)`` does (the scales are compressed, so
    the export then differs from the model by that); LPBQ quantizers (aimet-torch's
    ``GroupedBlockQuantizeDequantize``, the ``w4a16_lpbq`` preset) are LPBQ without it.
    ``int32_bias`` writes int32 bias encodings (scale = input scale x weight scale) as AIMET
    does; ``None`` follows AIMET's default: on for ``2.0.0``, off for ``1.0.0`` and ``0.6.1``.
    ``strict_coverage`` fails the export when a tensor QNN HTP runs quantized is left float
    (see the coverage report) and, with ``check_htp``, when QNN's HTP backend refuses the
    model with CPU fallback disabled or (with a preset) runs an op in float.
    ``check_htp`` compiles the export on QNN's HTP backend (the ``htp`` extra) for each of
    ``htp_arch`` (``"v81"`` or a list; default: the presets' configuration, v81) with its
    ``soc_model`` (QNN's SoC id; default: the arch's), reports what QNN took and compares its
    outputs with onnxruntime's CPU. The ``context`` format prepares a QNN context binary for
    each of them.
    ``matmul_int16_requantize`` (QDQ models: ``onnx_qdq``, ``context`` and the QDQ the HTP
    check rebuilds for ``onnx``) requantizes a 16-bit symmetric second MatMul input to int16
    just before the MatMul, the form the HTP's 16x16 MatMul computes right (see
    :mod:`.rewrites.qdq_forms`); ``False`` leaves it out, for tools that import the QDQ model
    strictly (AIMET's quantization sim has no quantizer there), at the cost of that product's
    accuracy on the HTP. ``None`` (the default) requantizes unless one of ``htp_arch`` refuses
    a 16x16 MatMul with an int16 second input (v68, v69): one QDQ model serves every listed
    arch.

    ``external_data`` lays out the model file's tensors (:func:`graphbuild.onnx.save.save_model`):
    ``None`` (the default) inline up to 32 MiB of tensors, ``"per_tensor"`` above (each
    tensor of 64 KiB or more in a data file of its own, so a retune rewrites only the tensors
    it changed); ``True`` one ``<name>.onnx.data``; ``False`` inline (up to protobuf's 2 GiB).

    ``range_method`` sets how a preset's activation ranges come from calibration:
    ``minmax`` (the observed extremes), ``moving_average`` (of each calibration batch's
    extremes, constant ``range_averaging``), ``percentile`` (``range_percentile`` and its
    mirror, from a histogram) or ``mse`` (least expected quantization error, AIMET's
    TF-enhanced). Weights always take their min/max.

    ``layer_overrides`` (module pattern -> ``"float"``, ``"w4"``, ``"a8"``, ``"w4a16"``...)
    changes what a preset does in the matched modules
    (:mod:`graphbuild.targets.qnn.presets.overrides`).

    ``contexts`` (the ``llm`` format) also prepares each part's prompt and token graphs into
    one weight-shared QNN context binary per target of ``htp_arch`` (v73 or later), with the
    onnxruntime-genai (``htp/``) and Genie (``genie/``) configurations that run them.
    """

    opset: int = 21
    encodings_version: str = DEFAULT_ENCODINGS_VERSION
    input_names: Sequence[str] | None = None
    output_names: Sequence[str] | None = None
    external_data: bool | str | None = None
    fake_quantize_weights: bool = True
    quantizer: Any = None
    calibration: Sequence[Any] | None = None
    check_numerics: bool = False
    int32_bias: bool | None = None
    lpbq: bool = False
    strict_coverage: bool = False
    check_htp: bool = False
    htp_arch: str | Sequence[str] | None = None
    soc_model: str | Sequence[str] | None = None
    matmul_int16_requantize: bool | None = None
    range_method: str = DEFAULT_RANGE_METHOD
    range_percentile: float = 99.99
    range_averaging: float = 0.01
    layer_overrides: Mapping[str, str] | None = None
    prompt_len: int = 128
    context_len: int = 4096
    parts: int | None = None
    max_part_bytes: int | None = None
    kv_bits: int | None = None
    calibration_steps: int = 8
    contexts: bool = False

    def __post_init__(self) -> None:
        if self.encodings_version not in ENCODINGS_VERSIONS:
            raise ConfigError(
                f"unknown encodings version '{self.encodings_version}'; "
                f"known: {', '.join(ENCODINGS_VERSIONS)}"
            )
        if not isinstance(self.opset, int) or not 13 <= self.opset <= 23:
            raise ConfigError(f"opset must be an integer from 13 to 23, not {self.opset!r}")
        for key in ("input_names", "output_names"):
            _check_names(key, getattr(self, key))
        range_config(self.range_method, self.range_percentile, self.range_averaging)
        check_calibration(self.calibration)
        if self.layer_overrides:
            _check_layer_overrides(self.layer_overrides, self.quantizer)
        self.htp_targets()  # a ConfigError now, not when a stage runs
        _check_llm_geometry(self)

    def htp_targets(self) -> tuple[HtpTarget, ...]:
        """The HTP targets ``htp_arch`` and ``soc_model`` name (default: v81)."""
        return parse_targets(self.htp_arch, self.soc_model)

    def requantizes_matmul_inputs(self) -> bool:
        """``matmul_int16_requantize`` as set, or where unset whether every HTP target takes
        the int16 second MatMul input (the context holds this, so a key sees the decision)."""
        if self.matmul_int16_requantize is not None:
            return bool(self.matmul_int16_requantize)
        return all(t.takes_int16_matmul_input for t in self.htp_targets())

    def to_context(self) -> dict[str, Any]:
        # not dataclasses.asdict: it would deep-copy the quantizer and every calibration tensor
        ctx = {f.name: getattr(self, f.name) for f in fields(self)}
        ctx["calibration"] = list(self.calibration) if self.calibration is not None else None
        check_calibration(ctx["calibration"])
        ctx["matmul_int16_requantize"] = self.requantizes_matmul_inputs()
        for key in ("input_names", "output_names", "htp_arch", "soc_model"):
            if ctx[key] is not None and not isinstance(ctx[key], (str, int)):
                ctx[key] = list(ctx[key])
        overrides = self.layer_overrides or _own_overrides(self.quantizer)
        ctx["layer_overrides"] = dict(sorted(overrides.items())) if overrides else None
        # derived keys: what a stage reads, no more (a preset change keeps the placement;
        # a percentile change keeps the statistics)
        ctx["range"] = range_config(self.range_method, self.range_percentile, self.range_averaging)
        ctx["statistics"] = "histogram" if needs_histograms(ctx["range"]) else "minmax"
        ctx["quantizer_placement"] = _placement(self.quantizer)
        # whether weight_stats records LPBQ block ranges: only an LPBQ preset pays for them
        ctx["weight_blocks"] = _preset_name(self.quantizer) in LPBQ_PRESETS
        return ctx


def _check_llm_geometry(opts: QnnOnnxOptions) -> None:
    """The ``llm`` format's shapes: N prompt tokens in a context of CL positions."""
    for key in ("prompt_len", "context_len", "calibration_steps"):
        value = getattr(opts, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key} must be a positive integer, not {value!r}")
    if opts.prompt_len >= opts.context_len:
        raise ConfigError(
            f"prompt_len ({opts.prompt_len}) must be less than context_len "
            f"({opts.context_len}): the prompt graph reads the past from the other "
            f"{opts.context_len} - prompt_len slots"
        )
    if opts.context_len < 2 * opts.prompt_len:
        raise ConfigError(
            f"context_len ({opts.context_len}) must be at least twice prompt_len "
            f"({opts.prompt_len}): onnxruntime-genai's sliding-window KV cache needs a full "
            "window of past slots"
        )
    if opts.kv_bits is not None and opts.kv_bits not in KV_BITS:
        raise ConfigError(f"kv_bits must be 8 or 16, not {opts.kv_bits!r}")
    for key in ("parts", "max_part_bytes"):
        value = getattr(opts, key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ConfigError(f"{key} must be a positive integer, not {value!r}")


def _own_overrides(quantizer: Any) -> dict[str, str] | None:
    """The ``layer_overrides`` a ``QnnQuantizer`` instance was made with, as the option writes
    them: the preset's split reads them from the context (the option's, when set, win, as
    they replace the instance's in PT2E)."""
    own = getattr(quantizer, "layer_overrides", None)
    if not own or _preset_name(quantizer) not in PRESETS:
        return None
    return {pattern: getattr(setting, "text", setting) for pattern, setting in own.items()}


def _preset_name(quantizer: Any) -> Any:
    return quantizer if isinstance(quantizer, str) else getattr(quantizer, "preset", None)


def _placement(quantizer: Any) -> Any:
    """What decides where quantizers sit: a built-in preset's placement (presets quantizing
    the same tensors share one), the quantizer itself otherwise."""
    preset = _preset_name(quantizer)
    if preset in PRESET_PLACEMENTS:
        return PRESET_PLACEMENTS[preset]
    return quantizer


def presets_placed_as(placement: str) -> tuple[str, ...]:
    """The built-in presets that share ``placement``, in :data:`PRESETS` order."""
    return tuple(p for p in PRESETS if PRESET_PLACEMENTS.get(p) == placement)


def _check_layer_overrides(overrides: Mapping[str, str], quantizer: Any) -> None:
    """Each entry must parse, and overrides apply to a QNN preset only."""
    from graphbuild.targets.qnn.presets.overrides import parse_layer_overrides

    parse_layer_overrides(overrides)
    preset = quantizer if isinstance(quantizer, str) else getattr(quantizer, "preset", None)
    if preset not in PRESETS:
        raise ConfigError(
            "layer_overrides change what a QNN preset does in some modules: set a preset "
            f"({', '.join(PRESETS)}) as the quantizer, not {quantizer!r}"
        )


def _check_names(key: str, names: Sequence[str] | None) -> None:
    """Tensor names must be non-empty strings, each given once."""
    if names is None:
        return
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{key} must be a list of strings, not {names!r}")
    empty = [i for i, n in enumerate(names) if not n]
    if empty:
        raise ConfigError(f"{key}: name {empty[0]} is empty; every tensor needs a name")
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        raise ConfigError(f"{key}: {', '.join(repeated)} given more than once")


#: The quantizer presets ``presets/quantizer.py`` registers, named here so that reading a
#: config needs no torchao import (tests/test_targets.py checks the two agree).
PRESETS: tuple[str, ...] = ("w8a8", "w8a16", "w4a16", "w4a16_lpbq")
#: The presets whose linear weights are LPBQ.
LPBQ_PRESETS: tuple[str, ...] = ("w4a16_lpbq",)
#: ``ctx.quantizer_placement`` of each preset: presets quantizing the same tensors share one
#: placement, and switching between them recomputes values only. A preset whose rules came
#: to quantize other tensors would get a placement of its own here (``place_quantizers``
#: refuses a shared one that does not hold, naming the tensors). ``w4a16_lpbq`` shares it:
#: its LPBQ weights are the same quantizers with block scales, computed as values from the
#: weights' block statistics.
PRESET_PLACEMENTS: dict[str, str] = dict.fromkeys(PRESETS, "qnn-presets")

#: What a config file's ``[options]`` table may set for the qnn target.
CONFIG_SCHEMA: dict[str, OptionType] = {
    "opset": INT,
    "encodings_version": STR,
    "input_names": STRS,
    "output_names": STRS,
    "external_data": OptionType(
        'true, false or "per_tensor"', lambda v: isinstance(v, bool) or v == "per_tensor"
    ),
    "fake_quantize_weights": BOOL,
    "check_numerics": BOOL,
    "int32_bias": BOOL,
    "lpbq": BOOL,
    "strict_coverage": BOOL,
    "check_htp": BOOL,
    "matmul_int16_requantize": BOOL,
    "htp_arch": OptionType(
        "a string or a list of strings",
        lambda v: isinstance(v, str) or STRS.accepts(v),
    ),
    "soc_model": OptionType(
        "a string, an integer or a list of them",
        lambda v: (
            isinstance(v, (str, int))
            and not isinstance(v, bool)
            or isinstance(v, list)
            and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v)
        ),
    ),
    "range_method": STR,
    "range_percentile": FLOAT,
    "range_averaging": FLOAT,
    "prompt_len": INT,
    "context_len": INT,
    "parts": INT,
    "max_part_bytes": INT,
    "kv_bits": INT,
    "calibration_steps": INT,
    "contexts": BOOL,
    "layer_overrides": OptionType(
        "a table of module pattern = setting ('float', 'w4', 'a8', 'w4a16', ...)",
        lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
    ),
}
