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

The model's facts, the entries and their sessions are typed in :mod:`.genai_pipeline`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphbuild.errors import ConfigError
from graphbuild.targets.qnn.llm.errors import ContextLengthError
from graphbuild.targets.qnn.llm.genai_pipeline import GenaiNames, LlmFacts, PipelineEntry, Session
from graphbuild.targets.qnn.llm.position_processor import PROCESSOR_OUTPUTS

__all__ = [
    "check_length",
    "CONFIG_NAME",
    "genai_config",
    "onnx_io_names",
    "part_entry",
    "position_processor_entry",
    "write_genai_config",
]

CONFIG_NAME = "genai_config.json"
#: The KV zero point of the format (uint8, symmetric): never-written slots hold it.
DEFAULT_KV_PAD_VALUE = 128


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
    windowed: bool = True,
) -> dict[str, Any]:
    """The ``genai_config.json`` content (a dict) for ``pipeline`` run in order.

    ``windowed=False`` leaves ``sliding_window`` out: genai then keeps its default KV cache
    (float, past ``[1, H, P, D]`` in, present ``[1, H, P+S, D]`` out, the whole prompt in one
    run), which the float bundle's graphs take.

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
    window = {
        "sliding_window": {
            "window_size": facts.prompt_len,
            "pad_value": kv_pad_value,
            "alignment": "right",
            "slide_key_value_cache": True,
            "slide_inputs": True,
        }
    }
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
                **(window if windowed else {}),
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


def check_length(config: dict[str, Any], prompt_len: int, new_tokens: int) -> None:
    """Refuse (:class:`ContextLengthError`) a prompt of ``prompt_len`` ids and ``new_tokens``
    tokens that do not fit the bundle's ``search.max_length`` (``config``: its genai config),
    the prompt padded to whole windows where genai pads it (a bundle with a sliding window)."""
    model = config["model"]
    window = model["decoder"].get("sliding_window", {}).get("window_size", 1)
    padded = -(-prompt_len // window) * window
    limit = config["search"]["max_length"]
    if padded + new_tokens <= limit:
        return
    shown = f"{prompt_len} ids" + (
        f", {padded} padded to whole windows of {window}" if padded != prompt_len else ""
    )
    fewer = (
        f"generate at most {limit - padded} new tokens"
        if padded < limit
        else f"give a prompt of at most {limit - 1} ids"
    )
    raise ContextLengthError(
        f"the prompt ({shown}) and {new_tokens} new tokens ({padded + new_tokens}) exceed the "
        f"bundle's max_length {limit} (context_len {model['context_length']}): export with a "
        f"larger context_len, or {fewer}"
    )
