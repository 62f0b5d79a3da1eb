"""Fingerprints of torch values: devices, dtypes, sizes, tensors, modules, fx graphs, ops.

A tensor of the model being fingerprinted is structure by name (its values are the state
facet's); a module held as an option is its structure and its values.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from graphbuild.engine.fingerprint import tensors
from graphbuild.engine.fingerprint.structure import structure_fingerprint
from graphbuild.engine.fingerprint.tensors import state_digests
from graphbuild.engine.fingerprint.walk import _ACTIVE, _qualname, _Walk, fingerprint_type


@fingerprint_type.register(torch.device)
def _(value: torch.device, walk: _Walk) -> Any:
    # In a model's structure a device is where the model happens to live: the front end traces
    # on CPU stand-ins with device attributes read as the CPU (frontend/devices.on_cpu), so the
    # same model on any device has one structure key (invariant 10). Elsewhere it is a value.
    return {"torch": "device"} if walk.model else {"torch": str(value)}


@fingerprint_type.register(torch.dtype)
@fingerprint_type.register(torch.qscheme)
@fingerprint_type.register(torch.memory_format)
@fingerprint_type.register(torch.layout)
def _(value: Any, walk: _Walk) -> Any:
    return {"torch": str(value)}


@fingerprint_type.register(torch.Size)
def _(value: torch.Size, walk: _Walk) -> Any:
    return {"size": list(value)}


@fingerprint_type.register(torch.Tensor)
def _(value: torch.Tensor, walk: _Walk) -> Any:
    name = walk.state_names.get(id(value))
    if name is not None:
        return {"state": name, "dtype": str(value.dtype), "shape": list(value.shape)}
    return {
        "tensor": tensors.tensor_digest(value),
        "dtype": str(value.dtype),
        "shape": list(value.shape),
    }


@fingerprint_type.register(weakref.ref)
def _(value: weakref.ref, walk: _Walk) -> Any:
    # a weak reference is a cache of something held elsewhere (nn.LSTM's _flat_weight_refs
    # point to its parameters): what it points to is fingerprinted where it is held
    target = value()
    if target is None:
        return {"weakref": None}
    if isinstance(target, torch.Tensor):
        return {"weakref": "tensor", "dtype": str(target.dtype), "shape": list(target.shape)}
    return {"weakref": walk.child("()", target)}


@fingerprint_type.register(torch.nn.Module)
def _(value: torch.nn.Module, walk: _Walk) -> Any:
    name = walk.module_names.get(id(value))
    if name is not None:  # one of the model's own submodules: by its place in the tree
        return {"submodule": name}
    # A module held as an option (not the pipeline input): its structure and its values.
    if id(value) in _ACTIVE.ids:
        return {"module-cycle": _qualname(type(value))}
    return {"module": structure_fingerprint(value).digest, "state": state_digests(value).digest}


@fingerprint_type.register(torch.fx.Graph)
def _(value: torch.fx.Graph, walk: _Walk) -> Any:
    # node by node, arguments by node name: walking the nodes' own attributes would follow
    # their linked list (and the owning module, which is the model's by name)
    nodes = []
    for i, node in enumerate(value.nodes):
        target = node.target if isinstance(node.target, str) else walk.child(f"[{i}]", node.target)
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _NodeRef(n.name))
        nodes.append([node.name, node.op, target, walk.child(f"[{i}].args", args)])
    return {"fx_graph": nodes, "owner": walk.child("owning_module", value.owning_module)}


@fingerprint_type.register(torch._ops.OpOverload)
@fingerprint_type.register(torch._ops.OpOverloadPacket)
def _(value: Any, walk: _Walk) -> Any:
    return {"op": str(value)}


@dataclass(frozen=True)
class _NodeRef:
    name: str


@fingerprint_type.register(torch.utils.hooks.RemovableHandle)
def _(value: Any, walk: _Walk) -> Any:
    # its id comes from a global counter; the hook it removes is in the module's hook dict
    return {"hook handle": None}
