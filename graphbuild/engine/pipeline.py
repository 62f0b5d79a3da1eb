"""The pipeline: a DAG of stages with FastForward's manipulation API.

A stage is ``fn(inputs, sample_inputs, context)``; ``inputs`` is the tuple of its
dependencies' outputs in the order they were declared (the pipeline input for a root stage).
``reads`` names what the stage's output depends on besides its inputs: context keys
(``"ctx.opset"``) and facets of the pipeline input (``"input.structure"``, ``"input.state"``,
``"samples.spec"``, ``"samples.values"``), registries it consults (``"registry.recognizers"``:
the code and configuration of every registered entry) and programs or shared libraries it
calls (``"tool.model-converter"``: see ``engine.toolchain``). ``None`` means "everything"
conservatively, tools aside: a stage that calls one declares it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import networkx as nx

from graphbuild.errors import PipelineError

if TYPE_CHECKING:
    from graphbuild.engine.artifact_store import Cache
    from graphbuild.engine.scheduler import RunResult

StageFn = Callable[[Any, Any, Any], Any]

#: Facets of the pipeline input and samples that a stage can declare it reads.
FACETS = ("input.structure", "input.state", "samples.spec", "samples.values")

#: Access to the pipeline input without fingerprinting it: for a stage whose upstream
#: outputs already cover what it reads (e.g. digests of the few tensors it uses).
#: ``--check-fingerprints`` is how such a promise is tested.
UNKEYED_INPUT = "input.object"


@dataclass(frozen=True)
class Stage:
    """A stage's definition: what it computes and what it declares it reads.

    ``rematerialize``: the cache keeps the output's digest and description, not its bytes; a
    run that needs the value of a hit recomputes it from the stage's inputs and checks it has
    that digest. For a stage whose output is large and a cheap function of what the run holds
    anyway (``bind``: the model's weights), where storing the bytes costs more than making
    them again."""

    name: str
    fn: StageFn
    capture_output: bool = False
    reads: tuple[str, ...] | None = None
    version: str | None = None
    rematerialize: bool = False


@dataclass(frozen=True)
class Cost:
    """What one run of a stage holds while it runs, as the concurrent scheduler budgets it:
    ``memory`` bytes (an estimate: the weights it reads and what it makes of them),
    ``cores`` (threads' worth of the ``jobs`` it takes) and ``exclusive``: nothing else runs
    beside it (``torch.export`` swaps fake tensors into the model it traces while it runs, so
    no other stage may read that model meanwhile), except a stage that is ``apart``: its work
    is in a child process and it reads no model (an HTP context preparation), so it runs
    beside an exclusive one."""

    memory: int = 0
    cores: int = 1
    exclusive: bool = False
    apart: bool = False


def _check_reads(name: str, reads: Iterable[str] | None) -> tuple[str, ...] | None:
    if reads is None:
        return None
    if isinstance(reads, str):
        reads = (reads,)
    out = tuple(dict.fromkeys(reads))
    for r in out:
        if r in ("input", "samples", UNKEYED_INPUT) or (r.startswith("ctx.") and len(r) > 4):
            continue
        if any(r.startswith(p) and len(r) > len(p) for p in ("registry.", "tool.")):
            continue
        if r not in FACETS:
            raise PipelineError(
                f"stage '{name}' declares unknown read '{r}'; use 'ctx.<key>', "
                f"'registry.<name>', 'tool.<name>', 'input', 'samples', '{UNKEYED_INPUT}' "
                f"or one of: {', '.join(FACETS)}"
            )
    return out


_NO_COST = Cost()


class StageRef:
    """Handle to a registered stage, returned by ``register_stage`` and ``get_stage``."""

    def __init__(self, pipeline: Pipeline, name: str):
        self._pipeline = pipeline
        self.name = name

    @property
    def stage(self) -> Stage:
        return self._pipeline._stage(self.name)

    def depends_on(self, *stages: StageRef | str) -> StageRef:
        """Add dependencies in the given order (their outputs become ``inputs``)."""
        for dep in stages:
            self._pipeline.add_dependency(self.name, dep)
        return self

    @property
    def dependencies(self) -> list[str]:
        return self._pipeline.dependencies(self.name)

    def __repr__(self) -> str:
        return f"StageRef({self.name!r})"


def _name(stage: StageRef | str) -> str:
    return stage.name if isinstance(stage, StageRef) else stage


class Pipeline:
    """A DAG of stages on a networkx DiGraph (edge ``dep -> stage``)."""

    def __init__(self, pipeline_kwargs: Mapping[str, Any] | None = None, name: str = "pipeline"):
        self.pipeline_kwargs: dict[str, Any] = dict(pipeline_kwargs or {})
        self.name = name
        self.graph = nx.DiGraph()
        self._products: list[str] | None = None
        # File names a product may be placed under (FileArtifact outputs); None: any plain
        # name that starts with the model name and a dot. A name read from a cache is
        # placed only when it is one of these (docs/design.md, invariant 11).
        self.output_files: frozenset[str] | None = None
        self._order = itertools.count()
        #: report name -> stage whose output an export puts in ``RunReport.extra`` under that
        #: name (numerics, delegation summaries: what a user reads besides the files)
        self.reports: dict[str, str] = {}
        #: its stages may run at once (``jobs`` > 1): each declared what it holds and those
        #: that must run alone said so (:meth:`declare_cost`); an export of it given no
        #: ``jobs`` runs one per core (:func:`~graphbuild.engine.concurrent.build_resources`),
        #: of any other pipeline one at a time whatever ``jobs`` it is given
        self.parallel_safe = False

    # ----------------------------------------------------------------- building

    def register_stage(
        self,
        fn: StageFn,
        name: str | None = None,
        *,
        capture_stage_output: bool = False,
        reads: Iterable[str] | None = None,
        version: str | None = None,
        rematerialize: bool = False,
    ) -> StageRef:
        """Add a stage; ``name`` defaults to the function's name. ``rematerialize``: cache
        the output's digest only, and recompute the value where a run needs it (:class:`Stage`)."""
        name = name or getattr(fn, "__name__", None)
        if not name:
            raise PipelineError("a stage needs a name")
        if name in self.graph:
            raise PipelineError(f"a stage named '{name}' is already registered")
        stage = Stage(
            name, fn, capture_stage_output, _check_reads(name, reads), version, rematerialize
        )
        self.graph.add_node(name, stage=stage, index=next(self._order))
        return StageRef(self, name)

    def declare_cost(
        self,
        name: StageRef | str,
        *,
        memory: int = 0,
        cores: int = 1,
        exclusive: bool = False,
        apart: bool = False,
    ) -> None:
        """Declare what stage ``name`` holds while it runs (:class:`Cost`): a build with
        ``jobs`` > 1 admits it only while the declared memory of the running stages fits the
        build's budget. Not part of any key."""
        name = _name(name)
        self._stage(name)
        if memory < 0 or cores < 1:
            raise PipelineError(
                f"stage '{name}': memory >= 0 and cores >= 1, got {memory}, {cores}"
            )
        if exclusive and apart:
            raise PipelineError(f"stage '{name}': exclusive and apart exclude each other")
        cost = Cost(int(memory), int(cores), bool(exclusive), bool(apart))
        self.graph.nodes[name]["cost"] = cost

    def cost(self, name: str) -> Cost:
        """What stage ``name`` declared it holds while it runs (nothing: 0 bytes, 1 core)."""
        return self.graph.nodes[name].get("cost") or _NO_COST

    def get_stage(self, name: str) -> StageRef:
        self._stage(name)
        return StageRef(self, name)

    def _stage(self, name: str) -> Stage:
        try:
            return self.graph.nodes[name]["stage"]
        except KeyError:
            known = ", ".join(self.graph.nodes) or "none"
            raise KeyError(f"no stage named '{name}' (stages: {known})") from None

    @property
    def stages(self) -> list[Stage]:
        return [self._stage(n) for n in self.order()]

    def dependencies(self, name: str) -> list[str]:
        """A stage's dependencies in input order."""
        self._stage(name)
        edges = self.graph.in_edges(name, data="order")
        return [u for u, _, _ in sorted(edges, key=lambda e: e[2])]

    def dependents(self, name: str) -> list[str]:
        self._stage(name)
        return sorted(self.graph.successors(name), key=lambda n: self.graph.nodes[n]["index"])

    def add_dependency(self, stage: StageRef | str, dependency: StageRef | str) -> None:
        """Make ``stage`` read ``dependency``'s output (idempotent; a cycle is refused)."""
        s, d = _name(stage), _name(dependency)
        self._stage(s)
        self._stage(d)
        if self.graph.has_edge(d, s):
            return
        if s == d or nx.has_path(self.graph, s, d):
            raise ValueError(f"adding dependency '{s}' -> '{d}' would create a cycle")
        self.graph.add_edge(d, s, order=next(self._order))

    def remove_dependency(self, stage: StageRef | str, dependency: StageRef | str) -> None:
        s, d = _name(stage), _name(dependency)
        if not self.graph.has_edge(d, s):
            raise KeyError(f"stage '{s}' does not depend on '{d}'")
        self.graph.remove_edge(d, s)

    def insert_stage_before(
        self,
        target: StageRef | str,
        fn: StageFn,
        name: str | None = None,
        *,
        depends_on: Iterable[StageRef | str] | None = None,
        reads: Iterable[str] | None = None,
        version: str | None = None,
        capture_stage_output: bool = False,
    ) -> StageRef:
        """Add a stage before ``target``. By default it takes the target's dependencies and
        the target depends only on it; with ``depends_on``, only those edges are made and the
        target is left as it is."""
        t = _name(target)
        self._stage(t)
        ref = self.register_stage(
            fn, name, capture_stage_output=capture_stage_output, reads=reads, version=version
        )
        if depends_on is not None:
            ref.depends_on(*depends_on)
            return ref
        for dep in self.dependencies(t):
            self.graph.remove_edge(dep, t)
            self.graph.add_edge(dep, ref.name, order=next(self._order))
        self.graph.add_edge(ref.name, t, order=next(self._order))
        return ref

    def insert_stage_after(
        self,
        target: StageRef | str,
        fn: StageFn,
        name: str | None = None,
        *,
        reads: Iterable[str] | None = None,
        version: str | None = None,
        capture_stage_output: bool = False,
    ) -> StageRef:
        """Add a stage reading ``target``; every dependent of ``target`` now reads the new
        stage instead, in the same input position."""
        t = _name(target)
        self._stage(t)
        dependents = [(v, self.graph.edges[t, v]["order"]) for v in self.graph.successors(t)]
        ref = self.register_stage(
            fn, name, capture_stage_output=capture_stage_output, reads=reads, version=version
        )
        for v, order in dependents:
            self.graph.remove_edge(t, v)
            self.graph.add_edge(ref.name, v, order=order)
        self.graph.add_edge(t, ref.name, order=next(self._order))
        return ref

    def replace_stage(
        self,
        target: StageRef | str,
        fn: StageFn,
        name: str | None = None,
        *,
        reads: Iterable[str] | None = None,
        version: str | None = None,
    ) -> StageRef:
        """Swap a stage's function (and optionally its name), keeping its edges and its
        capture flag. ``reads`` and ``version`` describe the new function."""
        t = _name(target)
        old = self._stage(t)
        new_name = name or t
        stage = replace(
            old, name=new_name, fn=fn, reads=_check_reads(new_name, reads), version=version
        )
        if new_name != t:
            if new_name in self.graph:
                raise PipelineError(f"a stage named '{new_name}' is already registered")
            nx.relabel_nodes(self.graph, {t: new_name}, copy=False)
        self.graph.nodes[new_name]["stage"] = stage
        return StageRef(self, new_name)

    def remove_stage(self, target: StageRef | str) -> None:
        t = _name(target)
        self._stage(t)
        if list(self.graph.successors(t)):
            raise PipelineError(
                f"stage '{t}' has dependents ({', '.join(self.dependents(t))}); "
                "remove those dependencies first"
            )
        self.graph.remove_node(t)

    # ----------------------------------------------------------------- planning

    def order(self) -> list[str]:
        """Topological order, ties broken by registration order (deterministic)."""
        try:
            return list(
                nx.lexicographical_topological_sort(
                    self.graph, key=lambda n: self.graph.nodes[n]["index"]
                )
            )
        except nx.NetworkXUnfeasible as err:  # pragma: no cover - add_dependency refuses cycles
            raise PipelineError(f"the pipeline has a cycle: {err}") from err

    def roots(self) -> list[str]:
        return [n for n in self.order() if self.graph.in_degree(n) == 0]

    def sinks(self) -> list[str]:
        return [n for n in self.order() if self.graph.out_degree(n) == 0]

    @property
    def products(self) -> list[str]:
        """Stages whose outputs an export places as files (default: the sinks)."""
        if self._products is None:
            return self.sinks()
        return [n for n in self._products if n in self.graph]

    @products.setter
    def products(self, names: Iterable[str]) -> None:
        names = list(names)
        for n in names:
            self._stage(n)
        self._products = names

    # ----------------------------------------------------------------- running

    def run(
        self,
        pipeline_input: Any,
        sample_inputs: Any = (),
        *,
        context: Mapping[str, Any] | None = None,
        cache: Cache | None = None,
        force: Iterable[str] | bool = (),
        listeners: Iterable[Callable[[Any], None]] = (),
        run_id: str | None = None,
        check: Iterable[str] | bool = (),
        background_writes: bool = False,
        jobs: int = 1,
        memory: int | None = None,
    ) -> RunResult:
        """Build: run the dirty stages, take the rest from ``cache`` (None: no cache).
        ``check`` names stages to recompute on a hit and compare (the fingerprints' test);
        ``background_writes``: return before the cache writes end (``RunResult.wait_for_cache``);
        ``jobs``: stages at once, within ``memory`` bytes of their declared costs.
        """
        from graphbuild.engine.scheduler import run_pipeline

        return run_pipeline(
            self,
            pipeline_input,
            sample_inputs,
            context={**self.pipeline_kwargs, **(context or {})},
            cache=cache,
            force=force,
            listeners=listeners,
            run_id=run_id or self.name,
            check=check,
            background_writes=background_writes,
            jobs=jobs,
            memory=memory,
        )

    def __call__(self, module: Any, sample_inputs: Any = ()) -> tuple[dict, dict]:
        """FastForward-style call: ``(captured_outputs, eval_results)`` with no cache;
        ``eval_results`` are the outputs of the stages nothing depends on."""
        result = self.run(module, sample_inputs)
        return dict(result.captured), {n: result.outputs[n] for n in self.sinks()}

    def __contains__(self, name: str) -> bool:
        return name in self.graph

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, stages={self.order()})"
