"""Per-layer overrides of a QNN preset: other bit-widths, or float, for the modules a pattern
matches.

``layer_overrides = {"blocks.*.mlp.*" = "w4", "lm_head" = "float"}`` (the qnn option, a table
of module pattern -> setting) is applied by the preset *after* the HTP rules
(:func:`graphbuild.targets.qnn.rules.plan.plan`) have placed every quantizer, so an override changes
what a quantizer does, never where quantizers sit:

- ``"float"``: the tensors of the matched modules (their weights, and the outputs of the ops
  they run) stay float;
- ``"w4"``, ``"w8"``: their weights get that many bits where the preset's weight bit-width
  applies (Conv, ConvTranspose, Gemm and MatMul weights; LayerNorm weights keep their 8 bits);
- ``"a8"``, ``"a16"``: their activations get that many bits where the preset's activation
  bit-width applies (fixed-range outputs such as Softmax keep their ranges);
- both at once, ``"w4a16"``, or a preset's name.

A pattern is an ``fnmatch`` pattern over module paths as ``named_modules`` gives them
(``blocks.0.attn.q_proj``; ``*`` crosses dots). A tensor belongs to the module of the op that
produces it; a weight or another constant to the modules of the ops that read it. A tensor
that two patterns with different settings match is an error naming both: the result never
depends on the order the table was written in. A tensor that shares another's encoding (a
Relu's output, a Concat's inputs) follows that tensor, as HTP requires.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from graphbuild.errors import ConfigError
from graphbuild.targets.qnn.rules.plan import GraphView, OpNode, Plan

if TYPE_CHECKING:
    import onnx

__all__ = [
    "LayerSetting",
    "apply_layer_overrides",
    "float_reason",
    "match_setting",
    "module_path",
    "onnx_tensor_modules",
    "overridden_bits",
    "parse_layer_overrides",
    "tensor_modules",
]

_SETTING = re.compile(r"^(?:w(?P<w>\d+))?(?:a(?P<a>\d+))?$")
_SCOPES = "pkg.torch.onnx.name_scopes"  # the exporter's module path of each node
WEIGHT_BITS = (4, 8)
ACTIVATION_BITS = (8, 16)


@dataclass(frozen=True)
class LayerSetting:
    """What an override gives the matched modules: float, or other weight and/or activation
    bit-widths (None: the preset's)."""

    text: str
    float: bool = False
    weight_bits: int | None = None
    activation_bits: int | None = None


def parse_layer_setting(pattern: str, text: Any) -> LayerSetting:
    """A setting as written in ``layer_overrides``; a ConfigError naming the pattern."""
    if not isinstance(text, str):
        raise ConfigError(f"layer_overrides['{pattern}'] must be a string, not {text!r}")
    word = text.strip().lower()
    if word == "float":
        return LayerSetting(word, float=True)
    match = _SETTING.match(word)
    if not word or match is None:
        raise ConfigError(
            f"layer_overrides['{pattern}'] = {text!r}: expected 'float', 'w4', 'w8', 'a8', "
            "'a16' or both ('w4a16')"
        )
    w = int(match.group("w")) if match.group("w") else None
    a = int(match.group("a")) if match.group("a") else None
    if w is not None and w not in WEIGHT_BITS:
        raise ConfigError(f"layer_overrides['{pattern}']: weights take 4 or 8 bits, not {w}")
    if a is not None and a not in ACTIVATION_BITS:
        raise ConfigError(f"layer_overrides['{pattern}']: activations take 8 or 16 bits, not {a}")
    return LayerSetting(word, weight_bits=w, activation_bits=a)


def parse_layer_overrides(table: Mapping[str, Any] | None) -> dict[str, LayerSetting]:
    """Every entry of a ``layer_overrides`` table, checked."""
    if table is None:
        return {}
    if not isinstance(table, Mapping):
        raise ConfigError(f"layer_overrides must be a table of pattern = setting, not {table!r}")
    out = {}
    for pattern, text in table.items():
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"layer_overrides: {pattern!r} is not a module pattern")
        out[pattern] = parse_layer_setting(pattern, text)
    return out


def module_path(node: Any) -> str:
    """The path (as ``named_modules`` gives it) of the innermost module an fx node ran in;
    ``""`` for the model itself."""
    stack = getattr(node, "meta", {}).get("nn_module_stack") if node is not None else None
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    path = re.sub(r"^L\['self'\]\.?|^L__self__\.?", "", path)
    return re.sub(r"\[(\d+)\]", r".\1", path)


def tensor_modules(view: Any) -> dict[str, set[str]]:
    """Tensor -> the module paths it belongs to, for an
    :class:`~graphbuild.targets.qnn.rules.aten_view.AtenView` (the preset's view of the aten
    graph)."""
    return _modules(view.view, lambda op: module_path(view.nodes.get(op.name)))


def onnx_tensor_modules(model: onnx.ModelProto, view: GraphView) -> dict[str, set[str]]:
    """Tensor -> the module paths it belongs to, for the view of an exported ONNX model (the
    coverage report's), from the exporter's ``name_scopes`` metadata on each node."""
    paths = {}
    for node in model.graph.node:
        scopes = next((p.value for p in node.metadata_props if p.key == _SCOPES), "")
        try:
            names = ast.literal_eval(scopes) if scopes else []
        except (ValueError, SyntaxError):
            names = []
        path = str(names[-2]) if isinstance(names, list) and len(names) >= 2 else ""
        paths[node.name or (node.output[0] if node.output else "")] = path
    return _modules(view, lambda op: paths.get(op.name, ""))


def _modules(graph: GraphView, path_of: Callable[[OpNode], str]) -> dict[str, set[str]]:
    """The module of the op that produces each tensor; for a constant and a model input,
    those of its readers (and the model itself for an input)."""
    out: dict[str, set[str]] = defaultdict(set)
    inputs = set(graph.inputs)
    for tensor in inputs:
        out[tensor].add("")
    for op in graph.ops:
        path = path_of(op)
        for tensor in op.outputs:
            out[tensor].add(path)
        for tensor in op.inputs:
            if tensor is not None and (tensor in graph.constants or tensor in inputs):
                out[tensor].add(path)
    return out


def apply_layer_overrides(
    rules: Plan,
    modules: Mapping[str, set[str]],
    overrides: Mapping[str, LayerSetting],
    preset_bits: tuple[int, int],
) -> tuple[Plan, dict[str, str], dict[str, str]]:
    """``rules`` with ``overrides`` applied: the new plan, the tensors left float (name ->
    why) and the tensors given other bits (name -> which override)."""
    out = dict(rules.rules)
    floated: dict[str, str] = {}
    changed: dict[str, str] = {}
    for tensor, rule in rules.rules.items():
        if not rule.quantized:
            continue
        found = match_setting(tensor, modules.get(tensor, ()), overrides)
        if found is None:
            continue
        pattern, setting = found
        if setting.float:
            why = float_reason(pattern)
            out[tensor] = replace(rule, quantized=False, why=why)
            floated[tensor] = why
            continue
        bits = overridden_bits(rule.bits, rule.param, setting, preset_bits)
        if bits != rule.bits:
            out[tensor] = replace(rule, bits=bits)
            changed[tensor] = f"layer override '{pattern}': {setting.text}"
    return Plan(out, rules.producers), floated, changed


def match_setting(
    tensor: str, modules: Iterable[str], overrides: Mapping[str, LayerSetting]
) -> tuple[str, LayerSetting] | None:
    """The (pattern, setting) of ``overrides`` that matches a tensor of ``modules``, or None;
    a ConfigError naming both when two patterns with different settings match it."""
    paths = sorted(modules)
    matched = {
        pattern: setting
        for pattern, setting in overrides.items()
        if any(fnmatch.fnmatchcase(m, pattern) for m in paths)
    }
    if not matched:
        return None
    if len({s.text for s in matched.values()}) > 1:
        shown = ", ".join(f"'{p}' = {s.text!r}" for p, s in sorted(matched.items()))
        raise ConfigError(
            f"layer_overrides: tensor '{tensor}' (module {', '.join(paths)}) is matched by "
            f"{shown}; make the patterns not overlap or give them the same setting"
        )
    return next(iter(sorted(matched.items())))


def float_reason(pattern: str) -> str:
    """Why a tensor an override leaves float is float."""
    return f"layer override '{pattern}': float"


def overridden_bits(
    bits: int, param: bool, setting: LayerSetting, preset_bits: tuple[int, int]
) -> int:
    """A quantizer's bit-width under ``setting``: a weight's where it has the preset's weight
    bit-width, an activation's where it has the preset's activation bit-width (LayerNorm
    weights' 8 bits and fixed ranges keep theirs)."""
    weight_bits, activation_bits = preset_bits
    if param and setting.weight_bits is not None and bits == weight_bits:
        return setting.weight_bits
    if not param and setting.activation_bits is not None and bits == activation_bits:
        return setting.activation_bits
    return bits
