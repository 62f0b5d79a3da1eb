"""The structure facet: a module tree's classes, attributes, hooks and tensor names, as digests.

One digest per submodule, so ``explain`` can say which one changed; tensors are structure by
name, shape and dtype only (their values are the state facet's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphbuild.engine.fingerprint.code import code_fingerprint
from graphbuild.engine.fingerprint.walk import (
    _ACTIVE,
    _TREE,
    _qualname,
    _Walk,
    volatile_attributes,
)
from graphbuild.hashing import digest_json


@dataclass(frozen=True)
class StructureFingerprint:
    """Digest of the module tree, attributes and code; ``modules`` keeps one digest per
    submodule so ``explain`` can say which one changed."""

    digest: str
    modules: dict[str, str]
    code: dict[str, str]


_SKIP_ATTRS = {
    "_parameters",
    "_buffers",
    "_modules",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_compiled_call_impl",
}


def _hooks(module: torch.nn.Module, walk: _Walk) -> tuple[dict[str, Any], set[str]]:
    """A module's hooks (``_forward_hooks`` ...) as ordered lists of callables, each with the
    flags its companion dicts (``_forward_hooks_with_kwargs`` ...) give it: the dicts are keyed
    by handle ids from a global counter, which depend on everything registered before.
    Returns the forms of the non-empty hook dicts and the names of all hook attributes."""
    state = vars(module)
    hook_dicts = [k for k, v in state.items() if k.endswith("hooks") and isinstance(v, dict)]
    flags = {
        k: v
        for k, v in state.items()
        if isinstance(v, dict) and any(k.startswith(h + "_") for h in hook_dicts)
    }
    forms: dict[str, Any] = {}
    for name in hook_dicts:
        if name in _SKIP_ATTRS or not state[name]:
            continue
        marks = {f[len(name) + 1 :]: d for f, d in flags.items() if f.startswith(name + "_")}
        forms[name] = [
            [walk.child(f"{name}[{i}]", hook), sorted(m for m, d in marks.items() if handle in d)]
            for i, (handle, hook) in enumerate(state[name].items())
        ]
    return forms, {*hook_dicts, *flags}


def structure_fingerprint(module: torch.nn.Module) -> StructureFingerprint:
    """Class, non-tensor attributes, parameter/buffer names, shapes and dtypes of every
    submodule, plus the code of their classes. Raises FingerprintError naming the attribute
    that cannot be fingerprinted."""
    _ACTIVE.ids.add(id(module))
    try:
        return _structure_fingerprint(module)
    finally:
        _ACTIVE.ids.discard(id(module))


def _structure_fingerprint(module: torch.nn.Module) -> StructureFingerprint:
    state_names: dict[int, str] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False)] + [
        *module.named_buffers(remove_duplicate=False)
    ]:
        state_names.setdefault(id(t), name)
    module_names: dict[int, str] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        module_names.setdefault(id(sub), name or "<root>")
    outer = _TREE.current
    _TREE.current = (state_names, module_names, True)
    try:
        return _tree_fingerprint(module, state_names, module_names)
    finally:
        _TREE.current = outer


def _tree_fingerprint(
    module: torch.nn.Module, state_names: dict[int, str], module_names: dict[int, str]
) -> StructureFingerprint:
    classes: list[type] = []
    modules: dict[str, str] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        classes.append(type(sub))
        walk = _Walk(state_names, module_names, model=True)
        walk.path.append(name or "<root>")
        skip = volatile_attributes(type(sub))
        hooks, hook_attrs = _hooks(sub, walk)
        attrs = {}
        for k, v in sorted(vars(sub).items()):
            if k in _SKIP_ATTRS or k in skip or k in hook_attrs:
                continue
            attrs[k] = walk.child(k, v)
        attrs.update(hooks)
        entry = {
            "class": _qualname(type(sub)),
            "attrs": attrs,
            "params": [
                [n, str(p.dtype), list(p.shape), p.requires_grad]
                for n, p in sub._parameters.items()
                if p is not None
            ],
            "buffers": [
                [n, str(b.dtype), list(b.shape), n in sub._non_persistent_buffers_set]
                for n, b in sub._buffers.items()
                if b is not None
            ],
            "children": list(sub._modules),
        }
        modules[name] = digest_json(entry)
    code = code_fingerprint(classes)
    return StructureFingerprint(digest_json([sorted(modules.items()), code]), modules, code)
