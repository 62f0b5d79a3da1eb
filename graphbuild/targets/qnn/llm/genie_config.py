"""Qualcomm Genie's ``genie_config.json`` and ``htp_backend_ext_config.json`` for a bundle.

Genie (QAIRT's ``genie-t2t-run`` and its library) runs the part graphs as HTP context
binaries (``ctx-bins``, in part order; each binary holds a part's prompt and token graphs)
and computes the mask and the rotary tables itself from the positional encoding facts, so a
Genie bundle has no position processor. The layout follows AI Hub's Genie bundles:

- ``dialog``: ``context`` (``size`` = CL, ``n-vocab``, ``bos-token``, ``eos-token``), a
  ``sampler``, the ``tokenizer`` file, and the ``engine``: ``backend`` ``QnnHtp`` (``kv-dim`` =
  the head dim, mmap and polling settings, ``extensions`` = the HTP backend file below) and
  ``model`` of type ``binary`` with the ``ctx-bins`` list;
- the rotary facts: without RoPE scaling, ``pos-id-dim`` (D/2) and ``rope-theta`` in the
  ``QnnHtp`` section; with it, ``model.positional-encoding`` (``rope-dim``, ``rope-theta``,
  ``rope-scaling``: the scaling's type and parameters, as transformers names them with dashes);
- ``htp_backend_ext_config.json``: the device (``soc_model``, ``dsp_arch``), one core's
  performance profile, shared-buffer memory, weight sharing across the context binaries.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from graphbuild.errors import ConfigError
from graphbuild.targets.qnn.arch.targets import HtpTarget
from graphbuild.targets.qnn.llm.genai_pipeline import LlmFacts

__all__ = [
    "GENIE_CONFIG_NAME",
    "HTP_EXT_CONFIG_NAME",
    "genie_config",
    "htp_backend_ext_config",
    "write_genie_configs",
]

GENIE_CONFIG_NAME = "genie_config.json"
HTP_EXT_CONFIG_NAME = "htp_backend_ext_config.json"

#: transformers' names of the llama3 RoPE scaling parameters and Genie's.
_ROPE_SCALING_KEYS = {
    "factor": "factor",
    "low_freq_factor": "low-freq-factor",
    "high_freq_factor": "high-freq-factor",
    "original_max_position_embeddings": "original-max-position-embeddings",
}


def _rope_scaling(scaling: Mapping[str, Any]) -> dict[str, Any]:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ConfigError(
            f"Genie's rope-scaling takes the llama3 type here, not {kind!r}: a model with "
            "another RoPE scaling needs its own positional-encoding facts"
        )
    missing = [k for k in _ROPE_SCALING_KEYS if k not in scaling]
    if missing:
        raise ConfigError(f"the llama3 rope_scaling lacks {missing}")
    out: dict[str, Any] = {"rope-type": "llama3"}
    out |= {genie: scaling[hf] for hf, genie in _ROPE_SCALING_KEYS.items()}
    return out


def genie_config(
    facts: LlmFacts,
    ctx_bins: Sequence[str],
    *,
    rope_theta: float,
    rope_scaling: Mapping[str, Any] | None = None,
    tokenizer: str = "tokenizer.json",
    sampler: Mapping[str, Any] | None = None,
    n_threads: int = 3,
    cpu_mask: str = "0xe0",
) -> dict[str, Any]:
    """The ``genie_config.json`` content for the context binaries ``ctx_bins`` (file names
    relative to the bundle, in part order) of a model described by ``facts``, its rotary
    base ``rope_theta`` and its transformers ``rope_scaling`` (None, or llama3's).

    ``sampler`` defaults to greedy (``top-k`` 1), the decoding the qnn/llm checks compare."""
    if not ctx_bins:
        raise ConfigError("a Genie bundle needs at least one context binary (ctx-bins)")
    for name in ctx_bins:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ConfigError(f"ctx-bins are relative to the bundle, not {name!r}")
    eos = facts.eos_tokens
    htp: dict[str, Any] = {
        "version": 1,
        "use-mmap": True,
        "spill-fill-bufsize": 0,
        "mmap-budget": 0,
        "poll": True,
        "cpu-mask": cpu_mask,
        "kv-dim": facts.head_dim,
        "allow-async-init": False,
    }
    model: dict[str, Any] = {
        "version": 1,
        "type": "binary",
        "binary": {"version": 1, "ctx-bins": list(ctx_bins)},
    }
    if rope_scaling is None:
        htp |= {"pos-id-dim": facts.head_dim // 2, "rope-theta": int(rope_theta)}
    else:
        model["positional-encoding"] = {
            "type": "rope",
            "rope-dim": facts.head_dim // 2,
            "rope-theta": int(rope_theta),
            "rope-scaling": _rope_scaling(rope_scaling),
        }
    return {
        "dialog": {
            "version": 1,
            "type": "basic",
            "context": {
                "version": 1,
                "size": facts.context_len,
                "n-vocab": facts.vocab_size,
                "bos-token": facts.bos_token_id,
                "eos-token": eos[0] if len(eos) == 1 else list(eos),
            },
            "sampler": {"version": 1, **(sampler or {"seed": 42, "temp": 1.0, "top-k": 1})},
            "tokenizer": {"version": 1, "path": tokenizer},
            "engine": {
                "version": 1,
                "n-threads": n_threads,
                "backend": {
                    "version": 1,
                    "type": "QnnHtp",
                    "QnnHtp": htp,
                    "extensions": HTP_EXT_CONFIG_NAME,
                },
                "model": model,
            },
        }
    }


def htp_backend_ext_config(target: HtpTarget, *, perf_profile: str = "burst") -> dict[str, Any]:
    """``htp_backend_ext_config.json``: the device the binaries were prepared for."""
    return {
        "devices": [
            {
                "soc_model": int(target.soc_model),
                "dsp_arch": f"v{target.htp_arch}",
                "cores": [{"core_id": 0, "perf_profile": perf_profile, "rpc_control_latency": 100}],
            }
        ],
        "memory": {"mem_type": "shared_buffer"},
        "context": {"weight_sharing_enabled": True},
    }


def write_genie_configs(
    directory: str | Path,
    facts: LlmFacts,
    ctx_bins: Sequence[str],
    target: HtpTarget,
    *,
    require_files: bool = True,
    **options: Any,
) -> tuple[Path, Path]:
    """Write ``genie_config.json`` (:func:`genie_config`, ``options`` passed on) and
    ``htp_backend_ext_config.json`` into ``directory``; with ``require_files`` the context
    binaries and the tokenizer must be there already. Returns both paths."""
    out = Path(directory)
    config = genie_config(facts, ctx_bins, **options)
    if require_files:
        tokenizer = config["dialog"]["tokenizer"]["path"]
        missing = [f for f in [*ctx_bins, tokenizer] if not (out / f).is_file()]
        if missing:
            raise ConfigError(f"Genie bundle files missing from {out}: {missing}")
    genie_path, ext_path = out / GENIE_CONFIG_NAME, out / HTP_EXT_CONFIG_NAME
    genie_path.write_text(json.dumps(config, indent=2) + "\n")
    ext_path.write_text(json.dumps(htp_backend_ext_config(target), indent=2) + "\n")
    return genie_path, ext_path
