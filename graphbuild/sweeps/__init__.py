"""Sweeps: N variants of one export (presets, calibration sets, per-layer overrides, options)
as one build, each distinct stage key run once, on a local pool of processes or a Ray cluster.

``gb.sweep(...)`` and ``graphbuild sweep`` take the variants as axes over config keys
(:mod:`.variants`), build each variant from the configuration (:mod:`.builds`), run the jobs
(:mod:`.executors`) through :mod:`graphbuild.engine.batch`, place each variant's files and
write the report (:mod:`.runner`, :mod:`.report`). The package is named ``sweeps`` so that it
never shadows the ``graphbuild.sweep()`` function.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphbuild.engine.artifact_store import Cache
    from graphbuild.sweeps.runner import SweepEvent, SweepResult

__all__ = ["sweep"]


def sweep(
    vary: Mapping[str, Sequence[Any]] | Iterable[str] = (),
    *,
    config: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
    overrides: Iterable[str | tuple[str, Any]] = (),
    mode: str | None = None,
    variants: Sequence[Mapping[str, Any]] | None = None,
    calibrations: Mapping[str, Any] | None = None,
    output_dir: str | os.PathLike | None = None,
    cache: Cache | str | os.PathLike | None = None,
    cache_url: str | None = None,
    executor: str | None = None,
    jobs: int | None = None,
    ray_address: str | None = None,
    check_numerics: bool = True,
    listeners: Iterable[Callable[[SweepEvent], None]] = (),
    model: Any = None,
    samples: Any = None,
    calibration: Any = None,
    model_name: str | None = None,
) -> SweepResult:
    """Export every variant of the configuration at ``config`` (else ``graphbuild.toml``
    found from ``cwd``), each into ``output_dir/<variant>/``, running each distinct stage key
    once across them.

    ``vary``: axes, ``{"quantization.preset": ["w8a16", "w8a8"]}`` or ``--vary`` strings;
    crossed (``mode="grid"``, the default) or zipped (``"list"``); ``variants``: an explicit
    list of ``{key: value}``; ``calibrations``: named calibration sets (name -> spec) the
    ``calibration`` axis may name. Defaults come from the config's ``[sweep]`` table.
    ``overrides`` apply to every variant (as ``--set``). ``cache``: a Cache, or a directory
    (default: the configured or default one); ``cache_url``: a shared cache the workers meet
    at (Ray needs one, or a directory every node reaches). ``executor``: ``"local"`` (a pool of
    ``jobs`` processes; ``jobs=1``: this process) or ``"ray"`` (``ray_address``: a cluster;
    none: a local one). Returns the rows and summary that ``sweep.json`` holds.

    ``model``: a model in memory (a ``torch.nn.Module``, or a function returning one or a
    ``(module, sample_inputs)`` tuple) instead of the config's, traced on ``samples``;
    ``calibration``: its calibration batches (a list, or a function returning one), and
    ``calibrations`` may then hold such sets too; ``model_name`` names its files (default
    ``model``). No config file is searched for (``config`` may still name one without a
    model), and the jobs run in this process."""
    from graphbuild.config import load_config, parse_override
    from graphbuild.engine.artifact_store import Cache
    from graphbuild.errors import ArgumentTypeError, ConfigError
    from graphbuild.sweeps.builds import CacheSpec
    from graphbuild.sweeps.memory import in_memory
    from graphbuild.sweeps.runner import DEFAULT_OUTPUT_DIR, run_sweep
    from graphbuild.sweeps.variants import Axis, sweep_settings

    here = Path(cwd or os.getcwd()).resolve()
    pairs = [parse_override(o) if isinstance(o, str) else tuple(o) for o in overrides]
    memory = None
    if model is not None:
        memory, default, calibrations = in_memory(model, samples, calibration, calibrations)
        given = [("calibration", default)] if default else []
        given += [("model_name", model_name)] if model_name else []
        pairs = [*given, *pairs]
    elif samples is not None or calibration is not None or model_name is not None:
        raise ArgumentTypeError(
            "samples, calibration and model_name go with a model in memory (model=...); "
            "a config file's model takes them from the file"
        )
    base = load_config(config, here, pairs, required=memory is None, search=memory is None)
    if memory is not None and base.model is not None:
        raise ConfigError(
            f"{base.where} names a model ({base.model}) and sweep() was given one in memory: "
            "give one of them"
        )
    if memory is not None and base.model_name is None:
        pairs = [("model_name", "model"), *pairs]
        base = load_config(config, here, pairs, required=False, search=False)
    axes: list[str | Axis] = (
        [Axis(k, tuple(v)) for k, v in vary.items()] if isinstance(vary, Mapping) else list(vary)
    )
    table = dict(base.sweep)
    if variants is not None:
        table["variants"] = list(variants)
        table.pop("vary", None)
    if calibrations is not None:
        table["calibrations"] = {**table.get("calibrations", {}), **calibrations}
    settings = sweep_settings(table, axes, mode=mode, where=f"{base.where} [sweep]")
    url = cache_url or base.cache_url
    if isinstance(cache, Cache):
        opened = cache
        directory = str(cache.path) if cache.path is not None else None
    else:
        directory = str(Path(cache).expanduser().resolve()) if cache is not None else None
        directory = directory or (str(base.cache_dir) if base.cache_dir else None)
        opened = Cache(directory, url=url)
        if base.cache_lease_seconds is not None:
            opened.lease_seconds = float(base.cache_lease_seconds)
    kind = executor or settings.executor or "local"
    spec = CacheSpec(
        None if (kind == "ray" and url) else (directory or str(opened.path)),
        url,
        lease_seconds=opened.lease_seconds,
    )
    if output_dir is not None:
        root = here / Path(output_dir).expanduser()
    else:  # a path in the file is relative to the file, as its output_dir is
        root = base.root / Path(settings.output_dir or DEFAULT_OUTPUT_DIR).expanduser()
    return run_sweep(
        settings,
        config=base.source,
        cwd=here,
        base_overrides=pairs,
        output_dir=root.resolve(),
        cache=opened,
        cache_spec=spec,
        executor=kind,
        jobs=jobs,
        ray_address=ray_address or settings.ray_address,
        check_numerics=check_numerics,
        listeners=listeners,
        memory=memory,
    )
