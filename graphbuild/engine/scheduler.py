"""The scheduler and rebuilder: which stages run, in which order, and why.

A topological scheduler with constructive traces: each stage's key hashes its code, its
declared reads and the digests of its upstream outputs (:mod:`~graphbuild.engine.keying`); a
key with a valid cache entry is a hit and nothing is loaded unless a dirty dependent needs it
(laziness). A stage that reruns and reproduces its previous output digest leaves its
dependents clean (early cutoff), because dependents key on output digests, not on upstream
keys. Planning without running is :mod:`~graphbuild.engine.plan`; the guards around a running
stage are :mod:`~graphbuild.engine.guard`, the background writes
:mod:`~graphbuild.engine.writer`, the events and report :mod:`~graphbuild.engine.events`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import networkx as nx

from graphbuild.cache.manifest import bytes_stored
from graphbuild.engine import digest_memo, release, source_memo
from graphbuild.engine.artifact_store import Cache, CorruptEntry
from graphbuild.engine.checking import check_mode
from graphbuild.engine.codecs import encode
from graphbuild.engine.concurrent import record_timeline, run_concurrently
from graphbuild.engine.events import Change, EventKind, RunReport, StageEvent, StageRecord
from graphbuild.engine.explain import explain_changes
from graphbuild.engine.fingerprint import InputFacets, verify_reused_digests
from graphbuild.engine.gc_scope import collecting_what_the_run_allocates
from graphbuild.engine.guard import InputToken, StageContext, Tokens, check_inputs, input_tokens
from graphbuild.engine.keying import Keys, plan_reads
from graphbuild.engine.outputs import LazyOutputs, RunResult
from graphbuild.engine.rebuild import decide
from graphbuild.engine.release import Readers
from graphbuild.engine.status import StageStatus
from graphbuild.engine.toolchain import codec_files, codec_names, toolchain_versions
from graphbuild.engine.writer import CacheWriter
from graphbuild.errors import (
    FingerprintMismatchError,
    GraphbuildError,
    InputMutationError,
    KeyMismatchError,
    StageError,
)

if TYPE_CHECKING:
    from graphbuild.cache.leases import Lease
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
    "codec_files",
    "explain_changes",
]


def _no_lock(*_: Any) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


class _Run:
    """One build of one pipeline: the scheduler's loop and lazy loading. It holds the
    pipeline's :class:`Keys` (each stage's key and readings) and asks the rebuilder's decision
    (:func:`~graphbuild.engine.rebuild.decide`) whether a key's entry serves."""

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
        targets: Iterable[str] | None = None,
        expect_keys: Mapping[str, str] | None = None,
        facets: InputFacets | None = None,
        jobs: int = 1,
        memory: int | None = None,
    ):
        order = pipeline.order()
        self.force_all = force is True
        self.force = set() if isinstance(force, bool) else set(force)
        unknown = self.force - set(order)
        if unknown:
            raise KeyError(f"cannot force unknown stage(s): {', '.join(sorted(unknown))}")
        self.check = set(order) if check is True else set(check or ()) & set(order)
        self.keys = Keys(pipeline, pipeline_input, samples, context, cache, run_id, facets)
        self.pipeline, self.cache, self.run_id = pipeline, cache, run_id
        self.input, self.samples, self.context = pipeline_input, samples, self.keys.context
        self.states = self.keys.states
        self.order = list(self.keys.order)
        # ``targets``: these stages and what they need, nothing else. What they need is
        # read, not built for the user: its hits are not counted nor recorded for explain
        self.targets = set(targets) if targets is not None else None
        if self.targets is not None:
            wanted = set(self.targets)
            for name in list(wanted):
                pipeline._stage(name)
                wanted |= nx.ancestors(pipeline.graph, name)
            self.order = [n for n in self.order if n in wanted]
        self.expect_keys = dict(expect_keys or {})
        self.listeners = list(listeners)
        self.writer = CacheWriter(cache) if cache is not None else None
        self.ran_order: list[str] = []
        self.failure: StageError | None = None  # the last in the order, as run() ends
        self.failures: dict[str, StageError] = {}
        # set when a stage edited an upstream output in place: that value is no longer what
        # its digest says, so no other stage may read it; the run stops
        self.stopped: str | None = None
        self.tokens = Tokens()  # the input guard's tokens, reused from stage to stage
        self.jobs, self.memory = jobs, memory
        # sequential: no lock to leave while a stage computes, none per stage to take;
        # :func:`~graphbuild.engine.concurrent.run_concurrently` installs real ones
        self.unlocked: Callable[[], contextlib.AbstractContextManager[Any]] = _no_lock
        self.stage_lock: Callable[[str], contextlib.AbstractContextManager[Any]] = _no_lock
        self.timeline: list[dict[str, Any]] = []  # filled by the concurrent runner
        self.readers = Readers(pipeline.graph, self.order)  # what let_go may drop

    def emit(self, event: StageEvent) -> None:
        for listener in self.listeners:
            listener(event)

    # ----------------------------------------------------------------- main loop

    def run(self) -> RunReport:
        t0 = time.perf_counter()
        if self.jobs > 1:
            run_concurrently(self, self.jobs, self.memory)
        else:
            for name in self.order:
                start = time.perf_counter() - t0
                self.step(name)
                self.let_go(name)
                record_timeline(self, name, start, time.perf_counter() - t0)
        return RunReport(
            self.run_id,
            [self.states[n].record for n in self.order],
            time.perf_counter() - t0,
            timeline=self.timeline,
        )

    def step(self, name: str) -> None:
        """Settle stage ``name`` (its upstream stages settled): skipped, a hit, or run."""
        st = self.keys.begin(name)
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
            return
        if blocked:
            st.record.status = StageStatus.SKIPPED
            st.record.reason = f"upstream '{blocked[0]}' did not complete"
            self.emit(StageEvent(EventKind.SKIPPED, name, reason=st.record.reason))
            return
        key = self.keys.compute_key(name)
        st.record.key = key
        self._check_expected(name, key)
        if self.cache is None or key is None or self._forced(name):
            self._execute(name)
            return
        claimed = self._claim(name, key)
        if claimed is None:  # a hit: now, or once another process built it
            if name in self.check:
                self._check_hit(name)
            return
        lease, reason = claimed
        self._execute(name, reason=reason, lease=lease)

    def let_go(self, name: str) -> None:
        """Stage ``name`` settled: drop the outputs no stage left in the run reads
        (:func:`.release.let_go`); the concurrent runner calls it under its lock as each
        stage settles."""
        release.let_go(self, name)

    def finish_writes(self) -> None:
        """Wait for the cache writes of this run, then keep the cache within its size."""
        if self.writer is not None:
            self.writer.finish()
            self.cache.enforce_limit()  # type: ignore[union-attr]

    def _forced(self, name: str) -> bool:
        return self.force_all or name in self.force

    def _targeted(self, name: str) -> bool:
        """Whether the run builds ``name`` for its caller (not only as an input of one)."""
        return self.targets is None or name in self.targets

    def _check_expected(self, name: str, key: str | None) -> None:
        expected = self.expect_keys.get(name)
        if expected is not None and key != expected:
            raise KeyMismatchError(
                f"stage '{name}' has key {key or '(uncacheable)'} in this process but "
                f"{expected} where it was planned: this process does not build the same "
                "model, samples, options or code (an unseeded model factory, a value read "
                "from the environment, another checkout?); `graphbuild explain` in each "
                "shows what differs"
            )

    def _claim(self, name: str, key: str) -> tuple[Lease, str | None] | None:
        """None once the entry under ``key`` serves (a hit, recorded): at once, or after
        waiting while another process held the lease on building it. Else the lease to build
        under, with why the entry there does not serve (a stale codec; None: no entry). A
        holder that dies stops renewing; its lease expires and this run takes it over."""
        assert self.cache is not None
        lease: Lease | None = None
        waited_for: str | None = None
        pause = 0.02
        while True:
            first = lease is None and waited_for is None
            found = decide(self.cache, key, self.keys, count=first and self._targeted(name))
            if found.hit:
                if lease is not None:  # written while this run asked for the lease
                    lease.release()
                if not first:  # the lookups while asking and waiting count nothing
                    self.cache.lookup(key)
                self._hit(name, found.manifest)  # type: ignore[arg-type]
                if waited_for is not None:
                    self.states[name].record.reason = f"built by {waited_for} while this run waited"
                return None
            if lease is not None:
                return lease, found.reason
            lease = self.cache.try_lease(key)
            if lease is None:
                holder = self.cache.lease_holder(key) or "another process"
                if waited_for is None:
                    waited_for = holder
                    self.emit(
                        StageEvent(EventKind.WAITING, name, key, reason=f"{holder} is building it")
                    )
                with self.unlocked():
                    time.sleep(pause)
                pause = min(pause * 1.5, 0.25)

    def _recompute(self, name: str) -> tuple[Any, str]:
        """Run a stage whose key hit on its (loaded) inputs, guarded as :meth:`_execute`
        guards it: its value and that value's digest."""
        stage = self.pipeline._stage(name)
        inputs = self._inputs(name)
        ctx = self._context(name, stage, self.states[name].reads)
        value = self._call(name, stage, inputs, ctx)
        deps = self.pipeline.dependencies(name)
        # inputs recomputed for this call alone: the input guard is not to hold them either
        if deps:
            released = zip(deps, inputs, strict=True)
            self.tokens.forget(v for d, v in released if self.states[d].released)
        return value, encode(value).digest

    def _call(self, name: str, stage: Any, inputs: Any, ctx: StageContext) -> Any:
        """``stage``'s function on ``inputs``, guarded: an undeclared read it caught is raised
        again, and inputs it changed are an :class:`InputMutationError`."""
        before = self._snapshots(name, inputs, ctx)
        try:
            with self.unlocked():
                value = stage.fn(inputs, self.samples, ctx)
        except BaseException:
            self.tokens.forget(t.value for t in before)
            raise
        if ctx.violation is not None:  # read undeclared, then caught the error
            raise ctx.violation
        self._check_inputs(name, before)
        return value

    def _check_hit(self, name: str) -> None:
        """Check mode: recompute a hit and fail loudly if its output differs from the cached
        one, which means the stage reads something its key does not cover."""
        st = self.states[name]
        rec = st.record
        stage = self.pipeline._stage(name)
        t0 = time.perf_counter()
        try:
            value, digest = self._recompute(name)
        except InputMutationError as err:
            self._fail(name, err, t0)
            return
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:
            digest, value = None, err
        if digest == rec.digest:
            rec.reason = "checked: recomputed output matches the cache"
            if not st.has_value:  # what a load would give: no second load or rematerialization
                st.value, st.has_value = value, True
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
        self._fail(name, err, t0)

    def _fail(self, name: str, err: Exception, t0: float) -> StageError:
        """Record that stage ``name`` failed with ``err`` after starting at ``t0`` (however it
        ran: built, recomputed to check a hit, or to rematerialize one): its record, the
        run's failure and the event. A stage that changed an input in place stops the run."""
        rec = self.states[name].record
        rec.status, rec.error = StageStatus.FAILED, f"{type(err).__name__}: {err}"
        rec.seconds = time.perf_counter() - t0
        if isinstance(err, InputMutationError):
            self.stopped = name
        self.failure = self.failures[name] = StageError(name, err, tuple(self.ran_order))
        self.emit(StageEvent(EventKind.FAILED, name, rec.key, rec.seconds, rec.reason, err))
        return self.failure

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
        if self.states[name].has_value:
            return self.states[name].value
        with self.stage_lock(name):  # one thread loads it; the others wait for its value
            return self._load(name)

    def _load(self, name: str) -> Any:
        st = self.states[name]
        if st.has_value:
            return st.value
        if st.released:  # recomputed for this read, let go again afterwards
            return self._rematerialize(name, keep=False)
        if st.spilled:  # read back for this read, let go again afterwards
            return release.read_back(self, name)
        if st.manifest is None:
            raise GraphbuildError(f"stage '{name}' has no output (status {st.record.status})")
        if not bytes_stored(st.manifest["artifact"]):
            return self._rematerialize(name)
        t0 = time.perf_counter()
        try:
            with self.unlocked():
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

    def _rematerialize(self, name: str, keep: bool = True) -> Any:
        """The value of a hit whose entry keeps the digest, not the bytes (or of a stage
        whose output the run let go): the stage runs again on its inputs and must give the
        digest its entry records (a stage that does not is not a function of its key, and
        fails here rather than place another output). ``keep``: hold the value for later
        reads."""
        st = self.states[name]
        rec = st.record
        t0 = time.perf_counter()
        try:
            value, digest = self._recompute(name)
            if digest != rec.digest:
                raise FingerprintMismatchError(
                    f"stage '{name}' keeps its output's digest in the cache, not its bytes, and "
                    f"recomputing it gave another output ({(rec.digest or '')[:12]} recorded, "
                    f"{digest[:12]} now): it reads something its key does not cover (find it "
                    "with --check-fingerprints)"
                )
        except (StageError, KeyboardInterrupt, SystemExit):
            raise  # an upstream's own failure, already recorded
        except Exception as err:
            raise self._fail(name, err, t0) from err
        if keep:
            st.value, st.has_value = value, True
        why = "recomputed: its cache entry keeps the output's digest, not its bytes"
        self.emit(StageEvent(EventKind.LOADED, name, rec.key, time.perf_counter() - t0, why))
        return value

    def _inputs(self, name: str) -> Any:
        deps = self.pipeline.dependencies(name)
        if not deps:
            return self.input
        return tuple(self.load(d) for d in deps)

    def _execute(self, name: str, reason: str | None = None, lease: Lease | None = None) -> None:
        try:
            stored = self._execute_stage(name, reason, lease)
        finally:
            if lease is not None and not stored:
                lease.release()

    def _execute_stage(self, name: str, reason: str | None, lease: Lease | None) -> bool:
        """Run stage ``name``; True when its output was handed to the cache writer (which
        then releases ``lease`` once the entry is written)."""
        st = self.states[name]
        stage = self.pipeline._stage(name)
        rec = st.record
        try:
            inputs = self._inputs(name)
        except StageError:
            rec.status, rec.reason = StageStatus.SKIPPED, "an upstream rebuild failed"
            return False
        old_upstream = list(st.upstream)
        key = self.keys.compute_key(name)
        if st.upstream != old_upstream:
            rec.key = key
        rec.reason, rec.changes = self._why(name, key, reason)
        self.emit(StageEvent(EventKind.STARTED, name, key, reason=rec.reason))
        ctx = self._context(name, stage, st.reads)
        t0 = time.perf_counter()
        try:
            value = self._call(name, stage, inputs, ctx)
            with self.unlocked():
                encoded = encode(value)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:
            self._fail(name, err, t0)
            return False
        rec.seconds = time.perf_counter() - t0
        st.value, st.has_value = value, True
        rec.digest, rec.bytes, rec.status = encoded.digest, encoded.size, StageStatus.RAN
        self.ran_order.append(name)
        stored = False
        if self.cache is not None:
            self.cache.count_miss()
            if key is not None:
                record = self._manifest_record(name, encoded)
                after = lease.release if lease is not None else None
                self.writer.submit(  # type: ignore[union-attr]
                    key, encoded, record, after, keep_bytes=not stage.rematerialize
                )
                stored = True
                st.stored = not stage.rematerialize
        self._remember(name)
        self.emit(StageEvent(EventKind.RAN, name, key, rec.seconds, rec.reason))
        return stored

    def _snapshots(self, name: str, inputs: Any, ctx: StageContext) -> list[InputToken]:
        deps = self.pipeline.dependencies(name)
        return input_tokens(
            deps, inputs, self.samples, self.input, ctx.input_allowed, bool(self.check), self.tokens
        )

    def _check_inputs(self, name: str, before: list[InputToken]) -> None:
        check_inputs(
            name, before, bool(self.check), lambda dep: self.states[dep].record.digest, self.tokens
        )

    def _context(self, name: str, stage: Stage, reads: tuple[str, ...]) -> StageContext:
        allowed = None if stage.reads is None else {r[4:] for r in reads if r.startswith("ctx.")}
        root = not self.pipeline.dependencies(name)
        input_allowed = any(r.startswith("input.") for r in reads) or (stage.reads is None and root)
        return StageContext(
            name, self.context, allowed, stage.reads or (), self.input, input_allowed
        )

    # ----------------------------------------------------------------- records & reasons

    def _manifest_record(self, name: str, encoded: Any = None) -> dict[str, Any]:
        st = self.states[name]
        codecs = self.keys.codec_versions(codec_names(encoded.describe())) if encoded else {}
        return {
            "codecs": codecs,
            "stage": name,
            "pipeline": self.run_id,
            "seconds": st.record.seconds,
            "code": st.code,
            "reads": {r: rd.digest for r, rd in st.readings.items()},
            "upstream": st.upstream,
            "toolchain": self.keys.toolchain,
        }

    def _remember(self, name: str) -> None:
        if self.cache is None or not self._targeted(name):
            return
        last = self.keys.last(name)
        rec = self.states[name].record
        if last and last.get("key") == rec.key and last.get("digest") == rec.digest:
            return
        snap = self.keys.snapshot(name)
        snap.update(status=rec.status, when=time.time(), seconds=rec.seconds, reason=rec.reason)
        snap["changes"] = [[c.read, c.old, c.new] for c in rec.changes]  # why it ran: explain
        self.cache.record_run(self.run_id, name, snap)

    def _why(self, name: str, key: str | None, reason: str | None) -> tuple[str, list[Change]]:
        if reason:
            return reason, []
        if key is not None and self._forced(name):
            return "forced", []
        return self.keys.why(name, key)


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
    targets: Iterable[str] | None = None,
    expect_keys: Mapping[str, str] | None = None,
    facets: InputFacets | None = None,
    jobs: int = 1,
    memory: int | None = None,
) -> RunResult:
    """Run ``pipeline``; raises :class:`StageError` (with ``.report``) when a stage fails.
    Stages named in ``check`` (or all, with True) are recomputed even on a hit and must
    reproduce the cached output. Outputs are stored in the cache on a background thread;
    unless ``background_writes``, the call returns once they are stored (with it, the
    caller overlaps its own work and then calls ``RunResult.wait_for_cache``).

    ``targets``: build only these stages and what they need. ``expect_keys``: the key each
    named stage must have here (a stage planned by another process), else
    :class:`KeyMismatchError` before anything runs. ``facets``: readings of this input and
    samples to share with other runs over the same, unchanging objects. ``jobs``: stages run
    at once, on threads, those whose upstream stages are done (:mod:`.concurrent`), within
    ``memory`` bytes of what they declare (:meth:`Pipeline.declare_cost`); the keys, outputs
    and report are those of a sequential run."""
    run = _Run(
        pipeline,
        pipeline_input,
        samples,
        context,
        cache,
        force,
        listeners,
        run_id,
        check,
        targets,
        expect_keys,
        facets,
        jobs,
        memory,
    )
    digest_memo.begin_run()  # a tensor is hashed once in the run; earlier digests: see there
    try:
        with check_mode(bool(run.check)), collecting_what_the_run_allocates():
            if run.check:
                verify_reused_digests()
            report = run.run()
    except BaseException:
        run.finish_writes()
        raise
    finally:
        digest_memo.end_run()
        source_memo.use(None)  # the run's cache may be closed once the run is over
    if run.failure is not None or not background_writes:
        run.finish_writes()
    if run.failure is not None:
        run.failure.report = report  # type: ignore[attr-defined]
        raise run.failure
    captured = [n for n in run.order if pipeline._stage(n).capture_output]
    finish = run.finish_writes if background_writes else None
    return RunResult(LazyOutputs(run, run.order), LazyOutputs(run, captured), report, finish)
