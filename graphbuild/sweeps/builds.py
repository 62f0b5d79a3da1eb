"""A variant as any process can build it: the config file and the overrides that make it.

The process that plans a sweep and every worker that runs its jobs build each variant the
same way, from a :class:`VariantSpec` (plain data, sent to workers): load the configuration
with the sweep's and the variant's overrides, call the model factory, make the export request
and its pipeline (``graphbuild.config.export_request``, as ``graphbuild export`` does). A
worker that builds something else (an unseeded model factory) computes other keys, which the
job refuses (:class:`~graphbuild.errors.KeyMismatchError`).

In one process each distinct model (factory and samples) is built once and shared by the
variants that name it, with one set of fingerprints (the sweep never changes it).
:class:`CacheSpec` is how a worker opens the shared cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphbuild.cache.leases import DEFAULT_SECONDS
from graphbuild.config import Config, export_request, load_config
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.batch import Build
from graphbuild.errors import ConfigError

if TYPE_CHECKING:
    from graphbuild.api import ExportRequest
    from graphbuild.engine.pipeline import Pipeline
    from graphbuild.sweeps.memory import InMemory

__all__ = ["KEEP_VALUES", "CacheSpec", "VariantBuilds", "VariantSpec"]

#: Decoded stage outputs a process running a sweep's jobs keeps in memory (encoded bytes):
#: a job rereads what earlier jobs made (Cache.keep_values).
KEEP_VALUES = 1 << 30


@dataclass(frozen=True)
class VariantSpec:
    """What any process needs to build one variant: the config file (None: the one found
    from ``cwd``, or with ``search`` off none, the overrides naming the model), the directory
    relative paths start from, and the overrides (the sweep's, then the variant's)."""

    name: str
    config: str | None
    cwd: str
    overrides: tuple[tuple[str, Any], ...]
    search: bool = True

    def load_config(self) -> Config:
        return load_config(
            self.config, self.cwd, self.overrides, required=self.search, search=self.search
        )


@dataclass(frozen=True)
class CacheSpec:
    """How a worker opens the sweep's cache: a directory (None: the worker's own default,
    ``$GRAPHBUILD_CACHE_DIR``, in front of ``url``), a shared cache URL, whether it may write
    the shared cache, and its lease time."""

    directory: str | None
    url: str | None = None
    readonly: bool = False
    lease_seconds: float = DEFAULT_SECONDS

    def open(self) -> Cache:
        cache = Cache(
            self.directory,
            readonly=self.readonly and not self.url,
            url=self.url,
            remote_readonly=self.readonly,
        )
        cache.lease_seconds = self.lease_seconds
        return cache


@dataclass
class VariantBuild:
    """One variant built in this process: its config, export request, pipeline and the
    batch's view of it."""

    spec: VariantSpec
    config: Config
    request: ExportRequest
    pipeline: Pipeline
    build: Build


class VariantBuilds:
    """Builds variants in this process on demand, each distinct model once."""

    def __init__(
        self,
        specs: list[VariantSpec] | tuple[VariantSpec, ...],
        cache: Cache | None,
        memory: InMemory | None = None,
    ):
        self.specs = {s.name: s for s in specs}
        self.cache = cache
        self.memory = memory
        self._models: dict[tuple, tuple[Any, Any, Any]] = {}
        self._calibrations: dict[tuple, Any] = {}
        self._built: dict[str, VariantBuild] = {}

    def __getitem__(self, name: str) -> VariantBuild:
        if name not in self._built:
            if name not in self.specs:
                raise ConfigError(f"no variant named '{name}' in this sweep")
            self._built[name] = self._make(self.specs[name])
        return self._built[name]

    def _make(self, spec: VariantSpec) -> VariantBuild:
        from graphbuild.engine.fingerprint import InputFacets

        cfg = spec.load_config()
        if not cfg.model_name:
            raise ConfigError(
                f'variant {spec.name}: no model configured; set model = "file.py:build" '
                "or pass --model"
            )
        memory = self.memory if self.memory is not None and cfg.model is None else None
        key = (str(cfg.root), cfg.model, cfg.samples)
        if key not in self._models:
            if memory is not None:
                model, samples = memory.model, memory.samples
            else:
                model, samples = cfg.load_model_and_samples()
            self._models[key] = (model, samples, InputFacets(model, samples))
        model, samples, facets = self._models[key]
        calibration_key = (str(cfg.root), cfg.calibration)
        if calibration_key not in self._calibrations:
            held = self.memory.calibration(cfg.calibration) if self.memory else None
            if held is not None:
                self._calibrations[calibration_key] = held
            else:
                self._calibrations[calibration_key] = cfg.load_calibration()
        request, pipeline = export_request(
            cfg, model, samples, self._calibrations[calibration_key], cache=self.cache
        )
        build = Build(
            spec.name, pipeline, model, samples, request.context(), request.run_id(), facets
        )
        return VariantBuild(spec, cfg, request, pipeline, build)


def absolute(path: str | os.PathLike, cwd: str | os.PathLike) -> str:
    return str((Path(cwd) / Path(path).expanduser()).resolve())
