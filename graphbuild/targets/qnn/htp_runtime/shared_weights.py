"""How much of their weights the graphs of a shared context share, and the guards on it: QNN
HTP shares weights between graphs from v73 on (:func:`require_weight_sharing` refuses an earlier
architecture before anything compiles), and by content, whatever the tensors' names
(:func:`_weight_sharing` measures it, :func:`_check_sharing` refuses a binary that holds the
shared weights twice).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from graphbuild.errors import ConfigError, ExportError
from graphbuild.targets.qnn.htp_runtime.backend import HtpTarget

__all__ = ["WEIGHT_SHARING_FROM_ARCH", "WeightSharing", "hash_file", "require_weight_sharing"]

#: The first HTP architecture whose contexts share weights between graphs.
WEIGHT_SHARING_FROM_ARCH = "73"
#: Below this many shared weight bytes the binary's own overhead can match them, and the size
#: says nothing about whether the weights were shared.
_SIZE_CHECK_MIN_BYTES = 64 << 20
_CHUNK = 4 << 20


@dataclass(frozen=True)
class WeightSharing:
    """The binary's size against the graphs' weights (initializer bytes, each distinct
    content once): ``graph_bytes`` each graph's, ``shared_bytes`` those every graph holds (the
    same dtype, shape and bytes, whatever the name: QNN shares by content, measured with QNN
    2.51), ``union_bytes`` one copy of all of them. A binary that shares is about
    ``union_bytes``; one that does not, about the sum of ``graph_bytes``."""

    binary_bytes: int
    graph_bytes: tuple[int, ...]
    shared_bytes: int
    union_bytes: int

    @property
    def ratio(self) -> float:
        """Binary bytes per byte of one copy of the weights."""
        return self.binary_bytes / self.union_bytes if self.union_bytes else float("inf")

    def to_json(self) -> dict[str, Any]:
        return {
            "binary_bytes": self.binary_bytes,
            "graph_bytes": list(self.graph_bytes),
            "shared_bytes": self.shared_bytes,
            "union_bytes": self.union_bytes,
            "ratio": round(self.ratio, 4),
        }


def require_weight_sharing(target: HtpTarget) -> None:
    """Raise :class:`ConfigError` for an HTP architecture whose contexts cannot share weights
    (before v73)."""
    if int(target.htp_arch) < int(WEIGHT_SHARING_FROM_ARCH):
        raise ConfigError(
            f"HTP v{target.htp_arch} cannot share weights between the graphs of one QNN "
            f"context; weight sharing starts at v{WEIGHT_SHARING_FROM_ARCH}. Prepare for "
            f"v{WEIGHT_SHARING_FROM_ARCH} or later, or prepare one context per graph "
            "(prepare_context) for this architecture"
        )


def _tensor_digests(model: Path) -> dict[str, int]:
    """The initializers of ``model`` by content: SHA-256 of dtype, shape and bytes -> bytes."""
    graph = onnx.load(os.fspath(model), load_external_data=False).graph
    digests = {}
    for t in graph.initializer:
        h = hashlib.sha256(f"{t.data_type}:{list(t.dims)}:".encode())
        if t.data_location == onnx.TensorProto.EXTERNAL:
            ext = {e.key: e.value for e in t.external_data}
            length = hash_file(
                h,
                model.parent / ext["location"],
                int(ext.get("offset", "0")),
                int(ext.get("length", "-1")),
            )
        else:
            data = t.raw_data or onnx.numpy_helper.to_array(t).tobytes()
            h.update(data)
            length = len(data)
        digests[h.hexdigest()] = length
    return digests


def hash_file(h: Any, path: Path, offset: int = 0, length: int = -1) -> int:
    """Feed ``length`` bytes of ``path`` from ``offset`` (to its end if negative) to the
    hashlib object ``h`` a chunk at a time: an LLM part's weights are hundreds of MiB, read
    whole they would add that much to the export's peak memory. Returns the bytes hashed."""
    done = 0
    with open(path, "rb") as f:
        f.seek(offset)
        while length < 0 or done < length:
            chunk = f.read(_CHUNK if length < 0 else min(_CHUNK, length - done))
            if not chunk:
                break
            h.update(chunk)
            done += len(chunk)
    return done


def _weight_sharing(sources: Sequence[Path], binary_bytes: int) -> WeightSharing:
    """The graphs' weights as QNN shares them: by content, whatever their names."""
    per_graph = [_tensor_digests(s) for s in sources]
    common = set.intersection(*(set(d) for d in per_graph))
    union = {k: n for d in per_graph for k, n in d.items()}
    return WeightSharing(
        binary_bytes=binary_bytes,
        graph_bytes=tuple(sum(d.values()) for d in per_graph),
        shared_bytes=sum(union[k] for k in common),
        union_bytes=sum(union.values()),
    )


def _check_sharing(w: WeightSharing, name: str) -> None:
    """A binary closer to two copies of the shared weights than to one did not share them
    (checked where the weights dominate the binary)."""
    if w.shared_bytes < _SIZE_CHECK_MIN_BYTES:
        return
    if w.binary_bytes > w.union_bytes + 0.75 * w.shared_bytes:
        raise ExportError(
            f"the shared context {name} is {w.binary_bytes} bytes for "
            f"{w.shared_bytes} bytes of weights its graphs share ({w.union_bytes} in all): "
            "QNN did not share them (is onnxruntime-qnn's weight sharing still turned on by "
            "ep.share_ep_contexts?)"
        )
