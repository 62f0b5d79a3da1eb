"""Placing quantizers: the structure half of PT2E quantization (docs/design.md, invariant 13).

Where the quantizers of a PT2E quantizer sit depends on the program and on which tensors the
quantizer quantizes, never on calibration data or weight values. So this step runs
``prepare_pt2e`` on the captured (structure-only) program and stops there: each observer the
quantizer placed becomes a ``graphbuild::q(x, site)`` marker numbered in graph order, and the
result is traced once into a *site program*. Statistics are then collected by running the
site program (``frontend.statistics``); scales and zero points are computed from them by the
target; nothing here ever sees a calibration batch.

Two things ``prepare_pt2e`` does depend on values, and both are kept apart:

- it folds BatchNorm into the convolution (or linear layer) before it: the graph change is
  structure, the folded tensors are values. The placement records which state tensors the
  fold rewrites or creates (``SitePlacement.folded``); :func:`fold_weights` recomputes them from
  the real weights the same way.
- the quantizer's graph rewrites may create tensors of their own (a number an op reads made
  a 0-d constant): they depend on the code only and travel with the placement
  (``SitePlacement.created``), as do the program's lifted constants.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule

from graphbuild.errors import ExportError
from graphbuild.frontend.quantize import check_no_buffer_mutation, load_state, resolve_attr
from graphbuild.quant.markers import MARKER_TARGET, is_marker

__all__ = ["Group", "Site", "SitePlacement", "fold_weights", "place_quantizers"]

#: what a site's marker reads: a parameter or buffer, a lifted constant, a model input, or a
#: tensor the graph computes
SITE_INPUTS = ("state", "constant", "input", "activation")


@dataclass(frozen=True)
class Site:
    """One quantizer position: the marker ``graphbuild::q(x, index)`` of the site program.

    ``group`` is the observer it had (observers shared by several tensors, a Concat's inputs
    and output, share their statistics); ``source`` is the observed node's name in the
    prepared graph (the name calibration reports use); ``input`` one of :data:`SITE_INPUTS`,
    ``tensor`` the state or constant name for the first two; ``settings`` what the target
    said about this site's own observer call (the QNN presets: which tensor it quantizes)."""

    index: int
    group: int
    source: str
    input: str
    tensor: str | None = None
    settings: Any = None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "group": self.group,
            "source": self.source,
            "input": self.input,
            "tensor": self.tensor,
            "settings": self.settings,
        }


@dataclass(frozen=True)
class Group:
    """One observer: per channel along ``axis`` or per tensor (``axis`` None), its ``eps``
    (the smallest scale it allows), and what the target said about it (``settings``)."""

    index: int
    axis: int | None
    eps: float
    settings: Any = None

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "axis": self.axis, "eps": self.eps, "settings": self.settings}


@dataclass
class SitePlacement:
    """The site program (state as the capture left it: placeholders), its sites and groups,
    the state tensors a BatchNorm fold rewrites or creates, and the tensors the placement
    itself created (rewrite constants, lifted constants), by state or constant name."""

    program: ExportedProgram
    sites: list[Site]
    groups: list[Group]
    folded: list[str] = field(default_factory=list)
    created: dict[str, torch.Tensor] = field(default_factory=dict)

    def layout(self) -> dict[str, Any]:
        """Everything but the program and the tensors, as JSON."""
        return {
            "sites": [s.to_json() for s in self.sites],
            "groups": [g.to_json() for g in self.groups],
            "folded": list(self.folded),
        }


#: (quantizer, prepared module) -> per observer module name, what the target records of it
Describe = Callable[[Any, GraphModule], Mapping[str, Any]]


def place_quantizers(
    program: ExportedProgram,
    quantizer: Any,
    sample_args: tuple,
    describe: Describe | None = None,
) -> SitePlacement:
    """Place ``quantizer``'s observers on ``program`` (structure only) and trace the result
    with markers in their place. ``describe`` lets the target record what it needs per
    observer (the QNN presets: each preset's bit-width and symmetry)."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    from graphbuild.frontend.capture import dynamic_shapes_of

    check_no_buffer_mutation(program)
    module = _before_prepare(quantizer, program.module())
    folded = _fold_batch_norms(module)
    prepared = prepare_pt2e(module, quantizer)
    settings = dict(describe(quantizer, prepared)) if describe is not None else {}
    groups, observed = _replace_observers(prepared, settings)
    prepared = _without_dead_code(prepared)
    shapes = dynamic_shapes_of(program)  # dims the capture kept dynamic stay dynamic
    sites_program = torch.export.export(prepared, sample_args, dynamic_shapes=shapes)
    sites = _sites(sites_program, observed)
    known = set(program.state_dict)
    created = {
        name: tensor.detach().clone()
        for name, tensor in sites_program.state_dict.items()
        if name not in known and name not in folded
    }
    created.update({k: v.detach().clone() for k, v in sites_program.constants.items()})
    return SitePlacement(sites_program, sites, groups, folded, created)


def _before_prepare(quantizer: Any, module: GraphModule) -> GraphModule:
    """The quantizer's ``transform_before_prepare``, where it has one: what it rewrites ahead
    of torchao's BatchNorm folding (``quantize`` applies it the same way)."""
    before = getattr(quantizer, "transform_before_prepare", None)
    return before(module) if callable(before) else module


def _fold_batch_norms(module: GraphModule) -> list[str]:
    """Fold BatchNorm into the op before it, as ``prepare_pt2e`` would (it then finds nothing
    left to fold); the names of the state tensors the fold replaced or created."""
    from torchao.quantization.pt2e.utils import _fuse_conv_bn_, _fuse_linear_bn_

    before = _state_objects(module)
    _fuse_conv_bn_(module)
    _fuse_linear_bn_(module)
    after = _state_objects(module)
    return sorted(n for n, t in after.items() if before.get(n) is not t)


def _state_objects(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def fold_weights(
    program: ExportedProgram,
    state: Mapping[str, torch.Tensor],
    folded: list[str],
    quantizer: Any = None,
) -> dict[str, torch.Tensor]:
    """The values of the ``folded`` tensors for the weights in ``state``: the BatchNorm fold
    of :func:`place_quantizers` (after ``quantizer``'s rewrites before it), on the real
    weights (nothing to do without a fold)."""
    if not folded:
        return {}
    module = program.module()
    load_state(module, program, state)
    module = _before_prepare(quantizer, module)
    _fold_batch_norms(module)
    out = {}
    for name in folded:
        value = resolve_attr(module, name)
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"the BatchNorm fold left no tensor '{name}'")
        out[name] = value.detach()
    return out


def _replace_observers(
    prepared: GraphModule, settings: Mapping[str, Any]
) -> tuple[list[Group], dict[int, tuple[int, str, Any]]]:
    """Every observer call becomes a marker numbered in graph order; returns the groups (one
    per observer module) and, per site, (group, observed node name, the target's settings of
    its observer call)."""
    from torchao.quantization.pt2e.observer import ObserverBase

    modules = dict(prepared.named_modules(remove_duplicate=False))
    group_of: dict[int, int] = {}  # by observer object: a shared one has several names
    groups: list[Group] = []
    observed: dict[int, tuple[int, str, Any]] = {}
    for node in list(prepared.graph.nodes):
        if node.op != "call_module" or not isinstance(modules.get(node.target), ObserverBase):
            continue
        observer = modules[node.target]
        name = str(node.target)
        if id(observer) not in group_of:
            group_of[id(observer)] = len(groups)
            groups.append(_group(len(groups), observer, settings.get(name)))
        source = node.args[0]
        if not isinstance(source, torch.fx.Node):
            raise ExportError(f"observer '{name}' observes no tensor")
        site = len(observed)
        with prepared.graph.inserting_before(node):
            marker = prepared.graph.call_function(MARKER_TARGET, (source, site))
        node.replace_all_uses_with(marker)
        prepared.graph.erase_node(node)
        observed[site] = (group_of[id(observer)], source.name, settings.get(name))
    return groups, observed


def _without_dead_code(prepared: GraphModule) -> GraphModule:
    """The module as ``convert_pt2e`` leaves it: dead code gone, and with it every attribute
    nothing reads any more (an observer, a weight whose reader now reads its tied twin)."""
    meta = dict(prepared.meta)
    prepared.graph.eliminate_dead_code()
    module = GraphModule(prepared, prepared.graph)
    module.delete_all_unused_submodules()
    module.meta.update(meta)
    module.meta.pop("_observed_graph_module_attrs", None)
    return module


def _group(index: int, observer: Any, settings: Any) -> Group:
    axis = getattr(observer, "ch_axis", None)
    per_channel = getattr(observer, "qscheme", None) in (
        torch.per_channel_affine,
        torch.per_channel_symmetric,
    )
    eps = getattr(observer, "eps", None)
    eps_value = (
        float(eps) if isinstance(eps, torch.Tensor) else float(torch.finfo(torch.float32).eps)
    )
    return Group(index, int(axis) if per_channel else None, eps_value, settings)


def _sites(program: ExportedProgram, observed: Mapping[int, tuple[int, str, Any]]) -> list[Site]:
    """The sites as the traced program has them: what each marker reads."""
    specs = {s.arg.name: s for s in program.graph_signature.input_specs if hasattr(s.arg, "name")}
    sites: dict[int, Site] = {}
    for node in program.graph.nodes:
        if not is_marker(node):
            continue
        index = int(node.args[1])
        x = node.args[0]
        if index not in observed or index in sites or not isinstance(x, torch.fx.Node):
            raise ExportError(f"the traced placement has an unexpected marker '{node.name}'")
        group, source, about = observed[index]
        spec = specs.get(x.name) if x.op == "placeholder" else None
        if spec is None:
            sites[index] = Site(index, group, source, "activation", settings=about)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            sites[index] = Site(index, group, source, "state", spec.target, about)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            sites[index] = Site(index, group, source, "constant", spec.target, about)
        else:
            sites[index] = Site(index, group, source, "input", settings=about)
    if sorted(sites) != list(range(len(observed))):
        missing = sorted(set(range(len(observed))) - set(sites))
        raise ExportError(f"tracing the placement lost quantizer site(s) {missing}")
    return [sites[i] for i in range(len(observed))]
