"""Which tensors the file holds (the plan) and their bytes (packing).

The plan is structure: for each parameter of the causal LM that llama.cpp has a place for,
its GGUF name, shape and whether its rows are permuted (Llama's RoPE). Packing is values:

- a 1-D tensor (norm weights, biases) is F32, as llama.cpp's converter writes it (the
  model's fake-quantized value where a quantizer acts on it: what the model computes);
- a weight a quantizer of at most 8 bits acts on is Q4_0 or Q8_0 with the model's own
  scale in each block (as float16, the only precision the format has) and the codes the
  model's quantizer computes: per tensor, per output channel, or in blocks of a multiple of
  32 along the row, with codes ``q - z`` in Q4_0's [-8, 7] (else Q8_0's [-128, 127]); any
  other such quantizer is an error that names the tensor and the quantizer. A finer grid
  (16 bits: what a QNN preset gives an embedding table) has no block type: its fake-quantized
  values are stored as ``float_type``, and the report says so;
- with a preset (``q8_0``, ``q4_0``), every 2-D weight is quantized as llama.cpp's own
  quantizer does it (:mod:`.blocks`), whatever quantizers the model has;
- any other 2-D weight is ``float_type`` (F16 by default, as llama.cpp's converter).

Packing is incremental. The tensors are spread over :data:`SHARDS` packing stages, each
keyed by the digests of its own tensors (and its quantizers' values): a weights-only change
reruns the shards holding a changed tensor, in any process, and the cache gives the others.
Within a process, a tensor whose inputs (its state digest, its quantizer's grid and values,
the mode) are those of the shard's previous call is taken from it, neither recomputed nor
hashed again (what ``bind`` does for the ONNX formats).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from graphbuild.engine.parallel import parallel_map
from graphbuild.errors import ExportError
from graphbuild.hashing import digest_bytes, digest_json
from graphbuild.onnx.fakequant import broadcast_qparam, fake_quantize
from graphbuild.quant.quantmap import QParams, QuantMap, QuantSpec, QuantValues
from graphbuild.targets.gguf import blocks
from graphbuild.targets.gguf.adapters import ArchAdapter, source_prefix
from graphbuild.targets.gguf.artifacts import PackedTensor, PackedTensors

#: The widest grid a block type holds (Q8_0); a weight quantized more finely (a 16-bit grid)
#: is stored as its fake-quantized values in ``float_type``.
WIDEST_BLOCK_BITS = 8

#: Packing stages a file's tensors are spread over (see :func:`_assign_shards`).
SHARDS = 4

#: Bytes of weights above which tensors are packed on a thread each.
PARALLEL_PACK_BYTES = 8 << 20


# --------------------------------------------------------------------------- plan


def plan_tensors(
    model: torch.nn.Module, adapter: ArchAdapter, config: Any
) -> tuple[list[dict[str, Any]], list[str]]:
    """(entries, parameters left out): one entry per parameter the file holds, in the
    model's order: ``{"name", "source", "shape", "rope_heads", "aliases", "embedding"}``.
    ``aliases`` are every name of the same parameter (a tied embedding is ``lm_head.weight``
    too: ``torch.export`` gives its uses one name, and a quantizer of one use is told apart
    by the op that reads it); ``embedding``: whether llama.cpp looks tokens up in it."""
    named = list(model.named_parameters(remove_duplicate=False))
    names_of: dict[int, list[str]] = {}
    for name, p in named:
        names_of.setdefault(id(p), []).append(name)
    prefix = source_prefix([n for n, _ in named], adapter)
    entries, left_out, taken = [], [], {}
    for source, param in named:
        if not source.startswith(prefix):
            continue
        name = adapter.gguf_name(source[len(prefix) :])
        if name is None:
            left_out.append(source)
            continue
        if name in taken:
            raise ExportError(
                f"parameters '{taken[name]}' and '{source}' both map to GGUF tensor '{name}'"
            )
        taken[name] = source
        shape = list(param.shape)
        heads = adapter.rope_heads(name, config) if adapter.rope_heads is not None else None
        if heads is not None and shape[0] % (2 * heads):
            raise ExportError(
                f"'{source}' has {shape[0]} rows, not a multiple of 2 x {heads} heads: its "
                "rows cannot be permuted for llama.cpp's RoPE"
            )
        entries.append(
            {
                "name": name,
                "source": source,
                "shape": shape,
                "rope_heads": heads,
                "aliases": sorted(names_of[id(param)]),
                "embedding": name == adapter.embedding,
            }
        )
    if not entries:
        raise ExportError("no parameter of the model maps to a GGUF tensor")
    _assign_shards(entries)
    return entries, left_out


def _assign_shards(entries: list[dict[str, Any]]) -> None:
    """Spread the tensors over :data:`SHARDS` packing stages of about equal bytes (largest
    first, each to the lightest shard): a weights-only change repacks only the shards whose
    tensors changed, in any process, and takes the others from the cache."""
    load = [0] * SHARDS
    order = sorted(range(len(entries)), key=lambda i: -int(np.prod(entries[i]["shape"])))
    for i in order:
        k = min(range(SHARDS), key=lambda j: (load[j], j))
        entries[i]["shard"] = k
        load[k] += int(np.prod(entries[i]["shape"]))


#: Ops that read a weight as an embedding table (the other uses are products).
EMBEDDING_OPS = frozenset({"aten.embedding.default", "aten.embedding_bag.default"})


def assign_quantizers(
    plan: Sequence[Mapping[str, Any]], qmap: QuantMap, uses: Mapping[str, Sequence[str]]
) -> dict[str, QuantSpec]:
    """Which quantizer acts on each planned tensor: the one whose parameter is among the
    tensor's names, told apart for a tied parameter by the ops that read the quantized
    value (``uses``: qid -> op names): an embedding lookup belongs to the embedding table,
    anything else to the other names."""
    out: dict[str, QuantSpec] = {}
    for spec in qmap:
        if spec.param is None:
            continue
        candidates = [e for e in plan if spec.param in e["aliases"]]
        if len(candidates) > 1:
            ops = set(uses.get(str(spec.qid), ()))
            lookup = bool(ops) and ops <= EMBEDDING_OPS
            candidates = [e for e in candidates if e["embedding"] == lookup]
        if len(candidates) > 1:
            names = ", ".join(e["source"] for e in candidates)
            raise ExportError(
                f"quantizer {spec.qid} acts on '{spec.param}', which the file holds as "
                f"several tensors ({names}); it cannot tell which"
            )
        for entry in candidates:
            if entry["source"] in out:
                raise ExportError(
                    f"'{entry['source']}' has two weight quantizers ({out[entry['source']].qid} "
                    f"and {spec.qid}); the file holds one set of blocks per tensor"
                )
            out[entry["source"]] = spec
    return out


def rope_order(rows: int, heads: int) -> np.ndarray:
    """The row order llama.cpp's Llama loader expects of a Q or K projection: within each
    head, the two halves interleaved (``convert_hf_to_gguf``'s ``permute``)."""
    index = np.arange(rows).reshape(heads, 2, rows // heads // 2)
    return index.swapaxes(1, 2).reshape(rows)


# --------------------------------------------------------------------------- packing


def pack_tensors(
    plan: Sequence[Mapping[str, Any]],
    state: Mapping[str, torch.Tensor],
    preset: str | None,
    float_type: str,
    specs: Mapping[str, QuantSpec] | None = None,
    qvalues: QuantValues | None = None,
    state_digests: Mapping[str, str] | None = None,
    group: int | None = None,
) -> tuple[PackedTensors, dict[str, Any]]:
    """The bytes of every tensor of ``plan``, and a report: each tensor's type, and for the
    model's own quantizers (``specs``: source -> the quantizer acting on it, see
    :func:`assign_quantizers`) how far float16 moved their scales. ``group`` names the caller
    (a packing shard) whose previous call's tensors are reused where their inputs match."""
    specs = specs or {}
    digests = state_digests or {}
    jobs = []
    for entry in plan:
        spec = specs.get(entry["source"])
        qp = qvalues[spec.qid] if spec is not None and qvalues is not None else None
        jobs.append(_Job(entry, state, preset, float_type.upper(), spec, qp, digests))
    memo = _Memo.entries(group)
    todo = [j for j in jobs if j.key is None or j.key not in memo]
    big = sum(j.nbytes for j in todo) >= PARALLEL_PACK_BYTES
    done = dict(zip(todo, parallel_map(_Job.run, todo, parallel=big), strict=True))
    results = [done[j] if j in done else memo[j.key] for j in jobs]
    kept = {j.key: r for j, r in zip(jobs, results, strict=True) if j.key is not None}
    _Memo.keep(group, kept)
    packed = tuple(
        PackedTensor(j.name, ggml, j.shape, data, digest)
        for j, (ggml, data, digest, _) in zip(jobs, results, strict=True)
    )
    report = {j.name: {"type": r[0], **r[3]} for j, r in zip(jobs, results, strict=True)}
    return PackedTensors(packed), report


#: A packed tensor without its name: GGML type, bytes, digest, report (what the memo holds).
_Result = tuple[str, np.ndarray, str, dict[str, Any]]


class _Job:
    """How to pack one tensor, and the key of everything its bytes are a function of."""

    def __init__(
        self,
        entry: Mapping[str, Any],
        state: Mapping[str, torch.Tensor],
        preset: str | None,
        float_type: str,
        spec: QuantSpec | None,
        qp: QParams | None,
        digests: Mapping[str, str],
    ):
        self.entry, self.state, self.spec, self.qp = entry, state, spec, qp
        self.name, self.source = entry["name"], entry["source"]
        self.shape = tuple(entry["shape"])
        self.vector = len(self.shape) < 2 or self.name.endswith("_norm.weight")
        if self.vector:
            self.mode = "F32"
        elif preset is not None:
            self.mode = preset.upper()
        elif spec is not None and spec.bits <= WIDEST_BLOCK_BITS:
            self.mode = "model"
        else:  # no quantizer, or one finer than any block type: its values, as floats
            self.mode = float_type
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * 4
        known = digests.get(self.source)
        self.key = None
        if known is not None:
            values = None
            if spec is not None and qp is not None:
                grid = [spec.bits, spec.signed, spec.qmin, spec.qmax, spec.axis, spec.block_size]
                values = [grid, _tensor_digest(qp.scale), _tensor_digest(qp.zero_point)]
            self.key = digest_json(
                [self.mode, list(self.shape), entry["rope_heads"], known, values]
            )

    def run(self) -> _Result:
        w = self.state[self.source]
        if tuple(w.shape) != self.shape:
            raise ExportError(
                f"'{self.source}' is {list(w.shape)}; the plan expects {list(self.shape)}"
            )
        if self.mode in ("F32", "F16"):
            values = w.detach().float()
            if self.spec is not None and self.qp is not None:
                values = fake_quantize(values, self.spec, self.qp)
            ggml = blocks.GGML_TYPES[self.mode]
            data = blocks.float_bytes(ggml, self._rows(_numpy(values)))
            note = {"quantizer": self.spec.qid, "bits": self.spec.bits} if self.spec else None
            return self._packed(ggml, data, note)
        if self.mode == "model":
            return self._from_quantizer(w)
        ggml = blocks.GGML_TYPES[self.mode]
        blocks.check_blockable(self.source, self.shape, ggml)
        quantize = blocks.quantize_q8_0 if ggml is blocks.Q8_0 else blocks.quantize_q4_0
        codes, d = quantize(self._rows(_numpy(w.detach())))
        return self._packed(ggml, blocks.pack(ggml, codes, d))

    def _from_quantizer(self, w: torch.Tensor) -> _Result:
        spec, qp = self.spec, self.qp
        assert spec is not None and qp is not None
        where = f"quantizer {spec.qid} ({spec.op or 'quantizer'}) on '{self.source}'"
        _check_granularity(spec, self.shape, where)
        scale = broadcast_qparam(qp.scale.detach().float(), spec, self.shape).expand(self.shape)
        zero = broadcast_qparam(qp.zero_point.detach().float(), spec, self.shape)
        ggml = _block_type(spec, zero, where)
        snapped = fake_quantize(w.detach().float(), spec, qp)
        # snapped is s * (q - z) rounded once in float32: for |q - z| <= 128 the quotient is
        # within 2^-16 of the integer, so rounding recovers the model's codes exactly
        codes = torch.round(snapped / scale).to(torch.int8).numpy()
        rows = self.shape[0]
        codes = codes.reshape(rows, -1, blocks.QK)
        block_scale = scale.reshape(rows, -1, blocks.QK)[..., 0].contiguous().numpy()
        d = block_scale.astype(np.float16)
        bad = ~np.isfinite(d) | (d == 0)
        if bad.any():
            raise ExportError(
                f"{where}: scale {float(block_scale[bad][0])!r} has no float16 value (GGUF "
                "stores block scales as float16)"
            )
        moved = np.abs(d.astype(np.float32) - block_scale) / block_scale
        codes, d = self._rows(codes), self._rows(d)
        report = {"quantizer": spec.qid, "scale_float16_rel_change": float(moved.max())}
        return self._packed(ggml, blocks.pack(ggml, codes, d), report)

    def _rows(self, array: np.ndarray) -> np.ndarray:
        heads = self.entry["rope_heads"]
        if heads is None:
            return array
        return array[rope_order(array.shape[0], heads)]

    def _packed(
        self, ggml: blocks.GgmlType, data: np.ndarray, report: dict[str, Any] | None = None
    ) -> _Result:
        data = np.ascontiguousarray(data).reshape(-1)
        data.flags.writeable = False  # shared with later calls through the memo
        return ggml.name, data, digest_bytes(memoryview(data)), report or {}


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().float().contiguous().numpy()


def _tensor_digest(t: torch.Tensor) -> str:
    from graphbuild.engine.fingerprint import tensor_digest

    return f"{t.dtype}{list(t.shape)}:{tensor_digest(t)}"


def _check_granularity(spec: QuantSpec, shape: tuple[int, ...], where: str) -> None:
    """GGUF blocks are 32 values of one row sharing one scale: per tensor, per row, or
    blocks whose length is a multiple of 32 along the row fit; nothing else does."""
    rank = len(shape)
    if rank != 2:
        raise ExportError(f"{where}: GGUF quantizes 2-D weights, not shape {list(shape)}")
    blocks.check_blockable(where, shape, blocks.Q8_0)
    axis = None if spec.axis is None else spec.axis % rank
    if axis is None or (spec.block_size is None and axis == 0):
        return
    if spec.block_size is not None and axis == 1 and spec.block_size % blocks.QK == 0:
        return
    kind = f"blocks of {spec.block_size} along axis {axis}" if spec.block_size else f"axis {axis}"
    raise ExportError(
        f"{where}: {spec.granularity.lower().replace('_', ' ')} quantization ({kind}) has no "
        "GGUF form: Q4_0 and Q8_0 hold one scale per 32 values of a row, so the model's scales "
        "must be per tensor, per output channel (axis 0) or per block of a multiple of 32 "
        "along the row (axis 1)"
    )


def _block_type(spec: QuantSpec, zero: torch.Tensor, where: str) -> blocks.GgmlType:
    """Q4_0 for a grid whose codes ``q - z`` lie in [-8, 7], Q8_0 in [-128, 127]."""
    z_min, z_max = (int(v) for v in torch.aminmax(zero)) if zero.numel() else (0, 0)
    lo, hi = spec.qmin - z_max, spec.qmax - z_min
    for ggml in (blocks.Q4_0, blocks.Q8_0):
        assert ggml.codes is not None
        if ggml.codes[0] <= lo and hi <= ggml.codes[1] and spec.bits <= 8:
            return ggml
    zeros = f"{z_min}" if z_min == z_max else f"{z_min}..{z_max}"
    raise ExportError(
        f"{where}: a {spec.bits}-bit grid [{spec.qmin}, {spec.qmax}] with zero point {zeros} "
        f"gives codes in [{lo}, {hi}]; GGUF's Q4_0 holds [-8, 7] and Q8_0 [-128, 127], both "
        "symmetric around zero (use a symmetric quantizer of at most 8 bits, or a preset)"
    )


class _Memo:
    """The packed tensors of each group's last call, by key (one call's worth is kept)."""

    _lock = threading.Lock()
    _groups: dict[int | None, dict[str, _Result]] = {}

    @classmethod
    def entries(cls, group: int | None) -> dict[str, _Result]:
        with cls._lock:
            return dict(cls._groups.get(group, {}))

    @classmethod
    def keep(cls, group: int | None, entries: dict[str, _Result]) -> None:
        with cls._lock:
            cls._groups[group] = entries

    @classmethod
    def clear(cls) -> None:
        with cls._lock:
            cls._groups = {}
