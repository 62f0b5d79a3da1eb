"""The onnxruntime-genai bundle of the part graphs: a folder a runtime loads as it is.

``cpu/`` holds every part graph (QDQ, runs on any CPU), the position processor (genai's integer
mask and positions in, the graphs' float mask and rotary tables out) and ``genai_config.json``:
a ``decoder-pipeline`` whose entries run in order, each part's prompt graph on the prompt
windows and its token graph on generated tokens, with genai's windowed KV cache holding each
layer's integer keys and values (:mod:`.genai_config`).

The float bundle (no preset, no ``kv_bits``) is other graphs in the same folder: one per part
(``float_<i>_of_<n>.onnx``), run on the prompt and on every token, any number of tokens after
any past, with genai's default KV cache, float end to end (the windowed cache holds uint8
only: onnxruntime-genai refuses any other type for it), and a position processor for a mask as
long as the tokens so far.
"""

from __future__ import annotations

import json
from typing import Any

from graphbuild.engine.codecs import FileArtifact
from graphbuild.errors import ConfigError
from graphbuild.targets.qnn.llm.adapters import find_causal_lm
from graphbuild.targets.qnn.llm.genai_config import (
    CONFIG_NAME,
    genai_config,
    position_processor_entry,
)
from graphbuild.targets.qnn.llm.genai_pipeline import LlmFacts, PipelineEntry, Session
from graphbuild.targets.qnn.llm.parts import FLOAT, MASK_MIN
from graphbuild.targets.qnn.llm.plan import KINDS, LlmPlan
from graphbuild.targets.qnn.llm.position_processor import (
    build_float_position_processor,
    build_position_processor,
)

#: The folder of the CPU bundle in the output directory.
CPU = "cpu"
PROCESSOR = "position-processor.onnx"


def rotary(model: Any, samples: Any, context: Any) -> dict[str, Any]:
    """The model's rotary frequencies (its RoPE scaling applied) and table scaling: what the
    position processor computes the graphs' cos and sin inputs from."""
    lm = find_causal_lm(model)
    return {"inv_freq": lm.inv_freq().tolist(), "scaling": lm.attention_scaling()}


def genai_facts(plan: LlmPlan) -> LlmFacts:
    """What genai's configuration says of the model. A model without a padding token pads
    with its end-of-sequence token (genai marks the prompt's padding by that id)."""
    f = plan.facts
    eos = f.eos_token_id if isinstance(f.eos_token_id, int) else tuple(f.eos_token_id or ())
    first_eos = eos if isinstance(eos, int) else (eos[0] if eos else None)
    pad = f.pad_token_id if f.pad_token_id is not None else first_eos
    bos = f.bos_token_id if f.bos_token_id is not None else first_eos
    if first_eos is None or pad is None or bos is None:
        raise ConfigError(
            "the model's config names no eos_token_id: onnxruntime-genai needs one to stop "
            "and to pad the prompt; set config.eos_token_id"
        )
    return LlmFacts(
        f.vocab,
        f.hidden,
        f.heads,
        f.kv_heads,
        f.head_dim,
        f.layers,
        plan.context_len,
        plan.prompt_len,
        bos,
        eos,
        pad,
    )


def pipeline_entries(
    plan: LlmPlan, session: Session, kinds: tuple[str, ...] = KINDS
) -> list[PipelineEntry]:
    """The position processor, then each part's prompt and token graphs (or its float graph,
    run on both), in run order."""
    entries = [position_processor_entry(PROCESSOR)]
    for spec in plan.specs:
        for kind in kinds:
            name = plan.graph_name(spec.index, kind)
            entries.append(
                PipelineEntry(
                    name,
                    f"{name}.onnx",
                    tuple(spec.input_names()),
                    tuple(spec.output_names()),
                    run_on_prompt=kind != "token",
                    run_on_token_gen=kind != "prompt",
                    session=session,
                )
            )
    return entries


def cpu_bundle(inputs: tuple, samples: Any, context: Any) -> dict[str, FileArtifact]:
    """``cpu/genai_config.json`` and ``cpu/position-processor.onnx``; the graphs beside them
    are the ``p<i>.<kind>.graph`` products."""
    plan_json, rotary_json = inputs
    return genai_bundle_files(
        CPU, LlmPlan.from_json(plan_json), rotary_json, Session.cpu(), context["kv_bits"] or 8
    )


def genai_bundle_files(
    folder: str, plan: LlmPlan, rotary_json: dict[str, Any], session: Session, bits: int
) -> dict[str, FileArtifact]:
    """``<folder>/genai_config.json`` (every part graph on ``session``) and
    ``<folder>/position-processor.onnx``: the files of a genai bundle besides its graphs."""
    if bits != 8:
        raise ConfigError(
            f"onnxruntime-genai keeps an 8-bit KV cache only, not kv_bits = {bits}: export the "
            "genai bundle with kv_bits = 8"
        )
    processor = build_position_processor(
        rotary_json["inv_freq"],
        context_len=plan.context_len,
        prompt_len=plan.prompt_len,
        attention_scaling=rotary_json["scaling"],
        mask_value=MASK_MIN,
    )
    config = genai_config(genai_facts(plan), pipeline_entries(plan, session))
    text = json.dumps(config, indent=2, sort_keys=False) + "\n"  # entry order is run order
    return {
        f"{folder}/{CONFIG_NAME}": FileArtifact(f"{folder}/{CONFIG_NAME}", text.encode()),
        f"{folder}/{PROCESSOR}": FileArtifact(
            f"{folder}/{PROCESSOR}", processor.SerializeToString(deterministic=True)
        ),
    }


def float_bundle(inputs: tuple, samples: Any, context: Any) -> dict[str, FileArtifact]:
    """The float bundle's ``cpu/genai_config.json`` (no sliding window: genai's default float
    KV cache) and ``cpu/position-processor.onnx``; the ``p<i>.float.graph`` products are its
    graphs."""
    plan_json, rotary_json = inputs
    plan = LlmPlan.from_json(plan_json)
    processor = build_float_position_processor(
        rotary_json["inv_freq"], attention_scaling=rotary_json["scaling"], mask_value=MASK_MIN
    )
    entries = pipeline_entries(plan, Session.cpu(), (FLOAT,))
    config = genai_config(genai_facts(plan), entries, windowed=False)
    text = json.dumps(config, indent=2, sort_keys=False) + "\n"  # entry order is run order
    return {
        f"{CPU}/{CONFIG_NAME}": FileArtifact(f"{CPU}/{CONFIG_NAME}", text.encode()),
        f"{CPU}/{PROCESSOR}": FileArtifact(
            f"{CPU}/{PROCESSOR}", processor.SerializeToString(deterministic=True)
        ),
    }
