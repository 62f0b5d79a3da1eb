"""Fingerprints: the facets of a pipeline input, options and code, as digests.

``fingerprint(value)`` turns a value into a canonical JSON-able form, one registration per
type (``functools.singledispatch``). Facets of the pipeline input (``structure``, ``state``,
``samples.spec``, ``samples.values``) are computed lazily, at most once per run, by
:class:`InputFacets`. Anything that cannot be fingerprinted raises :class:`FingerprintError`
naming the value's path; callers turn that into "always rerun, because ...", never a stale hit.

One concern a module: ``walk`` (the dispatch and its walk), the registrations by family
(``values``, ``callables``, ``torch_values``, ``numpy_values``), ``tensors`` (tensor and state
digests), ``structure`` (the module tree), ``code`` (code versions), ``registries``,
``readings`` and ``facets``. The names users import are re-exported here.
"""

from graphbuild.engine.closure import function_files
from graphbuild.engine.fingerprint import (  # noqa: F401  (loaded for their registrations)
    callables,
    numpy_values,
    torch_values,
    values,
)
from graphbuild.engine.fingerprint.code import (
    callable_version,
    code_fingerprint,
    code_identity,
    stage_code_version,
)
from graphbuild.engine.fingerprint.facets import InputFacets
from graphbuild.engine.fingerprint.readings import Reading, read_value
from graphbuild.engine.fingerprint.registries import read_registry, register_registry
from graphbuild.engine.fingerprint.structure import StructureFingerprint, structure_fingerprint
from graphbuild.engine.fingerprint.tensors import (
    DEVICE_CHUNK,
    PARALLEL_BYTES,
    StateDigests,
    content_tokens,
    input_token,
    state_digests,
    tensor_bytes,
    tensor_digest,
    tensor_digests,
    verify_reused_digests,
)
from graphbuild.engine.fingerprint.walk import (
    VOLATILE_ATTRIBUTES,
    fingerprint,
    fingerprint_type,
    ignore_attribute,
    mark_builtin_fingerprints,
    stable_text,
    volatile_attributes,
)
from graphbuild.engine.pipeline import FACETS

mark_builtin_fingerprints()

__all__ = [
    "DEVICE_CHUNK",
    "FACETS",
    "PARALLEL_BYTES",
    "VOLATILE_ATTRIBUTES",
    "InputFacets",
    "Reading",
    "StateDigests",
    "StructureFingerprint",
    "callable_version",
    "code_fingerprint",
    "code_identity",
    "content_tokens",
    "fingerprint",
    "fingerprint_type",
    "function_files",
    "ignore_attribute",
    "input_token",
    "read_registry",
    "read_value",
    "register_registry",
    "stable_text",
    "stage_code_version",
    "state_digests",
    "structure_fingerprint",
    "tensor_bytes",
    "tensor_digest",
    "tensor_digests",
    "verify_reused_digests",
    "volatile_attributes",
]
