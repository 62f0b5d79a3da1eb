"""The QNN presets' quantization as structure, then statistics, then values (docs/design.md,
invariant 13).

::

    capture -> place_quantizers ---------------------------------> marker_graph -> to_onnx
                 |  placement -> weight_stats -----+-> left_float --^
                 |  fold_source -> fold_weights    |      +-> quant_map, quant_sites
                 +------------------> calibrate ---+----------> qparams

- **place_quantizers** (structure): ``prepare_pt2e`` with the preset family's quantizer on the
  captured program, observers replaced by numbered markers, traced once. It reads which
  tensors the presets quantize (``ctx.quantizer_placement``), never the bit-widths: the
  three presets share it, and it records each one's bit-width and symmetry per observer.
- **fold_weights**, **weight_stats** (values of the weights): the BatchNorm fold on the
  real weights, and the min/max of every stored tensor a quantizer reads.
- **calibrate** (statistics): the site program run over the calibration batches; per
  observer the min/max, each call's range and, for the percentile and MSE range methods,
  a histogram.
- **left_float**: which quantizers calibration leaves float (they saw ``inf``) and the qid
  of each other one; **marker_graph** drops those markers (a structure change, rare).
- **quant_map** and **qparams** (values): the preset's grids, and scales and zero points
  from the statistics and the range method: what a preset change or a new range method
  reruns, with no trace and no calibration pass. **quant_sites** is the quant map of the
  first preset, what ``onnx`` lowering reads (which tensor each qid marks).

This module holds the structure and statistics stages; the value stages, and the stages
after them that read the placement or the statistics, are in :mod:`.values`; the wiring is
:func:`~.build.wire_split_quantization`. The exported files are byte for byte those of the
one-stage PT2E quantize (``build_qnn_pipeline(..., one_stage_oracle=True)``, the tests'
oracle), which tests check; ``layer_overrides`` and LPBQ apply as values
(:mod:`.site_rules`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from graphbuild.engine.codecs import roundtrip
from graphbuild.frontend.capture import as_args
from graphbuild.frontend.devices import host_state, to_device
from graphbuild.frontend.programs import ProgramArtifact, strip_state, with_state


class Overlay(Mapping[str, torch.Tensor]):
    """Tensors by name from the first mapping that has them (folded, created, the model)."""

    def __init__(self, *layers: Mapping[str, torch.Tensor]) -> None:
        self.layers = layers

    def __getitem__(self, name: str) -> torch.Tensor:
        for layer in self.layers:
            try:  # not ``in``: a HostState would copy a device tensor to answer it
                return layer[name]
            except KeyError:
                continue
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        seen: set[str] = set()
        for layer in self.layers:
            for name in layer:
                if name not in seen:
                    seen.add(name)
                    yield name

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _describer(presets: tuple[str, ...]) -> Any:
    def describe(quantizer: Any, prepared: Any) -> dict[str, Any]:
        return _describe(quantizer, prepared, presets)

    return describe


def _describe(quantizer: Any, prepared: Any, presets: tuple[str, ...]) -> dict[str, Any]:
    """Per observer, the tensor it quantizes and each preset's rule for it (its group's)."""
    from graphbuild.targets.qnn.presets.quantizer import observed_tensors, observer_rules

    tensors = observed_tensors(quantizer, prepared)
    return {
        module: {
            "tensor": tensors[module],
            **{
                preset: {
                    "bits": rule.bits,
                    "symmetric": rule.symmetric,
                    "per_channel": rule.per_channel,
                    "fixed": list(rule.fixed) if rule.fixed is not None else None,
                    "min_scale": rule.min_scale,
                }
                for preset, rule in rules.items()
            },
        }
        for module, rules in observer_rules(quantizer, prepared, presets).items()
    }


def place_quantizers(inputs: tuple, samples: Any, context: Any) -> tuple:
    """Structure: the quantizers of the presets that share ``ctx.quantizer_placement``
    placed on the captured program (one trace), with each preset's rules per observer."""
    from graphbuild.frontend.placement import place_quantizers as place
    from graphbuild.targets.qnn.options import presets_placed_as
    from graphbuild.targets.qnn.presets.quantizer import QnnQuantizer, placed_tensors

    (captured,) = inputs
    presets = presets_placed_as(context["quantizer_placement"])
    quantizer = QnnQuantizer(presets[0])
    placement = place(
        captured.program, quantizer, to_device(as_args(samples), "cpu"), _describer(presets)
    )
    program = roundtrip(ProgramArtifact(strip_state(placement.program)))
    layout = {**placement.layout(), "presets": list(presets), **placed_tensors(quantizer)}
    for site in layout["sites"]:  # the rules are its group's: a site keeps its tensor alone
        site["settings"] = {"tensor": site["settings"]["tensor"]}
    return program, layout, placement.created


def placement(inputs: tuple, samples: Any, context: Any) -> tuple:
    """The layout and created tensors alone: what the value stages read, without the
    program."""
    ((_, layout, created),) = inputs
    return layout, created


def fold_source(inputs: tuple, samples: Any, context: Any) -> Any:
    """The captured program when the placement folded BatchNorm (``fold_weights`` replays
    the fold on the real weights), else nothing: a model without BatchNorm loads nothing."""
    captured, (layout, _) = inputs
    return captured if layout["folded"] else None


def fold_weights(inputs: tuple, samples: Any, context: Any) -> dict:
    """Values: the state tensors the BatchNorm fold rewrites, from the real weights."""
    from graphbuild.frontend.placement import fold_weights as fold
    from graphbuild.targets.qnn.presets.quantizer import QnnQuantizer

    program, (layout, _) = inputs
    if program is None:
        return {}
    quantizer = QnnQuantizer(layout["presets"][0])  # its rewrites come before the fold
    return fold(program.program, host_state(context.input), layout["folded"], quantizer)


def weight_stats(inputs: tuple, samples: Any, context: Any) -> dict:
    """Statistics of the quantizers that read stored tensors: from the tensors alone; with
    an LPBQ preset (``ctx.weight_blocks``), each block's range of the weights it may block
    too (a layer override to ``w8`` then changes values only)."""
    from graphbuild.frontend.statistics import block_statistics, static_statistics
    from graphbuild.targets.qnn.presets.lpbq_weights import BLOCK_SIZE

    (layout, created), folded = inputs
    tensors = Overlay(folded, created, host_state(context.input))
    stats = static_statistics(layout["sites"], layout["groups"], tensors)
    if not context["weight_blocks"]:
        return stats
    lpbq = set(layout["lpbq"])
    blocked = {
        g["index"]
        for g in layout["groups"]
        if layout["tensors"][g["settings"]["tensor"]]["group"] in lpbq
    }
    return {**stats, **block_statistics(layout["sites"], blocked, tensors, BLOCK_SIZE)}


def calibrate(inputs: tuple, samples: Any, context: Any) -> dict:
    """Statistics: the site program run over the calibration batches (the sample inputs
    when there are none)."""
    from graphbuild.frontend.statistics import calibrate as run
    from graphbuild.frontend.statistics import calibration_batches

    (program, layout, created), folded = inputs
    state = Overlay(folded, created, host_state(context.input))
    batches = calibration_batches(context["calibration"], as_args(samples))
    return run(
        with_state(program.program, state),
        layout["sites"],
        layout["groups"],
        batches,
        histograms=context["statistics"] == "histogram",
    )


def left_float(inputs: tuple, samples: Any, context: Any) -> dict:
    """Which quantizers calibration leaves float (their values were not finite) and the qid
    of every other site that no ``layer_overrides`` entry leaves float: the only way
    statistics and overrides reach the structure (cut off while the set does not change)."""
    from graphbuild.frontend.statistics import Statistics, observed_ranges
    from graphbuild.targets.qnn.pipeline.site_rules import SiteRules

    (layout, _), weights, activations = inputs
    stats = Statistics(weights, activations)
    dropped, _ = observed_ranges(layout["sites"], layout["groups"], stats)
    floated = SiteRules(layout, context["layer_overrides"]).floated()
    qids: list[int | None] = []
    kept = 0
    for site in layout["sites"]:
        if site["index"] in dropped or site["index"] in floated:
            qids.append(None)
        else:
            qids.append(kept)
            kept += 1
    names = {layout["sites"][i]["source"]: why for i, why in dropped.items()}
    return {"qids": qids, "left_float": dict(sorted(names.items()))}


def marker_graph(inputs: tuple, samples: Any, context: Any) -> ProgramArtifact:
    """Structure: the site program with one marker per quantizer, numbered as qids (the
    markers of quantizers left float removed)."""
    from graphbuild.frontend.normalize import relabel_markers

    (program, _, _), kept = inputs
    qids = dict(enumerate(kept["qids"]))
    return roundtrip(ProgramArtifact(strip_state(relabel_markers(program.program, qids))))
