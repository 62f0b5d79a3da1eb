"""Keys: what each stage's key covers, its readings now, and why it differs from its last run.

The part of a build that both the planner and the rebuilder need, and that runs nothing:
:func:`plan_reads` says which reads a stage's key covers; :class:`Keys` reads them (lazily,
each facet at most once), computes the stage's code version and key, knows the versions of
the codecs (what :mod:`~graphbuild.engine.rebuild` compares an entry's with), and explains a
change against the stage's last recorded run. :mod:`~graphbuild.engine.plan` plans with it;
:mod:`~graphbuild.engine.scheduler` and :mod:`~graphbuild.engine.batch` run with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from graphbuild.engine import source_memo
from graphbuild.engine.events import Change, StageRecord
from graphbuild.engine.explain import explain_changes
from graphbuild.engine.fingerprint import (
    FACETS,
    InputFacets,
    Reading,
    read_value,
    stage_code_version,
)
from graphbuild.engine.fingerprint.registries import _REGISTRIES
from graphbuild.engine.key import stage_key
from graphbuild.engine.pipeline import UNKEYED_INPUT
from graphbuild.engine.toolchain import (
    TOOL_READ,
    codec_version,
    read_tool,
    toolchain_versions,
)
from graphbuild.errors import FingerprintError

if TYPE_CHECKING:
    from graphbuild.engine.artifact_store import Cache
    from graphbuild.engine.pipeline import Pipeline, Stage

__all__ = ["Keys", "StageState", "plan_reads"]


def plan_reads(pipeline: Pipeline, name: str, context: Mapping[str, Any]) -> tuple[str, ...]:
    """The reads a stage's key covers: what it declares, or conservatively everything
    (roots: the whole input, samples and context; others: the whole context and samples)."""
    stage = pipeline._stage(name)
    if stage.reads is not None:
        reads: list[str] = []
        for r in stage.reads:
            if r == "input":
                reads += ["input.structure", "input.state"]
            elif r == "samples":
                reads += ["samples.spec", "samples.values"]
            else:
                reads.append(r)
        return tuple(dict.fromkeys(reads))
    ctx = tuple(f"ctx.{k}" for k in sorted(context))
    registries = tuple(f"registry.{r}" for r in sorted(_REGISTRIES))
    if not pipeline.dependencies(name):
        return (*FACETS, *ctx, *registries)
    return ("samples.spec", "samples.values", *ctx, *registries)


_MISSING = {"missing": True}


@dataclass
class StageState:
    """One stage within one build: its record, what its key read, and (once it ran or was
    loaded) its output."""

    record: StageRecord
    reads: tuple[str, ...]
    readings: dict[str, Reading] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None
    value: Any = None
    has_value: bool = False
    #: its output was let go once no stage of the run read it any more (a rematerialized
    #: stage's): a later read recomputes it, and does not keep it
    released: bool = False
    #: its output, stored whole in the cache, was let go the same way (a large one,
    #: :data:`~graphbuild.engine.release.LARGE_BYTES`): a later read loads it from the cache
    spilled: bool = False
    #: its output was handed to the cache writer whole (bytes and all)
    stored: bool = False
    code: str = ""
    code_error: str | None = None
    upstream: list[str] = field(default_factory=list)
    last: dict[str, Any] | None = None  # the explain record of its previous run, once read
    last_read: bool = False


class Keys:
    """The keys of one pipeline's stages for one input, samples and context."""

    def __init__(
        self,
        pipeline: Pipeline,
        pipeline_input: Any,
        samples: Any,
        context: Mapping[str, Any],
        cache: Cache | None,
        run_id: str,
        facets: InputFacets | None = None,
    ):
        self.pipeline = pipeline
        self.input = pipeline_input
        self.samples = samples
        self.context = dict(context)
        self.cache = cache
        self.run_id = run_id
        self.order = pipeline.order()
        # ``facets``: readings of this input and samples shared with other runs over the very
        # same objects, which their owner promises not to change (a sweep's builds)
        self.facets = facets if facets is not None else InputFacets(pipeline_input, samples)
        source_memo.use(cache)  # what a closure parses is kept there for the next process
        self.toolchain = toolchain_versions()
        self._codec_versions: dict[str, str] = {}
        self.states: dict[str, StageState] = {}

    def begin(self, name: str, record: StageRecord | None = None) -> StageState:
        """The state of stage ``name``, fresh (a pending record unless one is given)."""
        state = StageState(
            record or StageRecord(name), plan_reads(self.pipeline, name, self.context)
        )
        self.states[name] = state
        return state

    def reading(self, read: str) -> Reading:
        if read.startswith("ctx."):
            key = read[4:]
            return read_value(self.context[key]) if key in self.context else read_value(_MISSING)
        if read.startswith(TOOL_READ):  # a program or library the stage calls
            return read_tool(read[len(TOOL_READ) :])
        return self.facets.read(read)

    def compute_key(self, name: str) -> str | None:
        st = self.states[name]
        stage = self.pipeline._stage(name)
        st.code, st.code_error = self._code_version(stage)
        st.readings = {r: self.reading(r) for r in st.reads if r != UNKEYED_INPUT}
        st.upstream = [self.states[d].record.digest or "" for d in self.pipeline.dependencies(name)]
        if st.code_error is not None or any(r.digest is None for r in st.readings.values()):
            return None
        reads = {r: rd.digest for r, rd in st.readings.items()}
        return stage_key(name, st.code, reads, st.upstream, self.toolchain)

    @staticmethod
    def _code_version(stage: Stage) -> tuple[str, str | None]:
        """(code version, None), or ("", why) when the stage's code cannot be fingerprinted:
        then it always reruns, with the reason, never a stale hit."""
        if stage.version is not None:
            return stage.version, None
        try:
            return stage_code_version(stage.fn), None
        except FingerprintError as err:
            return "", f"its code: {err}"

    def codec_versions(self, names: Iterable[str]) -> dict[str, str]:
        """The current version of each codec in ``names`` (each computed once per run)."""
        for name in names:
            if name not in self._codec_versions:
                self._codec_versions[name] = codec_version(name)
        return {n: self._codec_versions[n] for n in sorted(names)}

    def snapshot(self, name: str) -> dict[str, Any]:
        """The explain record of stage ``name`` as its key was computed."""
        st = self.states[name]
        return {
            "key": st.record.key,
            "code": st.code,
            "toolchain": self.toolchain,
            "reads": {
                r: {"digest": rd.digest, "value": rd.value, "details": rd.details}
                for r, rd in st.readings.items()
            },
            "upstream": dict(zip(self.pipeline.dependencies(name), st.upstream, strict=False)),
            "digest": st.record.digest,
        }

    def last(self, name: str) -> dict[str, Any] | None:
        """The explain record of the stage's previous run (read once)."""
        st = self.states[name]
        if not st.last_read:
            st.last = self.cache.last_run(self.run_id, name) if self.cache else None
            st.last_read = True
        return st.last

    def why(self, name: str, key: str | None) -> tuple[str, list[Change]]:
        """Why stage ``name`` has no entry under ``key``: uncacheable, no cache, or what
        changed since its last run."""
        st = self.states[name]
        if key is None:
            why = [st.code_error] if st.code_error else []
            why += [rd.reason for rd in st.readings.values() if rd.digest is None]
            return f"cannot be cached: {why[0]}", []
        if self.cache is None:
            return "no cache", []
        return explain_changes(self.last(name), self.snapshot(name))
