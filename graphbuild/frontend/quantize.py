"""The quantize stage: torchao PT2E post-training quantization of a captured program.

The captured program is structure only (its state may be zero-stride placeholders), so the real
weights come in through ``state``. Conversion uses ``fold_quantize=False``: weights stay float
state followed by quantize/dequantize ops, which the normalize stage turns into markers like any
other quantizer.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer import Quantizer

from graphbuild.errors import BufferMutationError, ConfigError, ExportError
from graphbuild.frontend.capture import dynamic_shapes_of
from graphbuild.frontend.devices import HostState, to_device
from graphbuild.frontend.presets import QUANTIZER_PRESETS, register_preset

__all__ = [
    "QUANTIZER_PRESETS",
    "Quantized",
    "check_no_buffer_mutation",
    "load_state",
    "mutated_buffers",
    "quantize",
    "quantize_program",
    "register_preset",
    "resolve_attr",
    "resolve_quantizer",
]


def resolve_attr(model: torch.nn.Module, target: str) -> object:
    """The object a dotted attribute path (a get_attr target) names, or None."""
    obj: object = model
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def check_no_buffer_mutation(program: torch.export.ExportedProgram) -> None:
    """Refuse a program whose ``forward`` writes to buffers: PT2E calibration would run it on
    the model's own buffers, and its observers would see a buffer's update as an activation.
    Both quantization paths, the one-stage :func:`quantize` and the split
    ``place_quantizers``, call this first, so the model is never run and the error names the
    buffers and what to do."""
    mutated = mutated_buffers(program)
    if mutated:
        raise BufferMutationError(mutated)


def mutated_buffers(program: torch.export.ExportedProgram) -> tuple[str, ...]:
    """The buffers ``program`` writes to, by state name, in graph order. A functional program
    lists them in its signature; the one ``torch.export`` captures keeps the in-place ops
    (``add_``, ``copy_``) on the buffer's placeholder, or on a view of it."""
    signature = program.graph_signature
    buffers = {
        spec.arg.name: spec.target
        for spec in signature.input_specs
        if spec.kind == InputKind.BUFFER and spec.target is not None
    }
    found = list(signature.buffers_to_mutate.values())
    for node in program.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for value, arg in _schema_args(node):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            if isinstance(value, torch.fx.Node) and _alias_root(value).name in buffers:
                found.append(buffers[_alias_root(value).name])
    return tuple(dict.fromkeys(found))


def _schema_args(node: torch.fx.Node) -> Iterator[tuple[Any, Any]]:
    """(value, schema argument) for each argument of an ATen op call."""
    for index, arg in enumerate(node.target._schema.arguments):
        if index < len(node.args):
            yield node.args[index], arg
        elif arg.name in node.kwargs:
            yield node.kwargs[arg.name], arg


def _alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage ``node`` shares: through views and in-place ops (an op whose
    result aliases an argument) back to a placeholder or a node that made a new tensor."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        alias = returns[0].alias_info if returns else None
        if alias is None:
            break
        source = next(
            (
                value
                for value, arg in _schema_args(node)
                if isinstance(value, torch.fx.Node)
                and arg.alias_info is not None
                and arg.alias_info.before_set & alias.before_set
            ),
            None,
        )
        if source is None:
            break
        node = source
    return node


@dataclass(frozen=True)
class Quantized:
    """A quantized program, and the tensors whose quantizer calibration had to drop (node
    name -> why): they stay float, and the export's coverage report names them."""

    program: torch.export.ExportedProgram
    left_float: Mapping[str, str] = field(default_factory=dict)
    #: activations whose calibrated range spans only a few steps of the smallest scale
    #: (node name -> [min, max]): quantized, but to a handful of values
    degenerate: Mapping[str, tuple[float, float]] = field(default_factory=dict)


def quantize_program(
    program: torch.export.ExportedProgram,
    state: Mapping[str, torch.Tensor],
    quantizer: str | Quantizer,
    calibration: Iterable,
    sample_inputs: tuple,
    *,
    fold_quantize: bool = False,
) -> torch.export.ExportedProgram:
    """:func:`quantize` that fails on a quantizer that saw non-finite values."""
    return quantize(
        program, state, quantizer, calibration, sample_inputs, fold_quantize=fold_quantize
    ).program


def quantize(
    program: torch.export.ExportedProgram,
    state: Mapping[str, torch.Tensor],
    quantizer: str | Quantizer,
    calibration: Iterable,
    sample_inputs: tuple,
    *,
    fold_quantize: bool = False,
    drop_non_finite: bool = False,
) -> Quantized:
    """Quantize ``program`` with real weights from ``state``; return the re-exported program.

    ``quantizer`` is a preset name (see ``QUANTIZER_PRESETS``) or any torchao
    ``Quantizer``. Each calibration batch is a tuple of positional args or a single tensor; an
    empty calibration falls back to ``sample_inputs`` once, with a warning. The result holds
    ``quantized_decomposed`` quantize/dequantize ops around every quantized tensor; with
    ``fold_quantize`` the weights are stored quantized (integer constants followed by a
    dequantize), as back ends that consume integer weights (ExecuTorch) expect.

    A quantizer with a ``transform_before_prepare(module)`` method has it applied first (torchao
    folds BatchNorm into convolutions before ``transform_for_annotation``, and refuses a
    convolution whose bias is computed).

    An activation quantizer that saw ``inf`` or ``nan`` (an additive ``-inf`` attention mask)
    has no valid scale: an :class:`ExportError`, or with ``drop_non_finite`` the tensor stays
    float and is listed in ``left_float``.

    Everything runs on the CPU: ``state`` tensors and calibration batches on another device
    are copied to host memory (see ``devices``), so the result does not depend on where the
    model lives.
    """
    check_no_buffer_mutation(program)
    resolved = resolve_quantizer(quantizer)
    sample_inputs = to_device(tuple(sample_inputs), "cpu")
    module = program.module()
    load_state(module, program, HostState(state))
    before = getattr(resolved, "transform_before_prepare", None)
    if callable(before):  # ahead of torchao's conv-BatchNorm folding, which prepare starts with
        module = before(module)
    prepared = prepare_pt2e(module, resolved)
    _calibrate(prepared, calibration, sample_inputs)
    degenerate = _degenerate_ranges(prepared)
    left_float = _check_observed_ranges(prepared, drop=drop_non_finite)
    converted = convert_pt2e(prepared, fold_quantize=fold_quantize)
    shapes = dynamic_shapes_of(program)  # dims the capture kept dynamic stay dynamic
    program = torch.export.export(converted, sample_inputs, dynamic_shapes=shapes)
    return Quantized(program, left_float, degenerate)


def resolve_quantizer(quantizer: str | Quantizer) -> Quantizer:
    """A torchao Quantizer from a preset name or an instance; anything else is a ConfigError."""
    if isinstance(quantizer, str):
        if quantizer not in QUANTIZER_PRESETS:
            known = ", ".join(QUANTIZER_PRESETS)
            raise ConfigError(f"unknown quantizer preset {quantizer!r}; known presets: {known}")
        return QUANTIZER_PRESETS[quantizer]()
    if isinstance(quantizer, Quantizer):
        return quantizer
    raise ConfigError(
        f"quantizer must be a preset name ({', '.join(QUANTIZER_PRESETS)}) or a "
        f"torchao.quantization.pt2e.quantizer.Quantizer instance, got {type(quantizer).__name__}"
    )


# ---------------------------------------------------------------------------------------------
# State loading


def load_state(
    module: GraphModule,
    program: torch.export.ExportedProgram,
    state: Mapping[str, torch.Tensor],
) -> None:
    """Put the real tensors of ``state`` into ``module`` (from ``program.module()``), in place.

    Names are the program's state_dict / constants FQNs. A name that aliases others in the
    module (tied weights) sets every alias, so tied tensors may appear once or under each name.
    Every state_dict entry and every placeholder constant must end up loaded; names in
    ``state`` that the program does not hold are ignored.
    """
    targets = _tensor_slots(module, [*program.state_dict, *program.constants])
    aliases = _alias_groups(targets)
    loaded: set[str] = set()
    for name, value in state.items():
        if name not in targets:
            continue
        _check_compatible(name, targets[name], value)
        for alias in aliases[id(targets[name])]:
            _set_tensor(module, alias, value)
            loaded.add(alias)
    _check_all_loaded(program, targets, loaded)


def _tensor_slots(module: GraphModule, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``module`` holds under ``names`` (names it does not hold are left out)."""
    slots: dict[str, torch.Tensor] = {}
    for name in names:
        value = resolve_attr(module, name)
        if isinstance(value, torch.Tensor):
            slots[name] = value
    return slots


def _alias_groups(targets: Mapping[str, torch.Tensor]) -> dict[int, list[str]]:
    """Names grouped by the identity of the tensor object they hold (ties share one object)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        groups.setdefault(id(tensor), []).append(name)
    return groups


def _set_tensor(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace the parameter, buffer or plain tensor attribute ``name`` with ``value``."""
    parent_name, _, leaf = name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    value = value.detach()
    if leaf in parent._parameters:
        parent._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    elif leaf in parent._buffers:
        parent._buffers[leaf] = value
    else:
        setattr(parent, leaf, value)


def _check_compatible(name: str, current: torch.Tensor, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise ExportError(f"state '{name}' is a {type(value).__name__}, not a tensor")
    if value.shape != current.shape or value.dtype != current.dtype:
        raise ExportError(
            f"state '{name}' has shape {tuple(value.shape)} and dtype {value.dtype}; the program "
            f"expects {tuple(current.shape)} and {current.dtype}"
        )


def _is_placeholder(tensor: torch.Tensor) -> bool:
    """A zero-stride dummy standing in for a tensor the capture stage did not store."""
    return tensor.numel() > 1 and 0 in tensor.stride()


def _check_all_loaded(
    program: torch.export.ExportedProgram,
    targets: Mapping[str, torch.Tensor],
    loaded: set[str],
) -> None:
    """Every state_dict entry and every placeholder constant must have been loaded."""
    missing = [
        name
        for name, tensor in targets.items()
        if name not in loaded and (name in program.state_dict or _is_placeholder(tensor))
    ]
    if missing:
        shown = ", ".join(sorted(missing)[:8]) + (" ..." if len(missing) > 8 else "")
        raise ExportError(
            f"state lacks {len(missing)} tensor(s) the program needs: {shown}. Pass the full "
            "state (model.state_dict() plus non-persistent buffers); tied weights must either "
            "share one tensor in the program or appear under every name."
        )


# ---------------------------------------------------------------------------------------------
# Calibration


def _calibrate(prepared: GraphModule, calibration: Iterable, sample_inputs: tuple) -> None:
    """Run every calibration batch through the observed model (sample inputs when none)."""
    ran = 0
    with torch.no_grad():
        for batch in _batches(calibration):
            prepared(*batch)
            ran += 1
        if ran == 0:
            warnings.warn(
                "quantize: no calibration batches; calibrating on the sample inputs once",
                stacklevel=3,
            )
            prepared(*tuple(sample_inputs))


def _batches(calibration: Iterable) -> Iterator[tuple]:
    """Positional-argument tuples on the CPU from batches that are tuples, lists or single
    values, on any device."""
    for batch in calibration:
        args = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        yield to_device(args, "cpu")


#: a calibrated range narrower than this many of the observer's smallest steps has collapsed
DEGENERATE_STEPS = 16


def _degenerate_ranges(prepared: GraphModule) -> dict[str, tuple[float, float]]:
    """Activation observers (not constants, not weights) whose finite range spans fewer than
    ``DEGENERATE_STEPS`` steps of the smallest scale they may use: every value lands on a
    handful of grid points (vanishing activations of a random-init network)."""
    out: dict[str, tuple[float, float]] = {}
    for node in prepared.graph.nodes:
        if node.op != "call_module" or not node.args:
            continue
        source = node.args[0]
        if not isinstance(source, torch.fx.Node) or source.op not in (
            "call_function",
            "placeholder",
        ):
            continue
        observer = prepared.get_submodule(node.target)
        low, high = getattr(observer, "min_val", None), getattr(observer, "max_val", None)
        eps = getattr(observer, "eps", None)
        if not all(isinstance(t, torch.Tensor) for t in (low, high, eps)) or low.numel() != 1:
            continue
        lo, hi = float(torch.clamp(low, max=0.0)), float(torch.clamp(high, min=0.0))
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
            continue
        if 0.0 < hi - lo < DEGENERATE_STEPS * float(eps):  # exact zeros lose nothing
            out[source.name] = (float(low), float(high))
    return out


def _check_observed_ranges(prepared: GraphModule, *, drop: bool = False) -> dict[str, str]:
    """Fail on an observer that saw inf or nan: its scale would be meaningless. With ``drop``
    a per-tensor observer that saw ``inf`` leaves its tensor float instead (every place the
    observer was shared with); returns those tensors (node name -> why). NaN anywhere, and a
    per-channel weight's ``inf``, are errors naming the tensors.

    The usual cause is an additive ``-inf`` attention mask flowing into a quantized op.
    """
    bad: dict[int, list[torch.fx.Node]] = {}
    nan: list[str] = []
    for node in prepared.graph.nodes:
        if node.op != "call_module":
            continue
        observer = prepared.get_submodule(node.target)
        low, high = getattr(observer, "min_val", None), getattr(observer, "max_val", None)
        if not (isinstance(low, torch.Tensor) and isinstance(high, torch.Tensor)):
            continue
        untouched = (low == float("inf")) & (high == float("-inf"))
        if not bool((~untouched & ~(torch.isfinite(low) & torch.isfinite(high))).any()):
            continue
        source = node.args[0]
        name = source.name if isinstance(source, torch.fx.Node) else node.name
        if bool((low.isnan() | high.isnan()).any()):
            nan.append(name)
            continue
        per_channel = getattr(observer, "qscheme", None) in (
            torch.per_channel_affine,
            torch.per_channel_symmetric,
        )
        if not drop or per_channel:
            raise ExportError(
                f"quantize: the values observed at '{name}' are not finite "
                f"(min {low.min().item()}, max {high.max().item()}); a quantizer there would have "
                "no valid scale. Use a finite attention mask or keep that op in float."
            )
        bad.setdefault(id(observer), []).append(node)
    if nan:
        shown = ", ".join(f"'{n}'" for n in nan[:8]) + (" ..." if len(nan) > 8 else "")
        raise ExportError(
            f"quantize: calibration saw NaN at {shown}: no range fits. Check the calibration "
            "batches and the model (a 0/0, a log of a negative number) before quantizing."
        )
    dropped: dict[str, str] = {}
    for nodes in bad.values():
        for node in nodes:
            source = node.args[0]
            dropped[source.name] = (
                "calibration saw non-finite values (an additive -inf mask?): no scale fits"
            )
            node.replace_all_uses_with(source)
            prepared.graph.erase_node(node)
    if dropped:
        prepared.graph.lint()
        prepared.recompile()
    return dropped
