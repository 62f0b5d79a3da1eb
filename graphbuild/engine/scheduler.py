"""Scheduler and rebuilder: which stages run, in which order, and why.

A topological scheduler with constructive traces: each stage's key hashes its code, its
declared reads and the digests of its upstream outputs; a key with a valid cache entry is a
hit and nothing is loaded unless a dirty dependent needs it (laziness). A stage that reruns
and reproduces its previous output digest leaves its dependents clean (early cutoff), because
dependents key on output digests, not on upstream keys.
"""

from __future__ import annotations

import enum
import functools
import importlib.metadata
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphbuild.engine import digest_memo
from graphbuild.engine.checking import check_mode
from graphbuild.engine.closure import class_named_by, code_closure, name_closure
from graphbuild.engine.codecs import codec_modules, encode, snapshot
from graphbuild.engine.fingerprint import (
    FACETS,
    InputFacets,
    Reading,
    code_identity,
    input_token,
    read_value,
    stage_code_version,
    verify_reused_digests,
)
from graphbuild.engine.fingerprint.registries import _REGISTRIES
from graphbuild.engine.key import stage_key
from graphbuild.engine.pipeline import UNKEYED_INPUT
from graphbuild.engine.status import StageStatus
from graphbuild.engine.store import Cache, CorruptEntry
from graphbuild.errors import (
    FingerprintError,
    FingerprintMismatchError,
    GraphbuildError,
    InputMutationError,
    StageError,
    UndeclaredReadError,
)
from graphbuild.hashing import digest_bytes, digest_json

if TYPE_CHECKING:
    from graphbuild.engine.pipeline import Pipeline, Stage

__all__ = [
    "EventKind",
    "StageEvent",
    "Change",
    "StageRecord",
    "RunReport",
    "RunResult",
    "StageContext",
    "run_pipeline",
    "plan_reads",
    "toolchain_versions",
]


class EventKind(enum.Enum):
    STARTED = "started"
    HIT = "hit"
    CUTOFF = "cutoff"
    RAN = "ran"
    LOADED = "loaded"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class StageEvent:
    """One thing that happened to one stage; progress displays and tests consume these."""

    kind: EventKind
    stage: str
    key: str | None = None
    seconds: float = 0.0
    reason: str | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Change:
    """One read (or the code, or an upstream output) that differs from the last run."""

    read: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.read}: {_show(self.old)} -> {_show(self.new)}"


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class StageRecord:
    """The run report's line for one stage."""

    name: str
    status: StageStatus = StageStatus.PENDING
    key: str | None = None
    seconds: float = 0.0
    bytes: int = 0
    reason: str | None = None
    changes: list[Change] = field(default_factory=list)
    digest: str | None = None
    saved_seconds: float = 0.0
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["changes"] = [{"read": c.read, "old": c.old, "new": c.new} for c in self.changes]
        return out


@dataclass
class RunReport:
    run_id: str
    stages: list[StageRecord]
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> StageRecord:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def statuses(self) -> dict[str, StageStatus]:
        return {s.name: s.status for s in self.stages}

    def with_status(self, *statuses: StageStatus | str) -> list[str]:
        return [s.name for s in self.stages if s.status in statuses]

    @property
    def ran(self) -> list[str]:
        return self.with_status(StageStatus.RAN)

    @property
    def hits(self) -> list[str]:
        return self.with_status(StageStatus.HIT, StageStatus.CUTOFF)

    @property
    def seconds_saved(self) -> float:
        return sum(s.saved_seconds for s in self.stages)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "seconds": self.seconds,
            "stages": [s.to_json() for s in self.stages],
            **self.extra,
        }


class StageContext(Mapping[str, Any]):
    """The ``context`` a stage receives: the pipeline context, limited to what the stage
    declared it reads (an undeclared key raises :class:`UndeclaredReadError`).

    The first undeclared read is also kept in ``violation``: the scheduler fails the stage
    even when the stage caught the error (``UndeclaredReadError`` is a ``KeyError``, and
    ``except KeyError: default`` would otherwise turn it into a silent stale hit)."""

    def __init__(
        self,
        stage: str,
        values: Mapping[str, Any],
        allowed: set[str] | None,
        declared: tuple[str, ...],
        pipeline_input: Any = None,
        input_allowed: bool = False,
    ):
        self.stage = stage
        self._values = values
        self._allowed = allowed
        self._declared = declared
        self._input = pipeline_input
        self.input_allowed = input_allowed
        self.violation: UndeclaredReadError | None = None

    def _refuse(self, read: str) -> None:
        err = UndeclaredReadError(self.stage, read, self._declared)
        if self.violation is None:
            self.violation = err
        raise err

    def _check(self, key: str) -> None:
        if self._allowed is not None and key not in self._allowed:
            self._refuse(f"ctx.{key}")

    def __getitem__(self, key: str) -> Any:
        self._check(key)
        return self._values[key]

    def get(self, key: str, default: Any = None) -> Any:
        # Mapping.get would catch the KeyError an undeclared read raises
        self._check(key)
        return self._values.get(key, default)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        self._check(key)
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        allowed = self._allowed
        return iter([k for k in self._values if allowed is None or k in allowed])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @property
    def input(self) -> Any:
        """The pipeline input (the model); only for stages that declare an input read."""
        if not self.input_allowed:
            self._refuse("input")
        return self._input


@functools.cache
def _engine_digest() -> str:
    """The engine's own files (keys, fingerprints, codecs, scheduler): they decide what every
    key means. Each stage's code is keyed by the files it reaches (``stage_code_version``),
    so editing one stage's module reruns that stage, not every stage."""
    root = Path(__file__).parent
    files = [*sorted(root.rglob("*.py")), root.parent / "hashing.py"]
    return digest_bytes(b"".join(f.read_bytes() for f in files))[:16]


@functools.cache
def _tool_versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "onnx", "onnxscript", "onnx-ir", "torchao", "graphbuild"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "absent"
    out["graphbuild"] += f"+{_engine_digest()}"
    return out


def toolchain_versions() -> dict[str, str]:
    """Versions that every key includes: a new torch or graphbuild engine invalidates the
    cache."""
    return dict(_tool_versions())


def codec_files(name: str) -> dict[str, str]:
    """The source files the codec registered under ``name`` runs: its class's definition
    and what its methods use (``engine.closure``), found in the source when the codec is
    registered lazily and not loaded yet. Editing a module a codec does not use (the ONNX
    writer beside the ONNX codec) leaves the entries it wrote valid."""
    for codec_name, module, codec in codec_modules():
        if codec_name != name:
            continue
        cls = type(codec).__qualname__ if codec is not None else None
        cls = cls or class_named_by(module, "name", name)
        if cls is None:  # not found in the source: all of its module
            return code_closure([module], own=True)
        return name_closure([(module, cls.split(".")[0], False)], own=True)
    return {}


def _codec_version(name: str) -> str:
    """The code and configuration of the codec registered under ``name`` (loaded or not yet:
    a lazily registered codec counts the same). A cache entry records the versions of the
    codecs that wrote it and is a miss when one has changed since."""
    for codec_name, _, codec in codec_modules():
        if codec_name == name:
            form: dict[str, Any] = {"files": codec_files(name)}
            if codec is not None and vars(codec):
                form["config"] = code_identity(codec)
            return digest_json(form)[:16]
    return "unknown"


def _codec_names(description: Mapping[str, Any]) -> set[str]:
    names = {description["codec"]}
    for child in description.get("children", ()):
        names |= _codec_names(child)
    return names


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


@dataclass(frozen=True)
class _Token:
    """What a stage was handed (an upstream output, the samples, the model) and a token of
    its contents before the stage ran."""

    source: str
    what: str
    value: Any
    token: Any


@dataclass
class _State:
    record: StageRecord
    reads: tuple[str, ...]
    readings: dict[str, Reading] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None
    value: Any = None
    has_value: bool = False
    code: str = ""
    code_error: str | None = None
    upstream: list[str] = field(default_factory=list)
    last: dict[str, Any] | None = None  # the explain record of its previous run, once read
    last_read: bool = False


class _CacheWriter:
    """Stores stage outputs in the cache on one background thread, in the order they ran, so
    writing a large artifact overlaps the stages after it (and the placing of the files).

    Each store is what ``Cache.store`` makes it (blobs, then the manifest, each atomic); a
    value is stored as encoded when its stage returned (its parts are views of the value,
    which no later stage may change: invariant 9). :meth:`finish` waits for every store and
    raises the first error one raised (a cache that cannot be written is a warning, as
    before, not an error)."""

    def __init__(self, cache: Cache):
        self.cache = cache
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, key: str, encoded: Any, record: dict[str, Any]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._work, name="graphbuild-cache-writer", daemon=True
            )
            self._thread.start()
        self._queue.put((key, encoded, record))

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # after a failure, nothing more is stored
            try:
                self.cache.store(*item)
            except BaseException as err:  # surfaced by finish(), in the caller's thread
                self._error = err

    def finish(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error


class _Run:
    """One build of one pipeline: the rebuilder loop and lazy loading."""

    def __init__(
        self,
        pipeline: Pipeline,
        pipeline_input: Any,
        samples: Any,
        context: Mapping[str, Any],
        cache: Cache | None,
        force: Iterable[str] | bool,
        listeners: Iterable[Callable[[StageEvent], None]],
        run_id: str,
        check: Iterable[str] | bool = (),
    ):
        self.pipeline = pipeline
        self.input = pipeline_input
        self.samples = samples
        self.context = dict(context)
        self.cache = cache
        self.listeners = list(listeners)
        self.run_id = run_id
        self.order = pipeline.order()
        self.force_all = force is True
        self.force = set() if isinstance(force, bool) else set(force)
        unknown = self.force - set(self.order)
        if unknown:
            raise KeyError(f"cannot force unknown stage(s): {', '.join(sorted(unknown))}")
        self.check = set(self.order) if check is True else set(check or ()) & set(self.order)
        self.facets = InputFacets(pipeline_input, samples)
        digest_memo.begin_run()  # digests of earlier runs: only where reuse across runs is on
        self.toolchain = toolchain_versions()
        self._codec_versions: dict[str, str] = {}
        self.states: dict[str, _State] = {}
        self.writer = _CacheWriter(cache) if cache is not None else None
        self.ran_order: list[str] = []
        self.failure: StageError | None = None
        # set when a stage edited an upstream output in place: that value is no longer what
        # its digest says, so no other stage may read it; the run stops
        self.stopped: str | None = None

    def emit(self, event: StageEvent) -> None:
        for listener in self.listeners:
            listener(event)

    # ----------------------------------------------------------------- keys

    def reading(self, read: str) -> Reading:
        if read.startswith("ctx."):
            key = read[4:]
            return read_value(self.context[key]) if key in self.context else read_value(_MISSING)
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

    # ----------------------------------------------------------------- main loop

    def run(self) -> RunReport:
        t0 = time.perf_counter()
        for name in self.order:
            st = _State(StageRecord(name), plan_reads(self.pipeline, name, self.context))
            self.states[name] = st
            deps = self.pipeline.dependencies(name)
            blocked = [
                d
                for d in deps
                if self.states[d].record.status in (StageStatus.FAILED, StageStatus.SKIPPED)
            ]
            if self.stopped is not None:
                st.record.status = StageStatus.SKIPPED
                st.record.reason = f"the run stopped: stage '{self.stopped}' edited its input"
                self.emit(StageEvent(EventKind.SKIPPED, name, reason=st.record.reason))
                continue
            if blocked:
                st.record.status = StageStatus.SKIPPED
                st.record.reason = f"upstream '{blocked[0]}' did not complete"
                self.emit(StageEvent(EventKind.SKIPPED, name, reason=st.record.reason))
                continue
            key = self.compute_key(name)
            st.record.key = key
            if self.cache is not None and key is not None and not self._forced(name):
                manifest = self.cache.lookup(key)
                stale = self.stale_codecs(manifest) if manifest is not None else []
                if manifest is not None and not stale:
                    self._hit(name, manifest)
                    if name in self.check:
                        self._check_hit(name)
                    continue
                if stale:
                    self._execute(name, reason=_stale_reason(stale))
                    continue
            self._execute(name)
        return RunReport(
            self.run_id,
            [self.states[n].record for n in self.order],
            time.perf_counter() - t0,
        )

    def finish_writes(self) -> None:
        """Wait for the cache writes of this run, then keep the cache within its size."""
        if self.writer is not None:
            self.writer.finish()
            self.cache.enforce_limit()  # type: ignore[union-attr]

    def codec_versions(self, names: Iterable[str]) -> dict[str, str]:
        for name in names:
            if name not in self._codec_versions:
                self._codec_versions[name] = _codec_version(name)
        return {n: self._codec_versions[n] for n in sorted(names)}

    def stale_codecs(self, manifest: Mapping[str, Any]) -> list[str]:
        """Codecs that wrote this entry and have changed since (a registration, an edit)."""
        try:
            names = _codec_names(manifest["artifact"])
            recorded = manifest.get("codecs") or {}
        except (KeyError, TypeError, AttributeError):
            return ["?"]
        current = self.codec_versions(names)
        return [n for n in sorted(names) if recorded.get(n) != current[n]]

    def _forced(self, name: str) -> bool:
        return self.force_all or name in self.force

    def _check_hit(self, name: str) -> None:
        """Check mode: recompute a hit and fail loudly if its output differs from the cached
        one, which means the stage reads something its key does not cover."""
        st = self.states[name]
        rec = st.record
        stage = self.pipeline._stage(name)
        t0 = time.perf_counter()
        try:
            inputs = self._inputs(name)
            ctx = self._context(name, stage, st.reads)
            before = self._snapshots(name, inputs, ctx)
            value = stage.fn(inputs, self.samples, ctx)
            self._check_inputs(name, before)
            digest = encode(value).digest
        except InputMutationError as err:
            rec.status, rec.error = StageStatus.FAILED, str(err)
            rec.seconds = time.perf_counter() - t0
            self.stopped = name
            self.failure = StageError(name, err, tuple(self.ran_order))
            self.emit(StageEvent(EventKind.FAILED, name, rec.key, rec.seconds, rec.reason, err))
            return
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:
            digest, value = None, err
        if digest == rec.digest:
            rec.reason = "checked: recomputed output matches the cache"
            return
        err = FingerprintMismatchError(
            f"stage '{name}' hit the cache (key {rec.key}) but recomputing it gave "
            + (
                f"a different output ({(rec.digest or '')[:12]} cached, {digest[:12]} now)"
                if digest
                else f"an error: {value}"
            )
            + "; its declared reads "
            + f"({', '.join(stage.reads) if stage.reads is not None else 'everything'}) "
            + "miss something it depends on"
        )
        rec.status, rec.error = StageStatus.FAILED, str(err)
        rec.seconds = time.perf_counter() - t0
        self.failure = StageError(name, err, tuple(self.ran_order))
        self.emit(StageEvent(EventKind.FAILED, name, rec.key, rec.seconds, rec.reason, err))

    def _hit(self, name: str, manifest: dict[str, Any]) -> None:
        st = self.states[name]
        st.manifest = manifest
        rec = st.record
        rec.digest = manifest["artifact"]["digest"]
        rec.bytes = int(manifest.get("bytes", 0))
        rec.saved_seconds = float(manifest.get("seconds", 0.0))
        upstream_ran = any(
            self.states[d].record.status == StageStatus.RAN
            for d in self.pipeline.dependencies(name)
        )
        rec.status = StageStatus.CUTOFF if upstream_ran else StageStatus.HIT
        if upstream_ran:
            rec.reason = "upstream reran with an identical output (early cutoff)"
        self._remember(name)
        kind = EventKind.CUTOFF if upstream_ran else EventKind.HIT
        self.emit(StageEvent(kind, name, rec.key, reason=rec.reason))

    def load(self, name: str) -> Any:
        """A stage's output, loading (and verifying) it from the cache if needed; a corrupt
        entry is rebuilt."""
        st = self.states[name]
        if st.has_value:
            return st.value
        if st.manifest is None:
            raise GraphbuildError(f"stage '{name}' has no output (status {st.record.status})")
        t0 = time.perf_counter()
        try:
            value = self.cache.load(st.manifest)  # type: ignore[union-attr]
        except CorruptEntry as err:
            st.manifest = None
            self._execute(name, reason=f"cache entry was corrupt ({err}); rebuilt")
            if self.states[name].record.status == StageStatus.FAILED:
                raise self.failure from err  # type: ignore[misc]
            return st.value
        st.value, st.has_value = value, True
        self.emit(StageEvent(EventKind.LOADED, name, st.record.key, time.perf_counter() - t0))
        return value

    def _inputs(self, name: str) -> Any:
        deps = self.pipeline.dependencies(name)
        if not deps:
            return self.input
        return tuple(self.load(d) for d in deps)

    def _execute(self, name: str, reason: str | None = None) -> None:
        st = self.states[name]
        stage = self.pipeline._stage(name)
        rec = st.record
        try:
            inputs = self._inputs(name)
        except StageError:
            rec.status, rec.reason = StageStatus.SKIPPED, "an upstream rebuild failed"
            return
        old_upstream = list(st.upstream)
        key = self.compute_key(name)
        if st.upstream != old_upstream:
            rec.key = key
        rec.reason, rec.changes = self._why(name, key, reason)
        self.emit(StageEvent(EventKind.STARTED, name, key, reason=rec.reason))
        ctx = self._context(name, stage, st.reads)
        t0 = time.perf_counter()
        try:
            before = self._snapshots(name, inputs, ctx)
            value = stage.fn(inputs, self.samples, ctx)
            if ctx.violation is not None:  # read undeclared, then caught the error
                raise ctx.violation
            self._check_inputs(name, before)
            encoded = encode(value)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:
            rec.seconds = time.perf_counter() - t0
            rec.status, rec.error = StageStatus.FAILED, f"{type(err).__name__}: {err}"
            if isinstance(err, InputMutationError):
                self.stopped = name
            self.failure = StageError(name, err, tuple(self.ran_order))
            self.emit(StageEvent(EventKind.FAILED, name, key, rec.seconds, rec.reason, err))
            return
        rec.seconds = time.perf_counter() - t0
        st.value, st.has_value = value, True
        rec.digest, rec.bytes, rec.status = encoded.digest, encoded.size, StageStatus.RAN
        self.ran_order.append(name)
        if self.cache is not None:
            self.cache.count_miss()
            if key is not None:
                self.writer.submit(key, encoded, self._manifest_record(name, encoded))
        self._remember(name)
        self.emit(StageEvent(EventKind.RAN, name, key, rec.seconds, rec.reason))

    def _snapshots(self, name: str, inputs: Any, ctx: StageContext) -> list[_Token]:
        """Tokens of what a stage is handed and must not change, taken before it runs: its
        upstream outputs (their contents, bytes included), the sample inputs, and the model
        when the stage can reach it (cheaply: tensor identities and version counters; in
        check mode also a digest of every tensor)."""
        deps = self.pipeline.dependencies(name)
        tokens = [  # a root stage's inputs are the model itself
            _Token(dep, f"the output of '{dep}'", value, snapshot(value))
            for dep, value in zip(deps, inputs if deps else (), strict=True)
        ]
        tokens.append(_Token("samples", "the sample inputs", self.samples, snapshot(self.samples)))
        if not deps or ctx.input_allowed:
            model = self.input
            full = bool(self.check)
            tokens.append(_Token("input", "the model", model, input_token(model, full=full)))
        return tokens

    def _check_inputs(self, name: str, before: list[_Token]) -> None:
        """Inputs are read-only (DESIGN.md, invariant 9): a stage that changed what it was
        handed in place fails, naming itself and what it changed. In check mode every
        upstream output is also re-encoded and must still have the digest its upstream
        recorded."""
        full = bool(self.check)
        for token in before:
            if token.token is None:
                continue
            if token.source == "input":
                now = input_token(token.value, full=full)
            else:
                now = snapshot(token.value)
            if now != token.token:
                raise InputMutationError(name, token.source, what=token.what)
        if not self.check:
            return
        for token in before:
            if token.source in ("input", "samples"):
                continue
            recorded = self.states[token.source].record.digest
            if encode(token.value).digest != recorded:
                raise InputMutationError(
                    name,
                    token.source,
                    "left its input with a different digest than it was given",
                    what=token.what,
                )

    def _context(self, name: str, stage: Stage, reads: tuple[str, ...]) -> StageContext:
        allowed = None if stage.reads is None else {r[4:] for r in reads if r.startswith("ctx.")}
        root = not self.pipeline.dependencies(name)
        input_allowed = any(r.startswith("input.") for r in reads) or (stage.reads is None and root)
        return StageContext(
            name, self.context, allowed, stage.reads or (), self.input, input_allowed
        )

    # ----------------------------------------------------------------- records & reasons

    def _snapshot(self, name: str) -> dict[str, Any]:
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

    def _manifest_record(self, name: str, encoded: Any = None) -> dict[str, Any]:
        st = self.states[name]
        codecs = self.codec_versions(_codec_names(encoded.describe())) if encoded else {}
        return {
            "codecs": codecs,
            "stage": name,
            "pipeline": self.run_id,
            "seconds": st.record.seconds,
            "code": st.code,
            "reads": {r: rd.digest for r, rd in st.readings.items()},
            "upstream": st.upstream,
            "toolchain": self.toolchain,
        }

    def _remember(self, name: str) -> None:
        if self.cache is None:
            return
        last = self._last(name)
        rec = self.states[name].record
        if last and last.get("key") == rec.key and last.get("digest") == rec.digest:
            return
        snap = self._snapshot(name)
        snap.update(status=rec.status, when=time.time(), seconds=rec.seconds)
        self.cache.record_run(self.run_id, name, snap)

    def _last(self, name: str) -> dict[str, Any] | None:
        st = self.states[name]
        if not st.last_read:
            st.last = self.cache.last_run(self.run_id, name) if self.cache else None
            st.last_read = True
        return st.last

    def _why(self, name: str, key: str | None, reason: str | None) -> tuple[str, list[Change]]:
        if reason:
            return reason, []
        st = self.states[name]
        if key is None:
            why = [st.code_error] if st.code_error else []
            why += [rd.reason for rd in st.readings.values() if rd.digest is None]
            return f"cannot be cached: {why[0]}", []
        if self._forced(name):
            return "forced", []
        if self.cache is None:
            return "no cache", []
        return explain_changes(self._last(name), self._snapshot(name))


def _stale_reason(stale: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in stale)
    return f"the cached entry was written by an older codec {shown}; rebuilt"


def explain_changes(last: dict[str, Any] | None, now: dict[str, Any]) -> tuple[str, list[Change]]:
    """Why a stage's key differs from its last run, cheapest check first."""
    if not last:
        return "no cached result (first run)", []
    changes: list[Change] = []
    if last.get("code") != now["code"]:
        changes.append(Change("code", last.get("code", "")[:12], now["code"][:12]))
    old_tc, new_tc = last.get("toolchain", {}), now["toolchain"]
    for tool in sorted(set(old_tc) | set(new_tc)):
        if old_tc.get(tool) != new_tc.get(tool):
            changes.append(Change(f"toolchain.{tool}", old_tc.get(tool), new_tc.get(tool)))
    old_reads = last.get("reads", {})
    for read, cur in now["reads"].items():
        prev = old_reads.get(read)
        if prev is None:
            changes.append(Change(read, None, cur["value"]))
        elif prev.get("digest") != cur["digest"]:
            changes.append(_read_change(read, prev, cur))
    for dep, digest in now["upstream"].items():
        prev = last.get("upstream", {}).get(dep)
        if prev != digest:
            changes.append(Change(f"output of '{dep}'", (prev or "")[:12], (digest or "")[:12]))
    if not changes:
        return "no cache entry for this key (evicted, pruned, corrupt or never stored)", []
    first = changes[0]
    if first.read == "code":
        head = "code changed"
    elif first.read.startswith("output of"):
        head = f"{first.read} changed"
    else:
        head = str(first)
    more = f" (+{len(changes) - 1} more)" if len(changes) > 1 else ""
    return head + more, changes


def _read_change(read: str, prev: dict[str, Any], cur: dict[str, Any]) -> Change:
    old_d, new_d = prev.get("details") or {}, cur.get("details") or {}
    if old_d or new_d:
        changed = sorted(k for k in set(old_d) | set(new_d) if old_d.get(k) != new_d.get(k))
        shown = ", ".join(changed[:5]) + (f", +{len(changed) - 5} more" if len(changed) > 5 else "")
        label = "submodules" if read == "input.structure" else "tensors"
        return Change(
            read,
            (prev.get("digest") or "")[:12],
            f"{(cur.get('digest') or '')[:12]} ({len(changed)} {label} changed: {shown or 'root'})",
        )
    return Change(read, prev.get("value"), cur.get("value"))


class LazyOutputs(Mapping[str, Any]):
    """Stage outputs by name, loaded from the cache only when asked for."""

    def __init__(self, run: _Run, names: Iterable[str]):
        self._run = run
        self._names = [
            n
            for n in names
            if run.states[n].record.status in (StageStatus.RAN, StageStatus.HIT, StageStatus.CUTOFF)
        ]

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        return self._run.load(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass
class RunResult:
    """What ``Pipeline.run`` returns: lazily loaded ``outputs`` of every stage, the
    ``captured`` ones (``capture_stage_output=True``), and the ``report``. A run with
    ``background_writes`` may still be storing outputs: :meth:`wait_for_cache` waits for
    that (and raises what a write raised)."""

    outputs: Mapping[str, Any]
    captured: Mapping[str, Any]
    report: RunReport
    _finish: Callable[[], None] | None = field(default=None, repr=False)

    def wait_for_cache(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


def run_pipeline(
    pipeline: Pipeline,
    pipeline_input: Any,
    samples: Any,
    *,
    context: Mapping[str, Any],
    cache: Cache | None,
    force: Iterable[str] | bool = (),
    listeners: Iterable[Callable[[StageEvent], None]] = (),
    run_id: str = "pipeline",
    check: Iterable[str] | bool = (),
    background_writes: bool = False,
) -> RunResult:
    """Run ``pipeline``; raises :class:`StageError` (with ``.report``) when a stage fails.
    Stages named in ``check`` (or all, with True) are recomputed even on a hit and must
    reproduce the cached output. Outputs are stored in the cache on a background thread;
    unless ``background_writes``, the call returns once they are stored (with it, the
    caller overlaps its own work and then calls ``RunResult.wait_for_cache``)."""
    run = _Run(pipeline, pipeline_input, samples, context, cache, force, listeners, run_id, check)
    try:
        with check_mode(bool(run.check)):  # reused values and digests are recomputed too
            if run.check:
                verify_reused_digests()
            report = run.run()
    except BaseException:
        run.finish_writes()
        raise
    if run.failure is not None or not background_writes:
        run.finish_writes()
    if run.failure is not None:
        run.failure.report = report  # type: ignore[attr-defined]
        raise run.failure
    captured = [n for n in run.order if pipeline._stage(n).capture_output]
    finish = run.finish_writes if background_writes else None
    return RunResult(LazyOutputs(run, run.order), LazyOutputs(run, captured), report, finish)


def plan_status(
    pipeline: Pipeline,
    pipeline_input: Any,
    samples: Any,
    *,
    context: Mapping[str, Any],
    cache: Cache | None,
    run_id: str = "pipeline",
) -> RunReport:
    """What a run would do, without running anything: each stage ``hit`` or ``dirty`` with
    the reason. A stage downstream of a dirty one is ``maybe``: whether it reruns depends on
    the upstream output (early cutoff)."""
    run = _Run(pipeline, pipeline_input, samples, context, cache, (), (), run_id)
    for name in run.order:
        st = _State(StageRecord(name), plan_reads(pipeline, name, context))
        run.states[name] = st
        deps = pipeline.dependencies(name)
        if any(run.states[d].record.status in (StageStatus.DIRTY, StageStatus.MAYBE) for d in deps):
            st.record.status = StageStatus.MAYBE
            st.record.reason = "depends on a dirty stage (reruns unless its output is unchanged)"
            continue
        key = run.compute_key(name)
        st.record.key = key
        manifest = cache.lookup(key, count=False) if cache is not None and key else None
        stale = run.stale_codecs(manifest) if manifest is not None else []
        if stale:
            st.record.status, st.record.reason = StageStatus.DIRTY, _stale_reason(stale)
            continue
        if manifest is not None:
            st.record.status, st.record.digest = StageStatus.HIT, manifest["artifact"]["digest"]
            continue
        st.record.status = StageStatus.DIRTY
        st.record.reason, st.record.changes = run._why(name, key, None)
    return RunReport(run_id, [run.states[n].record for n in run.order])
