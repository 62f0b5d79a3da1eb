"""Greedy generation of a ``qnn/llm`` bundle with onnxruntime-genai, logits per step.

:func:`generate` runs a token-id prompt through the bundle's pipeline (CPU entries on
onnxruntime's CPU, QNN entries on the QNN execution provider, which it registers as
onnxruntime-genai's plugin) and returns the generated ids and, per step, the logits the step's
token was chosen from: what a caller compares with transformers' ``generate()`` (tokens) and
the float model's logits (SQNR per step).

It runs onnxruntime-genai in a child process by default (``python -m`` this module, request
and result through files): a plugin execution provider, once registered, stays for the
process; QNN's libraries print to stdout and can abort the process; and the child may import
another onnxruntime-genai build than the installed one (``genai_path``). Errors come back
typed (:mod:`graphbuild.targets.qnn.llm.errors`).

Measured on onnxruntime-genai 0.15.2 to 0.18.0 with this format (tests/test_llm_genai.py):
0.15.2 and 0.16.0 run the decoder pipeline with its windowed uint8 KV cache; 0.17.0 and
0.18.0 give every decoder pipeline an unwindowed ``[1, H, S, D]`` cache (their cache policy
skips the windowed cache whenever ``decoder.pipeline`` is non-empty), so the first part graph
with a KV input fails with "Got invalid dimensions for input: past_key_..."; the error raised
then says so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphbuild.errors import ConfigError
from graphbuild.targets.qnn.llm.errors import (
    GenaiCrashedError,
    GenaiRefusedError,
    GenaiRunError,
    GenaiUnavailableError,
    IncompleteBundleError,
)
from graphbuild.targets.qnn.llm.genai_config import CONFIG_NAME, check_length
from graphbuild.targets.workers import run_worker

__all__ = ["Generation", "bundle_uses_qnn", "check_bundle", "generate"]

INSTALL = "pip install onnxruntime-genai (or: pip install 'graphbuild[llm]')"
_WORKER = "graphbuild.targets.qnn.llm.generate"
_REQUEST, _RESULT, _LOGITS = "request.json", "result.json", "logits.npy"
#: onnxruntime-genai's error when a part graph gets a KV cache of another layout than its
#: inputs: the symptom of 0.17 and 0.18's unwindowed pipeline cache.
_KV_SHAPE_SYMPTOM = "Got invalid dimensions for input: past_"
_WINDOWED_HINT = (
    "onnxruntime-genai {version} fed a KV cache input another shape than the graph's "
    "[H, 1, D, CL-N] / [H, 1, CL-N, D]: onnxruntime-genai 0.17.0 and 0.18.0 never give a "
    "decoder-pipeline its windowed uint8 KV cache (measured; 0.15.2 and 0.16.0 do). Run the "
    "bundle with onnxruntime-genai 0.16.0 (pip install onnxruntime-genai==0.16.0, or install it "
    "into a directory with pip --target and pass genai_path=)"
)


@dataclass(frozen=True)
class Generation:
    """The result of :func:`generate`: ``tokens`` the generated ids (the prompt excluded, an
    end-of-sequence id included when generation stopped on it); ``logits`` float32
    ``[len(tokens), V]``, row ``i`` the logits ``tokens[i]`` was chosen from; ``stopped`` why
    generation ended (``"max_new_tokens"``, ``"eos"`` or ``"max_length"``)."""

    tokens: list[int]
    logits: np.ndarray
    stopped: str
    genai_version: str


def check_bundle(bundle: str | Path) -> dict[str, Any]:
    """The bundle's ``genai_config.json`` as a dict, after checking that every file its
    pipeline names is in the directory (:class:`IncompleteBundleError` otherwise)."""
    directory = Path(bundle)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise IncompleteBundleError(
            f"{directory} is not a qnn/llm bundle: it has no {CONFIG_NAME}; write it with "
            "graphbuild.targets.qnn.llm.genai_config.write_genai_config"
        )
    try:
        config = json.loads(config_path.read_text())
        pipeline = config["model"]["decoder"]["pipeline"]
        entries = {name: entry for stage in pipeline for name, entry in stage.items()}
        files = [entry["filename"] for entry in entries.values()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise IncompleteBundleError(
            f"{config_path} is not a decoder-pipeline config ({type(exc).__name__}: {exc})"
        ) from exc
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise IncompleteBundleError(
            f"the bundle {directory} lacks files its {CONFIG_NAME} names: {missing}"
        )
    return config


def bundle_uses_qnn(config: dict[str, Any]) -> bool:
    """Whether an entry of the config (or its default) runs on the QNN execution provider."""
    decoder = config["model"]["decoder"]
    sessions = [decoder.get("session_options", {})]
    sessions += [e.get("session_options", {}) for s in decoder["pipeline"] for e in s.values()]
    names = {
        name.lower().removesuffix("executionprovider")
        for session in sessions
        for options in session.get("provider_options", [])
        for name in options
    }
    return "qnn" in names


def _check_prompt(config: dict[str, Any], prompt: Sequence[int], max_new_tokens: int) -> None:
    model = config["model"]
    vocab, pad = model["vocab_size"], model["pad_token_id"]
    if not prompt:
        raise ConfigError("the prompt is empty")
    bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"prompt ids outside the vocabulary [0, {vocab}): {bad[:10]}")
    if pad in prompt:
        raise ConfigError(
            f"the prompt holds the pad token {pad}: onnxruntime-genai marks every pad id of "
            "the prompt as padding (not attended, position 0); give the bundle a pad_token_id "
            "that is not a prompt token"
        )
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    check_length(config, len(prompt), max_new_tokens)  # as graphbuild's float runner does


def generate(
    bundle: str | Path,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    isolated: bool = True,
    genai_path: str | Path | None = None,
    timeout: float | None = 600.0,
) -> Generation:
    """Greedy generation of ``max_new_tokens`` ids (fewer on end of sequence) after the
    token ids ``prompt`` with the bundle in the directory ``bundle``.

    ``isolated`` runs onnxruntime-genai in a child process (the default; required with
    ``genai_path``, a directory holding another ``onnxruntime_genai`` package to import
    first); ``timeout`` bounds that process (seconds)."""
    config = check_bundle(bundle)
    _check_prompt(config, prompt, max_new_tokens)
    request = {
        "bundle": str(Path(bundle).resolve()),
        "prompt": [int(t) for t in prompt],
        "max_new_tokens": int(max_new_tokens),
        "qnn": bundle_uses_qnn(config),
    }
    if genai_path is not None:
        if not isolated:
            raise ConfigError("genai_path needs isolated=True (a fresh process imports it)")
        if not (Path(genai_path) / "onnxruntime_genai").is_dir():
            raise GenaiUnavailableError(f"no onnxruntime_genai package in {genai_path}")
    elif importlib.util.find_spec("onnxruntime_genai") is None:
        raise GenaiUnavailableError(f"onnxruntime-genai is not installed: {INSTALL}")
    if not isolated:
        return _as_generation(_run(request))
    return _run_isolated(request, genai_path, timeout)


def _as_generation(result: dict[str, Any], logits: np.ndarray | None = None) -> Generation:
    if "error" in result:
        _raise(result)
    return Generation(
        tokens=result["tokens"],
        logits=result["logits"] if logits is None else logits,
        stopped=result["stopped"],
        genai_version=result["genai_version"],
    )


def _raise(result: dict[str, Any]) -> None:
    kind, message, version = result["error"], result["message"], result.get("genai_version")
    if kind == "import":
        raise GenaiUnavailableError(f"onnxruntime-genai does not import ({message}): {INSTALL}")
    if kind == "qnn":
        raise GenaiUnavailableError(
            f"the bundle runs entries on QNN but its execution provider is unusable: {message}"
        )
    if kind == "load":
        raise GenaiRefusedError(
            f"onnxruntime-genai {version} refused the bundle {result['bundle']}: {message}",
            message,
        )
    hint = _WINDOWED_HINT.format(version=version) if _KV_SHAPE_SYMPTOM in message else ""
    raise GenaiRunError(
        f"onnxruntime-genai {version} failed generating with {result['bundle']}: {message}"
        + (f"\n{hint}" if hint else ""),
        message,
    )


def _run_isolated(
    request: dict[str, Any], genai_path: str | Path | None, timeout: float | None
) -> Generation:
    with tempfile.TemporaryDirectory(prefix="graphbuild-genai-") as tmp:
        work = Path(tmp)
        (work / _REQUEST).write_text(json.dumps(request))
        env = dict(os.environ)
        paths = [str(Path(genai_path).resolve())] if genai_path is not None else []
        if request["qnn"]:  # a bundle names QNN's backend by file name: the child finds it
            libraries = _qnn_library_dir()
            if libraries:
                env["LD_LIBRARY_PATH"] = os.pathsep.join(
                    [libraries, *filter(None, [env.get("LD_LIBRARY_PATH")])]
                )
        try:
            proc = run_worker(
                _WORKER, [str(work)], work, env=env, first_on_path=paths, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:
            raise GenaiCrashedError(
                f"onnxruntime-genai ran past {timeout} s on {request['bundle']}"
            ) from exc
        result_file = work / _RESULT
        if not result_file.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
            raise GenaiCrashedError(
                f"the onnxruntime-genai process died (exit status {proc.returncode}) running "
                f"{request['bundle']}; its last output:\n{tail}"
            )
        result = json.loads(result_file.read_text())
        logits = np.load(work / _LOGITS) if (work / _LOGITS).is_file() else None
        return _as_generation(result, logits)


def _qnn_library_dir() -> str:
    """The folder of the installed onnxruntime-qnn's QNN libraries, or ``""``."""
    try:
        import onnxruntime_qnn
    except ImportError:
        return ""
    return str(Path(onnxruntime_qnn.get_qnn_htp_path()).parent)


def _run(request: dict[str, Any]) -> dict[str, Any]:
    """Generate as ``request`` says, in this process; errors come back as a dict."""
    bundle = request["bundle"]
    try:
        import onnxruntime_genai as og
    except ImportError as exc:  # a package that is there but does not load
        return {"error": "import", "message": str(exc), "bundle": bundle}
    version = getattr(og, "__version__", "unknown")
    failed = {"bundle": bundle, "genai_version": version}
    if request["qnn"]:
        message = _register_qnn(og)
        if message:
            return {"error": "qnn", "message": message, **failed}
    try:
        model = og.Model(og.Config(bundle))
        generator = og.Generator(model, og.GeneratorParams(model))
    except Exception as exc:  # genai raises RuntimeError with its own message
        return {"error": "load", "message": str(exc), **failed}
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    stopped = "max_new_tokens"
    try:
        generator.append_tokens(np.asarray(request["prompt"], dtype=np.int32))
        while len(tokens) < request["max_new_tokens"]:
            if generator.is_done():
                stopped = "max_length"
                break
            logits.append(np.asarray(generator.get_logits(), dtype=np.float32).reshape(-1))
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            if generator.is_done() and len(tokens) < request["max_new_tokens"]:
                stopped = "eos" if _is_eos(bundle, tokens[-1]) else "max_length"
                break
    except Exception as exc:
        return {"error": "run", "message": str(exc), **failed}
    return {
        "tokens": tokens,
        "logits": np.stack(logits) if logits else np.zeros((0, 0), np.float32),
        "stopped": stopped,
        "genai_version": version,
    }


def _is_eos(bundle: str, token: int) -> bool:
    eos = json.loads((Path(bundle) / CONFIG_NAME).read_text())["model"]["eos_token_id"]
    return token in (eos if isinstance(eos, list) else [eos])


def _register_qnn(og: Any) -> str:
    """Register onnxruntime-qnn's provider library with onnxruntime-genai; "" when done, else
    why not. Whether the backend is usable here is graphbuild's HTP runtime's check."""
    from graphbuild.targets.qnn.htp_runtime.backend import QNN_EP, availability

    found = availability()
    if not found.available:
        return found.reason
    if not hasattr(og, "register_execution_provider_library"):
        return f"onnxruntime-genai {og.__version__} cannot load plugin execution providers"
    import onnxruntime_qnn

    try:
        og.register_execution_provider_library(QNN_EP, onnxruntime_qnn.get_library_path())
    except Exception as exc:
        return f"onnxruntime-genai could not register {QNN_EP}: {exc}"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """The child process: ``python -m graphbuild.targets.qnn.llm.generate WORKDIR`` reads
    WORKDIR/request.json, writes result.json and logits.npy there."""
    work = Path((argv if argv is not None else sys.argv[1:])[0])
    result = _run(json.loads((work / _REQUEST).read_text()))
    logits = result.pop("logits", None)
    if logits is not None:
        np.save(work / _LOGITS, logits)
    (work / _RESULT).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
