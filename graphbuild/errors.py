"""Typed errors. Library code raises these; only the CLI turns them into exit codes."""

from __future__ import annotations


class GraphbuildError(Exception):
    """Base class of every error graphbuild raises on purpose."""


class ReportedWarning(UserWarning):
    """A warning the run's report also carries (coverage's degenerate ranges): the command
    line prints it from the report, so it is not printed a second time as a warning."""


class IgnoredConfigWarning(UserWarning):
    """A key of a shared configuration file the exported target does not take (another
    target's preset or option): left out of the export, and said once."""


class ConfigError(GraphbuildError):
    """Bad configuration or usage: a missing file, an unknown key, a wrong type."""


class PipelineError(GraphbuildError, ValueError):
    """A pipeline that cannot be built or planned: unknown stage, cycle, bad reads."""


class UndeclaredReadError(GraphbuildError, KeyError):
    """A stage read a context key or input facet it did not declare in ``reads``."""

    def __init__(self, stage: str, key: str, declared: tuple[str, ...]):
        self.stage, self.key, self.declared = stage, key, declared
        shown = ", ".join(declared) if declared else "nothing"
        super().__init__(
            f"stage '{stage}' read '{key}' but declares only: {shown}. "
            f"Add '{key}' to the stage's reads= so its cache key covers it."
        )

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class FingerprintError(GraphbuildError, TypeError):
    """A value graphbuild does not know how to fingerprint."""


class FingerprintMismatchError(GraphbuildError):
    """Check mode: a stage that hit the cache produced a different output when recomputed."""


class KeyMismatchError(GraphbuildError):
    """A process asked to build a stage under a key computed elsewhere computes another key
    for it: it does not have the same model, samples, options or code (an unseeded model
    factory, an option read from the environment, another checkout)."""


class InputMutationError(GraphbuildError):
    """A stage changed an upstream output in place instead of returning a new value."""

    def __init__(
        self,
        stage: str,
        upstream: str,
        how: str = "changed it in place",
        *,
        what: str | None = None,
    ):
        self.stage, self.upstream = stage, upstream
        what = what or f"the output of '{upstream}'"
        super().__init__(
            f"stage '{stage}' {how}: {what} it was given is shared with the cache and with "
            "other stages. Copy it first and change the copy (copy.deepcopy(program), or "
            "build a new graph) and return that."
        )


class BufferMutationError(InputMutationError):
    """The model's ``forward`` changes buffers in place (a counter, a running-statistics
    update): quantizing runs ``forward`` on the calibration batches, which would change the
    model it was given. Raised before anything runs the model; ``buffers`` are their names."""

    def __init__(self, buffers: tuple[str, ...]):
        self.stage, self.upstream, self.buffers = None, "input", tuple(buffers)
        names = ", ".join(f"'{b}'" for b in self.buffers)
        plural = "s" if len(self.buffers) > 1 else ""
        GraphbuildError.__init__(
            self,
            f"the model's forward changes buffer{plural} {names} in place (such as "
            "self.count += 1, or a running-statistics update): quantizing runs forward on the "
            "calibration batches, which would change the model it was given and the values it "
            "exports. Make the update conditional on training (if self.training: ...) and "
            "export the model in eval mode (model.eval()), or compute the value without "
            "storing it in the buffer (keep it in a local or return it).",
        )


class CodecError(GraphbuildError, TypeError):
    """A stage output whose type has no registered artifact codec."""


class StageError(GraphbuildError):
    """A stage raised; carries the stage name and the stages that ran before it."""

    #: Stages that ran before, named in the message up to this many; past it, the count and
    #: the last three.
    NAMED = 8

    def __init__(self, stage: str, cause: BaseException, ran_before: tuple[str, ...] = ()):
        self.stage, self.cause, self.ran_before = stage, cause, ran_before
        super().__init__(self.describe(str(cause)))

    def describe(self, reason: str) -> str:
        """The message with ``reason`` for the cause's own (e.g. its first line only)."""
        ran = self.ran_before
        if len(ran) > self.NAMED:  # an LLM's cold export runs hundreds
            before = f" (after {len(ran)} stages, the last: {', '.join(ran[-3:])})"
        else:
            before = f" (after: {', '.join(ran)})" if ran else ""
        return f"stage '{self.stage}' failed{before}: {type(self.cause).__name__}: {reason}"


class CacheError(GraphbuildError):
    """A cache that cannot be opened or used at all."""


class ExportError(GraphbuildError):
    """An export request that cannot be honoured (unknown target, bad model name...)."""


class ArgumentTypeError(ExportError, TypeError):
    """An argument of the Python API of the wrong type (``output_directory=7``): the message
    names the argument, what it takes and what it got, before any stage runs."""


class UnknownQuantizerError(ExportError):
    """A quantization op in the graph that no recogniser handles."""


class SkeletonValueError(ExportError):
    """The ONNX skeleton would depend on weight values (breaks structure/value separation)."""


class CoverageError(ExportError):
    """``strict_coverage``: a tensor QNN HTP runs quantized is float (or quantized otherwise)."""


class NumericsError(ExportError):
    """The exported model disagrees with the torch model beyond tolerance."""


class VulkanDeviceError(ExportError):
    """No Vulkan device with Arm's ML extensions to run a VGF delegate on (``executorch/vgf``'s
    numerics check): the message says what to install."""
