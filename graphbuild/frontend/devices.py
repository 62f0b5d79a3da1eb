"""Models on any device: graphbuild traces and quantizes on the CPU, never mixing devices.

A model being tuned usually lives on a GPU. Its exported graph must not: the ONNX file, the
cache keys and every artifact are the same whether the model sat on ``cuda``, ``mps`` or the
CPU, so a cache filled on a workstation serves a GPU box and the other way round. So:

- ``capture`` traces a CPU stand-in of the model: parameters become uninitialised CPU tensors
  of the same shape, dtype and strides (tracing reads no parameter values and the captured
  program stores none, so nothing is copied and no memory is touched), buffers and tensor
  attributes (held directly or in lists, tuples and dicts) become CPU copies (their values are
  lifted into the program as constants), ``torch.device`` attributes read as the CPU, and the
  sample inputs are copied to the CPU. The user's model is restored before capture returns.
  Where a model keeps its tensors is therefore not part of its structure: the structure
  fingerprint records a ``torch.device`` attribute without its device type.
- ``quantize`` calibrates on the CPU: weights are copied to host memory once per stage run (the
  ONNX file needs them there anyway) and calibration batches are moved as they come.
- Stages that read the model's values get them through ``HostState``: one host copy per tensor,
  made when it is read.
- The reference outputs of the numerics check come from the model on its own device, with
  float32 at full precision (no TF32 matmuls or convolutions, which CUDA enables by default).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "HostState",
    "host_copy",
    "host_state",
    "model_device",
    "model_tensors",
    "on_cpu",
    "to_device",
]


def to_device(tree: Any, device: torch.device | str) -> Any:
    """``tree`` (nested tuples, lists, dicts) with every tensor moved to ``device``; tensors
    already there are returned as they are, not copied."""
    return torch.utils._pytree.tree_map(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, tree
    )


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer; the CPU for a model without state."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


class HostState(Mapping[str, torch.Tensor]):
    """A read-only view of a name -> tensor mapping whose values are on the CPU.

    A tensor off the CPU is copied to host memory when it is read, so a stage that walks the
    weights one by one holds one host copy at a time, not a copy of the whole model.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._tensors[name]
        return tensor if tensor.device.type == "cpu" else tensor.detach().cpu()

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by name (tied ones under every name), where they
    live."""
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    return state


def host_state(model: torch.nn.Module) -> HostState:
    """The model's parameters and buffers by name, read as CPU tensors."""
    return HostState(model_tensors(model))


def host_copy(model: torch.nn.Module, values: bool = True) -> torch.nn.Module:
    """A copy of ``model``'s module tree for a stage to transform (torchao's ``quantize_``
    rebinds parameters), whose parameters and buffers are CPU tensors: the model's own memory
    where it is on the CPU (a transform replaces tensors, it does not write into them), a host
    copy otherwise. With ``values=False`` the parameters are zeros of the same shape and dtype
    (for tracing, which reads no parameter values); buffers keep their values, since a traced
    program keeps those of non-persistent buffers as constants. Tied tensors stay tied."""
    memo: dict[int, Any] = {}
    params = {id(p) for p in model.parameters()}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in memo:
            continue
        if not values and id(tensor) in params:
            host = torch.zeros(tensor.shape, dtype=tensor.dtype)
        else:
            host = tensor.detach() if tensor.device.type == "cpu" else tensor.detach().cpu()
        if isinstance(tensor, torch.nn.Parameter):
            host = torch.nn.Parameter(host, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = host
    return copy.deepcopy(model, memo)


#: A module's own tables of parameters, buffers and children: on_cpu swaps their entries one
#: by one, never the table.
_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})

_CPU = torch.device("cpu")


@contextmanager
def on_cpu(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, ``model``'s state off the CPU is replaced by CPU stand-ins (see the
    module docstring); on exit every original is put back, whatever happened.

    Parameters, buffers and tensor attributes are swapped, and so are tensors inside a list,
    tuple or dict attribute (an LSTM's ``_flat_weights``, a table of masks): the container is
    replaced by a copy holding the stand-ins. A ``torch.device`` attribute off the CPU (a
    module that makes tensors ``device=self.device`` in ``forward``) reads as the CPU, so the
    program is the CPU model's. Tied tensors (one object under several names or in a
    container too) get one stand-in, so ties survive tracing. A model with nothing off the
    CPU is left untouched.
    """
    stand_ins: dict[int, Any] = {}
    undo: list[tuple[dict[str, Any], str, Any]] = []

    def stand_in(original: Any, make: Any) -> Any:
        if id(original) not in stand_ins:
            stand_ins[id(original)] = make(original)
        return stand_ins[id(original)]

    def swap(store: dict[str, Any], name: str, value: Any) -> None:
        undo.append((store, name, store[name]))
        store[name] = value

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return stand_in(value, _host_copy)
        if isinstance(value, torch.device) and value.type != "cpu":
            return _CPU
        return value

    try:
        modules = list(model.modules())
        for module in modules:  # parameters and buffers first: containers may hold them too
            for name, param in list(module._parameters.items()):
                if param is not None and param.device.type != "cpu":
                    swap(module._parameters, name, stand_in(param, _parameter_stand_in))
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.device.type != "cpu":
                    swap(module._buffers, name, stand_in(buffer, _host_copy))
        for module in modules:
            attrs = vars(module)
            for name, value in list(attrs.items()):
                if name in _MODULE_TABLES:
                    continue
                leaves, spec = torch.utils._pytree.tree_flatten(value)
                swapped = [leaf(v) for v in leaves]
                if any(new is not old for new, old in zip(swapped, leaves, strict=True)):
                    swap(attrs, name, torch.utils._pytree.tree_unflatten(swapped, spec))
        yield model
    finally:
        for store, name, original in reversed(undo):
            store[name] = original


def _parameter_stand_in(param: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_strided(param.size(), param.stride(), dtype=param.dtype)
    if isinstance(param, torch.nn.Parameter):
        return torch.nn.Parameter(empty, requires_grad=param.requires_grad)
    return empty


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    copy = tensor.detach().cpu()
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
    return copy
