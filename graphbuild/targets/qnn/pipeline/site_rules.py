"""A preset's ``layer_overrides`` and LPBQ applied to a placement as values.

``place_quantizers`` places every quantizer the HTP rules ask for, once for all presets, and
records per site the tensor it quantizes, per tensor its modules, whether it is a weight and
the tensor whose encoding it shares, and which weights take LPBQ blocks
(:func:`~graphbuild.targets.qnn.presets.quantizer.placed_tensors`). From that record alone,
:class:`SiteRules` says what PT2E with the overrides applied would have done
(:func:`~graphbuild.targets.qnn.presets.overrides.apply_layer_overrides` before annotating):

- the sites an override to ``"float"`` removes: a site's tensor, or the tensor whose encoding it
  shares, matched by a float override (``left_float`` drops them with the sites calibration
  left float, so only a change of which tensors are float reaches ``to_onnx``);
- each group's rule under a preset: its bit-width as the override gives it, and whether it is an
  LPBQ weight (an LPBQ preset's int4 weight of a linear layer without a bias whose inputs
  divide into blocks).

So a ``layer_overrides`` change reruns values (``left_float``, ``quant_map``, ``qparams``) and
never a trace or a calibration pass (docs/design.md, invariant 13).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graphbuild.targets.qnn.presets.overrides import (
    LayerSetting,
    float_reason,
    match_setting,
    overridden_bits,
    parse_layer_overrides,
)

__all__ = ["SiteRules"]


class SiteRules:
    """``layer_overrides`` (the option's table, or None) over a placement's ``layout``."""

    def __init__(self, layout: Mapping[str, Any], overrides: Mapping[str, str] | None) -> None:
        self.layout = layout
        self.tensors: Mapping[str, Mapping[str, Any]] = layout["tensors"]
        self.lpbq = frozenset(layout["lpbq"])
        settings = parse_layer_overrides(overrides)
        self._rules: dict[tuple[int, str], dict[str, Any]] = {}
        self.matches: dict[str, tuple[str, LayerSetting]] = {}
        if settings:  # every tensor the rules quantize, as PT2E's annotation checks them
            for tensor, about in self.tensors.items():
                found = match_setting(tensor, about["modules"], settings)
                if found is not None:
                    self.matches[tensor] = found

    def _owner(self, tensor: str) -> str:
        return self.tensors[tensor]["group"]

    def floated(self) -> dict[int, str]:
        """Site index -> why, for the sites an override to ``"float"`` removes."""
        out: dict[int, str] = {}
        if not self.matches:
            return out
        for site in self.layout["sites"]:
            tensor = site["settings"]["tensor"]
            for which in (tensor, self._owner(tensor)):
                found = self.matches.get(which)
                if found is not None and found[1].float:
                    out[site["index"]] = float_reason(found[0])
                    break
        return out

    def rule(self, group: int, preset: str) -> dict[str, Any]:
        """The rule of ``group`` under ``preset`` with the overrides applied, and ``lpbq``:
        whether the group is an LPBQ weight."""
        key = (group, preset)
        if key not in self._rules:
            self._rules[key] = self._rule(group, preset)
        return self._rules[key]

    def _rule(self, group: int, preset: str) -> dict[str, Any]:
        from graphbuild.targets.qnn.presets.quantizer import lpbq_block_scale_bits, preset_bits

        settings = self.layout["groups"][group]["settings"]
        rule = dict(settings[preset])
        owner = self._owner(settings["tensor"])
        found = self.matches.get(owner)
        if found is not None and not found[1].float:
            param = bool(self.tensors[owner]["param"])
            rule["bits"] = overridden_bits(rule["bits"], param, found[1], preset_bits(preset))
        lpbq = lpbq_block_scale_bits(preset) is not None
        rule["lpbq"] = lpbq and rule["bits"] == 4 and owner in self.lpbq
        return rule
