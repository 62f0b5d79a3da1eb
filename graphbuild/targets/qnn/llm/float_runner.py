"""The float bundle run in onnxruntime as onnxruntime-genai runs it, for machines without genai.

genai's default KV cache, for one sequence: the whole prompt in one run, then one token per
run; each run feeds the position processor genai's mask (ones over every token so far) and
the positions of the run's tokens, then the parts in order, each layer's past keys and values
``[1, H, P, D]`` (empty at first) and takes its presents ``[1, H, P+S, D]`` as the next past.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from graphbuild.targets.qnn.llm.genai_config import CONFIG_NAME, check_length
from graphbuild.targets.qnn.llm.genai_pipeline import GenaiNames


def float_generation(
    bundle: Path, prompt: list[int], steps: int
) -> tuple[list[int], list[np.ndarray]]:
    """``steps`` greedy tokens after ``prompt`` from the float bundle in ``bundle``, and the
    logits each was chosen from. A prompt and ``steps`` that do not fit the bundle's length
    are a :class:`~graphbuild.targets.qnn.llm.errors.ContextLengthError`, as in genai's path
    (past it, positions overrun the rotary table: onnxruntime fails on a Gather index)."""
    import onnxruntime as ort

    config = json.loads((Path(bundle) / CONFIG_NAME).read_text())
    check_length(config, len(prompt), steps)
    decoder = config["model"]["decoder"]
    names = GenaiNames()
    entries = list(decoder["pipeline"][0].values())
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sessions = [
        ort.InferenceSession(str(Path(bundle) / e["filename"]), options, ["CPUExecutionProvider"])
        for e in entries
    ]
    empty = np.zeros((1, decoder["num_key_value_heads"], 0, decoder["head_size"]), np.float32)
    layers = range(decoder["num_hidden_layers"])
    fed_by = {names.past_key % i: names.present_key % i for i in layers}
    fed_by |= {names.past_value % i: names.present_value % i for i in layers}
    cache = dict.fromkeys(fed_by, empty)
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    ids = list(prompt)
    total = 0
    for _ in range(steps):
        total += len(ids)
        values: dict[str, np.ndarray] = {
            names.input_ids: np.array([ids], np.int32),
            names.attention_mask: np.ones((1, total), np.int32),
            names.position_ids: np.arange(total - len(ids), total, dtype=np.int32)[None],
            **cache,
        }
        for entry, session in zip(entries, sessions, strict=True):
            outputs = session.run(entry["outputs"], {n: values[n] for n in entry["inputs"]})
            values.update(zip(entry["outputs"], outputs, strict=True))
        cache = {name: values[present] for name, present in fed_by.items()}
        row = values[names.logits][0, -1].astype(np.float32)
        logits.append(row)
        tokens.append(int(row.argmax()))
        ids = [tokens[-1]]
    return tokens, logits
