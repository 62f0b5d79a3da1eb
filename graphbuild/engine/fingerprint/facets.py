"""Facets of a run's pipeline input and samples, computed lazily, at most once per run.

``input.structure``, ``input.state``, ``samples.spec`` and ``samples.values``, and
``registry.<name>`` reads; a facet that cannot be fingerprinted is a reading without a digest
and a reason: always rerun, never a stale hit.
"""

from __future__ import annotations

from typing import Any

import torch

from graphbuild.engine.fingerprint.readings import Reading, _short
from graphbuild.engine.fingerprint.registries import read_registry
from graphbuild.engine.fingerprint.structure import structure_fingerprint
from graphbuild.engine.fingerprint.tensors import state_digests
from graphbuild.engine.fingerprint.walk import fingerprint, stable_text
from graphbuild.errors import FingerprintError
from graphbuild.hashing import digest_json


class InputFacets:
    """Lazily computed facets of one run's pipeline input and sample inputs."""

    def __init__(self, pipeline_input: Any, samples: Any):
        self.pipeline_input = pipeline_input
        self.samples = samples
        self._cache: dict[str, Reading] = {}

    def read(self, facet: str) -> Reading:
        if facet.startswith("registry."):
            return read_registry(facet[len("registry.") :])
        if facet not in self._cache:
            self._cache[facet] = self._compute(facet)
        return self._cache[facet]

    def _compute(self, facet: str) -> Reading:
        try:
            if facet == "input.structure":
                return self._structure()
            if facet == "input.state":
                return self._state()
            if facet == "samples.spec":
                return _samples_spec(self.samples)
            if facet == "samples.values":
                return Reading(digest_json(fingerprint(self.samples)))
        except FingerprintError as err:
            return Reading(None, reason=f"{facet}: {err}")
        raise KeyError(facet)

    def _structure(self) -> Reading:
        obj = self.pipeline_input
        if isinstance(obj, torch.nn.Module):
            fp = structure_fingerprint(obj)
            return Reading(fp.digest, _short(fp.digest), dict(fp.modules))
        return Reading(digest_json(fingerprint(obj)))

    def _state(self) -> Reading:
        obj = self.pipeline_input
        if isinstance(obj, torch.nn.Module):
            sd = state_digests(obj)
            return Reading(sd.digest, f"{len(sd.tensors)} tensors", sd.tensors)
        return Reading(digest_json(fingerprint(obj)))


def _samples_spec(samples: Any) -> Reading:
    leaves, spec = torch.utils._pytree.tree_flatten(samples)
    shown = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            shown.append(f"{str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}")
        else:
            shown.append(fingerprint(leaf))
    value = [stable_text(str(spec), "the sample inputs' pytree spec"), shown]
    return Reading(digest_json(value), shown if len(shown) <= 8 else _short(value))
