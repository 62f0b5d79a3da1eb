"""``genai_config.json`` for onnxruntime-genai's ``decoder-pipeline`` model type.

A ``qnn/llm`` bundle is a directory of ONNX models that onnxruntime-genai runs one after the
other for every window of the prompt and every generated token: the position processor
(CPU), optionally a quantizer of its outputs, then per part a prompt graph (run on the prompt
windows only) and a token graph (run per generated token only), optionally a dequantizer of
the logits. genai owns the windowed uint8 KV cache (``sliding_window``): it feeds
``past_key_{L}_in`` / ``past_value_{L}_in`` to the entry that lists them as inputs and slides
the entry's ``past_key_{L}_out`` / ``past_value_{L}_out`` into them after each run. Every
other output is handed by name to the later entries that list it as an input.

What onnxruntime-genai 0.18 reads (measured against it; unknown keys are refused):

- ``model``: ``type`` ``"decoder-pipeline"``, ``context_length``, ``vocab_size``,
  ``bos_token_id``, ``eos_token_id`` (an int or a list), ``pad_token_id`` (genai left-pads the
  prompt with it to a multiple of the window and marks those slots invalid: it must not be a
  prompt token);
- ``model.decoder``: ``head_size``, ``hidden_size``, ``num_attention_heads``,
  ``num_key_value_heads``, ``num_hidden_layers``, ``session_options`` (the default of the
  entries that have none), ``inputs`` (the names genai feeds: ``input_ids``,
  ``attention_mask``, ``position_ids``, ``past_key_names`` / ``past_value_names`` with ``%d``
  for the layer, 0-based), ``outputs`` (``logits``, ``present_key_names``,
  ``present_value_names``), ``sliding_window`` (``window_size`` = the prompt length N,
  ``pad_value`` = the byte never-written KV slots hold: the KV zero point, so they dequantize
  to 0; ``alignment`` ``"right"``: the prompt's padding goes on its left), and ``pipeline``: a
  list holding ONE object whose keys, in order, name the entries (order is run order);
- per entry: ``filename``, ``inputs``, ``outputs``, ``run_on_prompt``, ``run_on_token_gen``,
  ``session_options`` (``provider_options``: ``[]`` for the CPU,
  ``[{"qnn": {"backend_path": ..., ...}}]`` for the QNN execution provider);
- ``search``: greedy defaults (``do_sample`` false, ``num_beams`` 1, ``max_length``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphbuild.errors import ConfigError
from graphbuild.targets.qnn.arch.targets import HtpTarget
from graphbuild.targets.qnn.llm.position_processor import PROCESSOR_OUTPUTS

__all__ = [
    "CONFIG_NAME",
    "GenaiNames",
    "LlmFacts",
    "PipelineEntry",
    "Session",
    "genai_config",
    "onnx_io_names",
    "part_entry",
    "position_processor_entry",
    "write_genai_config",
]

CONFIG_NAME = "genai_config.json"
#: The KV zero point of the format (uint8, symmetric): never-written slots hold it.
DEFAULT_KV_PAD_VALUE = 128


@dataclass(frozen=True)
class LlmFacts:
    """What the runtime must know of the model: token ids, sizes, and the context
    (``context_len`` slots) and prompt window (``prompt_len`` tokens per prompt run)."""

    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    context_len: int
    prompt_len: int
    bos_token_id: int
    eos_token_id: int | tuple[int, ...]
    pad_token_id: int

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_hidden_layers",
            "context_len",
            "prompt_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"LlmFacts.{name} must be a positive int, got {value!r}")
        if self.prompt_len < 2:
            raise ConfigError(
                f"LlmFacts.prompt_len must be at least 2 (onnxruntime-genai's windowed cache), "
                f"got {self.prompt_len}"
            )
        if self.context_len < 2 * self.prompt_len:
            raise ConfigError(
                f"LlmFacts.context_len ({self.context_len}) must be at least 2 * prompt_len "
                f"({self.prompt_len}): onnxruntime-genai's windowed cache refuses less"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        eos = self.eos_tokens
        if not eos:
            raise ConfigError("LlmFacts.eos_token_id names no token")
        for token in (self.bos_token_id, self.pad_token_id, *eos):
            if not 0 <= token < self.vocab_size:
                raise ConfigError(
                    f"token id {token} is outside the vocabulary [0, {self.vocab_size})"
                )

    @property
    def eos_tokens(self) -> tuple[int, ...]:
        """The end-of-sequence ids as a tuple."""
        eos = self.eos_token_id
        return (eos,) if isinstance(eos, int) else tuple(eos)


@dataclass(frozen=True)
class Session:
    """Where a pipeline entry runs: onnxruntime's CPU (``provider="cpu"``) or the QNN
    execution provider (``provider="qnn"``) with its provider options (``backend_path`` and
    the HTP options, strings as onnxruntime takes them)."""

    provider: str = "cpu"
    options: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.provider not in ("cpu", "qnn"):
            raise ConfigError(f"Session.provider must be 'cpu' or 'qnn', got {self.provider!r}")
        if self.provider == "cpu" and self.options:
            raise ConfigError(
                "onnxruntime-genai refuses provider options for the CPU: "
                f"drop {sorted(self.options)}"
            )
        if self.provider == "qnn" and "backend_path" not in self.options:
            raise ConfigError(
                "a QNN session needs backend_path (QnnHtp's library: QnnHtp.dll on Windows, "
                "libQnnHtp.so on Linux; onnxruntime_qnn.get_qnn_htp_path() where installed)"
            )
        for key, value in self.options.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ConfigError(f"provider options are strings: {key!r}: {value!r}")

    @classmethod
    def cpu(cls) -> Session:
        return cls("cpu")

    @classmethod
    def qnn(cls, backend_path: str, **options: str) -> Session:
        """The QNN execution provider on ``backend_path`` with ``options`` (``htp_arch``,
        ``soc_model``, ``htp_performance_mode``, ``enable_htp_shared_memory_allocator``...)."""
        return cls("qnn", {"backend_path": backend_path, **options})

    @classmethod
    def qnn_htp(cls, target: HtpTarget, **options: str) -> Session:
        """The QNN execution provider on HTP ``target`` with the installed onnxruntime-qnn's
        HTP backend (graphbuild's HTP runtime locates it: run here, on the simulator or a
        Snapdragon device); ``options`` add to or override its provider options. A bundle
        for a device with its own QNN libraries takes :meth:`qnn` with their name
        (``QnnHtp.dll`` on Windows on ARM)."""
        from graphbuild.targets.qnn.htp_runtime.backend import ep_options_for

        return cls("qnn", {**ep_options_for(target), **options})

    def to_json(self) -> dict[str, Any]:
        providers = [] if self.provider == "cpu" else [{"qnn": dict(self.options)}]
        return {"log_id": "onnxruntime-genai", "provider_options": providers}


@dataclass(frozen=True)
class PipelineEntry:
    """One ONNX model of the pipeline: its file (relative to the bundle directory), the
    input and output names genai wires by name, and when it runs."""

    name: str
    filename: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    run_on_prompt: bool = True
    run_on_token_gen: bool = True
    session: Session = field(default_factory=Session)

    def __post_init__(self) -> None:
        if not self.name or not self.filename:
            raise ConfigError(f"a pipeline entry needs a name and a filename: {self!r}")
        if Path(self.filename).is_absolute() or ".." in Path(self.filename).parts:
            raise ConfigError(
                f"pipeline entry {self.name!r}: filename {self.filename!r} must be relative "
                "to the bundle directory"
            )
        if not (self.run_on_prompt or self.run_on_token_gen):
            raise ConfigError(f"pipeline entry {self.name!r} runs neither on prompt nor token")
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))

    def to_json(self) -> dict[str, Any]:
        return {
            "filename": self.filename,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "session_options": self.session.to_json(),
            "run_on_prompt": self.run_on_prompt,
            "run_on_token_gen": self.run_on_token_gen,
        }


@dataclass(frozen=True)
class GenaiNames:
    """The names genai feeds and reads. ``attention_mask`` and ``position_ids`` are the
    position processor's inputs; ``past_key``... hold ``%d`` for the 0-based layer."""

    input_ids: str = "input_ids"
    attention_mask: str = "attention_mask_before_processor"
    position_ids: str = "position_ids"
    past_key: str = "past_key_%d_in"
    past_value: str = "past_value_%d_in"
    logits: str = "logits"
    present_key: str = "past_key_%d_out"
    present_value: str = "past_value_%d_out"


def onnx_io_names(path: str | Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The graph input and output names of the ONNX model at ``path`` (its weights are not
    read)."""
    import onnx

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"no ONNX model at {file}")
    model = onnx.load(file, load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    inputs = tuple(i.name for i in model.graph.input if i.name not in inits)
    return inputs, tuple(o.name for o in model.graph.output)


def part_entry(
    name: str,
    directory: str | Path,
    filename: str,
    *,
    prompt: bool,
    session: Session | None = None,
) -> PipelineEntry:
    """The pipeline entry of a part graph saved as ``directory/filename``, its I/O names
    read from the file: a prompt graph (``prompt=True``) runs on the prompt windows only, a
    token graph on generated tokens only."""
    inputs, outputs = onnx_io_names(Path(directory) / filename)
    return PipelineEntry(
        name,
        filename,
        inputs,
        outputs,
        run_on_prompt=prompt,
        run_on_token_gen=not prompt,
        session=session or Session.cpu(),
    )


def position_processor_entry(
    filename: str = "position-processor.onnx", *, names: GenaiNames | None = None
) -> PipelineEntry:
    """The position processor's entry (CPU, prompt and token runs): genai's integer mask and
    positions in, the part graphs' float mask and rotary tables out."""
    names = names or GenaiNames()
    return PipelineEntry(
        "position-processor",
        filename,
        (names.attention_mask, names.position_ids),
        PROCESSOR_OUTPUTS,
    )


def _check_wiring(facts: LlmFacts, pipeline: Sequence[PipelineEntry], names: GenaiNames) -> None:
    """Refuse a pipeline genai would run wrongly: an input nothing feeds, a layer's cache that
    no prompt or no token entry reads, or a phase that yields no logits."""
    if not pipeline:
        raise ConfigError("the pipeline has no entries")
    seen: set[str] = set()
    for entry in pipeline:
        if entry.name in seen:
            raise ConfigError(f"two pipeline entries are named {entry.name!r}")
        seen.add(entry.name)
    layers = range(facts.num_hidden_layers)
    kv_in = {names.past_key % i for i in layers} | {names.past_value % i for i in layers}
    kv_out = {names.present_key % i for i in layers} | {names.present_value % i for i in layers}
    fed = {names.input_ids, names.attention_mask, names.position_ids} | kv_in
    for phase in ("prompt", "token"):
        runs = [
            e for e in pipeline if (e.run_on_prompt if phase == "prompt" else e.run_on_token_gen)
        ]
        available = set(fed)
        for entry in runs:
            missing = [n for n in entry.inputs if n not in available]
            if missing:
                raise ConfigError(
                    f"pipeline entry {entry.name!r} ({phase} phase) reads {missing}, which "
                    "neither genai feeds nor an earlier entry of that phase outputs"
                )
            available |= set(entry.outputs)
        read = {n for e in runs for n in e.inputs}
        written = {n for e in runs for n in e.outputs}
        if kv_in - read or kv_out - written:
            raise ConfigError(
                f"the {phase} phase leaves KV caches unused: inputs "
                f"{sorted(kv_in - read)}, outputs {sorted(kv_out - written)} "
                f"(num_hidden_layers={facts.num_hidden_layers})"
            )
        if names.logits not in written:
            raise ConfigError(f"no entry of the {phase} phase outputs {names.logits!r}")
    # genai updates each entry's layers' caches after it runs: two entries' layer sets must
    # be the same (a part's prompt and token graphs) or disjoint.
    sets = {
        e.name: frozenset(i for i in layers if names.past_key % i in e.inputs) for e in pipeline
    }
    for a, b in itertools.combinations([(n, s) for n, s in sets.items() if s], 2):
        if a[1] != b[1] and a[1] & b[1]:
            raise ConfigError(
                f"pipeline entries {a[0]!r} (layers {sorted(a[1])}) and {b[0]!r} (layers "
                f"{sorted(b[1])}) share some KV layers but not all: onnxruntime-genai needs "
                "the same layers (a part's prompt and token graphs) or none in common"
            )


def genai_config(
    facts: LlmFacts,
    pipeline: Sequence[PipelineEntry],
    *,
    names: GenaiNames | None = None,
    kv_pad_value: int = DEFAULT_KV_PAD_VALUE,
    max_length: int | None = None,
    default_session: Session | None = None,
) -> dict[str, Any]:
    """The ``genai_config.json`` content (a dict) for ``pipeline`` run in order.

    ``max_length`` (default ``context_len``) bounds prompt plus generated tokens, the prompt
    counted padded to whole windows; ``default_session`` serves entries without their own
    (all have one here, so it only sets the model's primary device: CPU by default)."""
    names = names or GenaiNames()
    _check_wiring(facts, pipeline, names)
    if not 0 <= kv_pad_value <= 255:
        raise ConfigError(f"kv_pad_value must be a uint8 (the KV zero point), got {kv_pad_value}")
    max_length = facts.context_len if max_length is None else max_length
    if not facts.prompt_len < max_length <= facts.context_len:
        raise ConfigError(
            f"max_length ({max_length}) must be in ({facts.prompt_len}, {facts.context_len}]"
        )
    eos = facts.eos_tokens
    return {
        "model": {
            "type": "decoder-pipeline",
            "bos_token_id": facts.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
            "pad_token_id": facts.pad_token_id,
            "vocab_size": facts.vocab_size,
            "context_length": facts.context_len,
            "decoder": {
                "session_options": (default_session or Session.cpu()).to_json(),
                "head_size": facts.head_dim,
                "hidden_size": facts.hidden_size,
                "num_attention_heads": facts.num_attention_heads,
                "num_key_value_heads": facts.num_key_value_heads,
                "num_hidden_layers": facts.num_hidden_layers,
                "inputs": {
                    "input_ids": names.input_ids,
                    "attention_mask": names.attention_mask,
                    "position_ids": names.position_ids,
                    "past_key_names": names.past_key,
                    "past_value_names": names.past_value,
                },
                "outputs": {
                    "logits": names.logits,
                    "present_key_names": names.present_key,
                    "present_value_names": names.present_value,
                },
                "sliding_window": {
                    "window_size": facts.prompt_len,
                    "pad_value": kv_pad_value,
                    "alignment": "right",
                    "slide_key_value_cache": True,
                    "slide_inputs": True,
                },
                "pipeline": [{entry.name: entry.to_json() for entry in pipeline}],
            },
        },
        "search": {
            "do_sample": False,
            "num_beams": 1,
            "num_return_sequences": 1,
            "top_k": 1,
            "top_p": 1.0,
            "temperature": 1.0,
            "repetition_penalty": 1.0,
            "length_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0,
            "early_stopping": True,
            "min_length": 0,
            "max_length": max_length,
            "past_present_share_buffer": False,
        },
    }


def write_genai_config(
    directory: str | Path,
    facts: LlmFacts,
    pipeline: Sequence[PipelineEntry],
    **options: Any,
) -> Path:
    """Write ``genai_config.json`` (:func:`genai_config`, ``options`` passed on) into
    ``directory``, after checking that every entry's file is there; returns its path."""
    out = Path(directory)
    missing = [e.filename for e in pipeline if not (out / e.filename).is_file()]
    if missing:
        raise ConfigError(f"pipeline files missing from {out}: {missing}")
    config = genai_config(facts, pipeline, **options)
    path = out / CONFIG_NAME
    # Entry order is run order: never sort the keys.
    path.write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")
    return path
