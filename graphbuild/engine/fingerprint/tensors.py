"""Tensor digests: a tensor's bytes, its digest wherever it lives, a model's state.

``tensor_digest`` is xxh3-128 of a tensor's memory; ``state_digests`` digests every parameter
and buffer (tied tensors once, distinct ones in parallel, reused where
:mod:`~graphbuild.engine.digest_memo` allows); ``content_tokens`` and ``input_token`` are what
the input-mutation guard compares before and after a stage.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphbuild.engine import digest_memo
from graphbuild.engine.checking import checking, reused_mismatch
from graphbuild.engine.parallel import parallel_map
from graphbuild.errors import FingerprintError
from graphbuild.hashing import Hasher, digest_bytes, digest_json


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a flat buffer, without a copy when it is contiguous on the CPU."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(_byte_view(t).numpy())


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a flat uint8 tensor on its own device (copied only where ``t`` is
    not contiguous)."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_quantized or t.layout != torch.strided:
        raise FingerprintError(f"cannot read the bytes of a {t.layout} / quantized tensor")
    flat = t.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # one element seen through a zero stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat


def tensor_digest(tensor: torch.Tensor) -> str:
    """xxh3-128 of the tensor's memory (not of its dtype and shape).

    The same digest wherever the tensor lives: a tensor on an accelerator is streamed through
    a reused (pinned, on CUDA) host buffer in chunks, never copied to the host whole.
    """
    if tensor.device.type == "meta":
        raise FingerprintError("a meta tensor has no values to fingerprint")
    if tensor.device.type != "cpu" and tensor.numel() * tensor.element_size() > DEVICE_CHUNK:
        return _streamed_digest(tensor)
    return digest_bytes(tensor_bytes(tensor))


def content_tokens(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    """A token of each tensor's contents: equal before and after a stage runs unless the
    values it holds changed, however they were written (``add_``, through ``.data`` or a
    numpy view, which torch's version counter does not see). A digest of the memory the
    tensor reads (xxh3, several GB/s; big tensors on a thread per core) and its layout.

    A zero-stride tensor (a placeholder) is read through its storage, which is one element;
    a tensor with no memory to read (meta, sparse) is known by identity and version only."""
    tokens: list[tuple | None] = [None] * len(tensors)
    direct: list[int] = []
    for i, t in enumerate(tensors):
        small = _small_cpu_digest(t)
        if small is not None:  # most of a quant map's: read in place, one call each
            tokens[i] = ("values", small, str(t.dtype), tuple(t.shape))
            continue
        layout = (str(t.dtype), tuple(t.shape), tuple(t.stride()), t.storage_offset())
        if t.layout != torch.strided or t.device.type == "meta" or t.is_quantized:
            tokens[i] = ("opaque", id(t), t._version, t.data_ptr(), *layout)
        elif t.is_contiguous():
            direct.append(i)
        else:
            storage = t.untyped_storage()
            view_bytes = t.numel() * t.element_size()
            if storage.nbytes() <= view_bytes:  # expanded or overlapping: read the storage
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                tokens[i] = ("storage", tensor_digest(whole), *layout)
            else:
                direct.append(i)
    digests = tensor_digests([tensors[i] for i in direct])
    for i, d in zip(direct, digests, strict=True):
        t = tensors[i]
        tokens[i] = ("values", d, str(t.dtype), tuple(t.shape))
    return tokens  # type: ignore[return-value]


#: Below this many bytes a contiguous CPU tensor's token is its digest taken in place.
SMALL_BYTES = 1 << 20


def _small_cpu_digest(t: torch.Tensor) -> str | None:
    """``tensor_digest`` of a small contiguous CPU tensor numpy can view, without the general
    path's per-tensor steps (a flat byte view, the digest memo); None for any other."""
    if (
        t.device.type != "cpu"
        or t.layout != torch.strided
        or t.is_quantized
        or not t.is_contiguous()
        or t.numel() * t.element_size() > SMALL_BYTES
        or t.dtype not in _NUMPY_VIEWABLE
    ):
        return None
    return digest_bytes(t.detach().numpy())


_NUMPY_VIEWABLE = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)


def input_token(value: Any, *, full: bool = False) -> Any:
    """A token of the pipeline input, to tell whether a stage changed it in place. For a
    model: every parameter and buffer by identity, address and version counter (cheap,
    whatever the model's size); with ``full``, also a digest of every tensor, which sees
    writes through ``.data`` or numpy views too (check mode). Any other input: its
    codec's token."""
    if not isinstance(value, torch.nn.Module):
        from graphbuild.engine.codecs import snapshot

        return snapshot(value)
    named = [*value.named_parameters(remove_duplicate=False)]
    named += [*value.named_buffers(remove_duplicate=False)]
    token: list[Any] = [
        (n, id(t), t._version, t.data_ptr() if t.device.type != "meta" else 0)
        for n, t in named
        if t is not None
    ]
    if full:
        token.append(state_digests(value).digest)
    return token


#: Bytes per device-to-host copy when hashing a tensor off the CPU.
DEVICE_CHUNK = 32 << 20


class _StagingBuffers(threading.local):
    def __init__(self) -> None:
        self.by_device: dict[str, torch.Tensor] = {}


_STAGING = _StagingBuffers()


def _staging_buffer(device: torch.device) -> torch.Tensor:
    """A host buffer of DEVICE_CHUNK bytes for copies from ``device``, made once per thread."""
    buffer = _STAGING.by_device.get(device.type)
    if buffer is None:
        pin = device.type == "cuda"
        buffer = torch.empty(DEVICE_CHUNK, dtype=torch.uint8, pin_memory=pin)
        _STAGING.by_device[device.type] = buffer
    return buffer


def _streamed_digest(tensor: torch.Tensor) -> str:
    t = tensor.detach()
    flat = _byte_view(t)  # on the device
    staging = _staging_buffer(t.device)
    hasher = Hasher()
    for start in range(0, flat.numel(), DEVICE_CHUNK):
        chunk = flat[start : start + DEVICE_CHUNK]
        host = staging[: chunk.numel()]
        host.copy_(chunk)
        hasher.update(memoryview(host.numpy()))
    return hasher.hexdigest()


@dataclass(frozen=True)
class StateDigests:
    """One digest per parameter and buffer name, and one over all of them."""

    digest: str
    tensors: dict[str, str]


def state_digests(module: torch.nn.Module) -> StateDigests:
    """Digest every parameter and buffer; tied tensors (same memory) are hashed once, and
    distinct tensors in parallel (``tensor_digests``)."""
    named = [*module.named_parameters(remove_duplicate=False)]
    named += [*module.named_buffers(remove_duplicate=False)]
    idents: dict[str, tuple] = {}
    unique: dict[tuple, torch.Tensor] = {}
    for name, t in named:
        if t is None or t.device.type == "meta" or t.numel() == 0:
            continue
        ident = (t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        idents[name] = ident
        unique.setdefault(ident, t)
    digests = dict(zip(unique, tensor_digests(list(unique.values()), reuse=True), strict=True))
    out: dict[str, str] = {}
    for name, t in named:
        if t is None:
            continue
        d = digests[idents[name]] if name in idents else f"empty:{t.device.type}"
        out[name] = f"{t.dtype}{list(t.shape)}:{d}"
    return StateDigests(digest_json(sorted(out.items())), out)


#: Below this many bytes in all, tensors are hashed one after the other.
PARALLEL_BYTES = 64 << 20


def tensor_digests(tensors: Sequence[torch.Tensor], *, reuse: bool = False) -> list[str]:
    """``tensor_digest`` of each tensor, spread over a thread per core when there is enough to
    hash: xxhash releases the GIL, so a model's weights hash at the speed of all cores. Tensors
    off the CPU go one at a time (they share a staging buffer per thread).

    With ``reuse`` (the model's state, read for keys), a tensor whose digest this process
    computed before, and which is untouched since by what torch's version counter sees, is
    not hashed again where :mod:`digest_memo`'s rule allows it. Check mode reuses nothing
    (:func:`verify_reused_digests` has checked what would be reused before the run). Without
    ``reuse`` (content tokens, which exist to see writes the version counter misses), every
    tensor is hashed.
    """
    known = [digest_memo.lookup(t) if reuse and not checking() else None for t in tensors]
    todo = [t for t, d in zip(tensors, known, strict=True) if d is None]
    computed = iter(_hash_all(todo))
    out = []
    for t, reused in zip(tensors, known, strict=True):
        if reused is not None:
            out.append(reused)
            continue
        digest = next(computed)
        digest_memo.remember(t, digest)
        out.append(digest)
    return out


def verify_reused_digests() -> None:
    """Check mode, before a run: hash every tensor whose digest this process would reuse
    (:mod:`digest_memo`) and fail loudly, naming the rule, where one is wrong."""
    reusable = digest_memo.reusable()
    computed = _hash_all([t for t, _ in reusable])
    for (t, reused), digest in zip(reusable, computed, strict=True):
        if reused != digest:
            raise reused_mismatch(
                f"tensor {t.dtype}{list(t.shape)}",
                reused,
                digest,
                "it was written without torch's version counter seeing it (through .data, a "
                "numpy view or another buffer) after an earlier run hashed it; such writes "
                "need graphbuild.engine.digest_memo.reuse_across_runs(False)",
            )
        digest_memo.remember(t, digest)


def _hash_all(tensors: Sequence[torch.Tensor]) -> list[str]:
    total = sum(t.numel() * t.element_size() for t in tensors)
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    parallel = total >= PARALLEL_BYTES and on_cpu
    return parallel_map(tensor_digest, tensors, parallel=parallel)
