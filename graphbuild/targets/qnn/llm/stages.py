"""The LLM export's own stages: the plan, generation-time statistics, per-part views of them,
and the KV boundary of each part graph.

Structure: ``llm_plan`` (the parts and the model's facts). Statistics: ``llm_generation`` runs
the calibration prompts as a runtime would (prompt, then tokens) and records what each part
received and the range of every KV tensor; it is large and cheap to redo relative to storing
it, so the cache keeps its digest only. Values: ``p<i>.kv`` (the part's KV encodings),
``p<i>.<kind>.batches`` (its calibration batches), ``p<i>.state`` (digests of its weights, which
the part graph's value stages key on instead of the whole model's state), ``p<i>.structure``
(digests of its module tree, what its traces key on instead of the whole model's structure).
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from graphbuild.engine.fingerprint import state_digests, structure_fingerprint
from graphbuild.errors import ConfigError, FingerprintError
from graphbuild.frontend.capture import capture_program
from graphbuild.targets.qnn.llm.adapters import find_causal_lm
from graphbuild.targets.qnn.llm.bundle import CPU
from graphbuild.targets.qnn.llm.kv_io import kv_encoding, quantize_kv_io
from graphbuild.targets.qnn.llm.parts import FLOAT
from graphbuild.targets.qnn.llm.plan import KINDS, LlmPlan, float_dynamic_shapes, make_plan
from graphbuild.targets.qnn.llm.runner import PartRunner


def llm_plan(model: Any, samples: Any, context: Any) -> dict[str, Any]:
    """The parts of the export (see :func:`~.plan.make_plan`)."""
    lm = find_causal_lm(model)
    plan = make_plan(
        lm,
        prompt_len=context["prompt_len"],
        context_len=context["context_len"],
        parts=context["parts"],
        max_part_bytes=context["max_part_bytes"],
        quantizer=context["quantizer"],
    )
    return plan.to_json()


def token_ids(batch: Any, what: str) -> list[int]:
    """``batch`` (an integer tensor of token ids [1, P], or a tuple holding one) as a list;
    a ConfigError naming ``what`` for anything else."""
    ids = batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 1 else batch
    if (
        not isinstance(ids, torch.Tensor)
        or ids.is_floating_point()
        or ids.dim() != 2
        or ids.shape[0] != 1
        or ids.shape[1] == 0
    ):
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ConfigError(
            f"{what} must be token ids, an integer tensor of shape [1, P] (or a tuple "
            f"holding one), for the llm format: got {got}"
        )
    return [int(t) for t in ids[0]]


def token_prompts(calibration: Any, samples: Any) -> list[list[int]]:
    """The calibration sequences as token id lists; without calibration, the sample prompt."""
    if not calibration:
        return [token_ids(samples, "the sample inputs")]
    return [token_ids(b, f"calibration batch {i}") for i, b in enumerate(calibration)]


def llm_generation(inputs: tuple, samples: Any, context: Any) -> dict[str, Any]:
    """Each calibration sequence run as a runtime runs it: all but its last
    ``calibration_steps`` tokens through the prompt graphs, then those one at a time through
    the token graphs (teacher forcing, so a layer's statistics depend on the tokens and the
    layers before it alone). Records every part's inputs per graph kind, and the largest
    |value| of each KV tensor. ``inputs``: the plan, then each part's structure digests (which
    key it: the rest of the model is not run)."""
    plan_json = inputs[0]
    plan = LlmPlan.from_json(plan_json)
    lm = find_causal_lm(context.input)
    batches: dict[str, list[tuple[torch.Tensor, ...]]] = {
        f"{s.index}.{k}": [] for s in plan.specs for k in KINDS
    }

    def record(spec: Any, kind: str, part_inputs: tuple[torch.Tensor, ...]) -> None:
        batches[f"{spec.index}.{kind}"].append(tuple(t.clone() for t in part_inputs))

    runner = PartRunner(lm, plan.specs, plan.prompt_len, plan.context_len, recorder=record)
    kv: dict[str, float] = {}
    steps = context["calibration_steps"]
    for sequence in token_prompts(context["calibration"], samples):
        split = max(1, len(sequence) - steps)
        runner.replay(sequence[:split], sequence[split:])
        for name, tensor in runner.cache.items():
            kv[name] = max(kv.get(name, 0.0), float(tensor.abs().max()))
    return {"batches": batches, "kv": dict(sorted(kv.items()))}


def graph_plan(index: int, kind: str, inputs: tuple, samples: Any, context: Any) -> dict:
    """The plan as part ``index``'s ``kind`` graph sees it (:meth:`~.plan.LlmPlan.for_graph`)."""
    (plan_json,) = inputs
    return LlmPlan.from_json(plan_json).for_graph(index, kind).to_json()


def part_batches(index: int, kind: str, inputs: tuple, samples: Any, context: Any) -> list:
    """What part ``index``'s ``kind`` graph received during calibration."""
    (recording,) = inputs
    return recording["batches"][f"{index}.{kind}"]


def part_kv(index: int, inputs: tuple, samples: Any, context: Any) -> dict[str, list]:
    """The KV encodings of part ``index``'s layers: (scale, zero point) per tensor."""
    recording, plan_json = inputs
    spec = LlmPlan.from_json(plan_json).spec(index)
    bits = kv_bits(context)
    out = {}
    for layer in spec.layers:
        for kind in ("key", "value"):
            name = f"past_{kind}_{layer}"
            out[name] = list(kv_encoding(recording["kv"].get(name, 0.0), bits))
    return out


def part_state(index: int, inputs: tuple, samples: Any, context: Any) -> dict[str, str]:
    """Digests of part ``index``'s own weights: what its graph's value stages key on."""
    (plan_json,) = inputs
    plan = LlmPlan.from_json(plan_json)
    module = plan.part_module(find_causal_lm(context.input), index)
    return dict(sorted(state_digests(module).tensors.items()))


def part_structure(index: int, inputs: tuple, samples: Any, context: Any) -> dict[str, Any]:
    """Digests of part ``index``'s module tree (its classes, attributes and code): what its
    graphs' traces key on instead of the whole model's structure, so a change elsewhere in the
    model (its tokenizer, another part's layers) reruns this stage alone and traces nothing.
    A tree that cannot be fingerprinted gives a digest of its own each run: always retrace,
    never a stale graph."""
    (plan_json,) = inputs
    plan = LlmPlan.from_json(plan_json)
    module = plan.part_module(find_causal_lm(context.input), index)
    try:
        fp = structure_fingerprint(module)
    except FingerprintError as err:
        return {"unfingerprintable": str(err), "run": uuid.uuid4().hex}
    return {"digest": fp.digest, "modules": dict(sorted(fp.modules.items()))}


def capture_float(model: Any, samples: Any, context: Any) -> Any:
    """The float graph's ``capture``: the part traced with the new tokens and the past any
    size (:func:`~.plan.float_dynamic_shapes`)."""
    return capture_program(model, samples, dynamic_shapes=float_dynamic_shapes(samples))


def float_graph(index: int, inputs: tuple, samples: Any, context: Any) -> dict:
    """The float bundle's graph of part ``index``, float KV and all, under its file name."""
    bound, plan_json = inputs
    plan = LlmPlan.from_json(plan_json)
    return {f"{CPU}/{plan.graph_name(index, FLOAT)}.onnx": bound}


def kv_bits(context: Any) -> int:
    """The bits of the static graphs' KV cache: ``kv_bits``, 8 where the option is unset."""
    return context["kv_bits"] or 8


def kv_graph(index: int, kind: str, inputs: tuple, samples: Any, context: Any) -> dict:
    """The part graph with its KV cache as integers (:mod:`.kv_io`), under its file name."""
    bound, encodings, plan_json = inputs
    plan = LlmPlan.from_json(plan_json)
    if plan.spec(index).layers:
        bound = quantize_kv_io(bound, encodings, kv_bits(context))
    return {f"{CPU}/{plan.graph_name(index, kind)}.onnx": bound}


def _canonical(entry: Any) -> Any:
    """``entry`` with a dict's keys in sorted order: a report built here and the same report
    read back from the cache (which stores a dict's keys sorted) print alike, so the summary
    is the same whichever process built the part graphs."""
    return {k: entry[k] for k in sorted(entry)} if isinstance(entry, dict) else entry


def coverage_summary(
    names: tuple[str, ...], inputs: tuple, samples: Any, context: Any
) -> dict[str, Any]:
    """The part graphs' coverage reports (of the graphs ``names``) as one: the totals, each
    graph's summary, and every tensor left float, named with its graph."""
    expected = quantized = 0
    graphs: dict[str, str] = {}
    left: list[str] = []
    for name, report in zip(names, inputs, strict=True):
        expected += int(report.get("expected", 0))
        quantized += int(report.get("quantized", 0))
        graphs[name] = report.get("summary", "")
        left += [f"{name}: {_canonical(t)}" for t in report.get("float", [])]
    summary = (
        f"{quantized}/{expected} tensors quantized as QNN HTP runs them in {len(graphs)} graphs"
    )
    return {
        "summary": summary,
        "expected": expected,
        "quantized": quantized,
        "float": left,
        "graphs": graphs,
    }
