"""One part graph's build inside the LLM export's pipeline.

Each part graph (part ``i``, prompt or token) is built by the QNN target's own ``onnx_qdq``
pipeline, with its stages renamed ``p<i>.<kind>.<stage>`` and run on a view of the export: the
part's module instead of the causal LM, the part's shapes instead of the token samples, the
inputs generation fed the part instead of the calibration prompts, the graph's name and I/O
names instead of the model's. :func:`include_part` copies the stages and rewrites what they
declare so the keys stay exact:

- ``input.state`` / ``input`` become the part's own weight digests (an upstream stage): a weight
  change in one part leaves the other parts' stages clean;
- ``input.structure`` / ``input`` become the digests of the part's module tree (an upstream
  stage): a change to another part's modules or to what the model carries beside them (its
  tokenizer) traces nothing here;
- ``samples.*`` become the part plan (shapes follow from it);
- a stage that calibrates (reads ``ctx.calibration``) also depends on the part's recorded inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from graphbuild.engine.pipeline import UNKEYED_INPUT, Pipeline, StageRef
from graphbuild.targets.qnn.llm.adapters import find_causal_lm
from graphbuild.targets.qnn.llm.plan import LlmPlan

_STATE_READS = {"input", "input.state"}
_STRUCTURE_READS = {"input", "input.structure"}
_SAMPLE_READS = {"samples", "samples.spec", "samples.values"}


class PartContext(Mapping[str, Any]):
    """The context a part graph's stage sees: the export's, with the part's graph name, I/O
    names and calibration batches, and the part's module as ``input``."""

    def __init__(self, outer: Any, plan: LlmPlan, index: int, kind: str, batches: Any) -> None:
        self._outer = outer
        spec = plan.spec(index)
        self._own = {
            "model_name": plan.graph_name(index, kind),
            "input_names": spec.input_names(),
            "output_names": spec.output_names(),
            "calibration": batches,
            "check_numerics": False,
            "check_htp": False,
        }
        self._plan = plan
        self._index = index
        self._kind = kind
        self.stage = getattr(outer, "stage", "?")

    def __getitem__(self, key: str) -> Any:
        if key in self._own:
            _ = key in self._outer  # the stage must still have declared it: raises if not
            return self._own[key]
        return self._outer[key]

    def get(self, key: str, default: Any = None) -> Any:
        # not Mapping.get: it would catch the KeyError an undeclared read raises
        if key in self._own:
            return self[key]
        return self._outer.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._outer)

    def __len__(self) -> int:
        return len(self._outer)

    @property
    def input(self) -> Any:
        return self._plan.part_module(find_causal_lm(self._outer.input), self._index, self._kind)


def run_in_part(
    fn: Any,
    index: int,
    kind: str,
    extra: int,
    root: bool,
    calibrates: bool,
    inputs: tuple,
    samples: Any,
    context: Any,
) -> Any:
    """Run a part graph's stage ``fn``: its own inputs first, then ``extra`` added ones (the
    plan last, the recorded batches first when the stage calibrates). A stage that was a root
    of its own pipeline is handed the part's module, as a root stage is handed the model."""
    own, added = inputs[: len(inputs) - extra], inputs[len(inputs) - extra :]
    plan = LlmPlan.from_json(added[-1])
    batches = added[0] if calibrates else None
    part = PartContext(context, plan, index, kind, batches)
    return fn(part.input if root else tuple(own), plan.sample_inputs(index, kind), part)


def include_part(
    p: Pipeline,
    sub: Pipeline,
    index: int,
    kind: str,
    plan: StageRef,
    state: StageRef,
    structure: StageRef,
    batches: StageRef | None,
    replace: Mapping[str, Callable[..., Any]] | None = None,
) -> dict[str, str]:
    """Copy ``sub``'s stages into ``p`` as ``p<index>.<kind>.<name>``; returns old -> new names.
    ``state`` and ``structure`` are the part's weight and module-tree digests (``p<i>.state``,
    ``p<i>.structure``). ``replace`` runs another function for a stage, under its declared
    reads (the float graphs' ``capture``); ``batches`` is None where no stage calibrates (a
    float graph)."""
    replace = replace or {}
    prefix = f"p{index}.{kind}."
    names = {name: prefix + name for name in sub.order()}
    for name in sub.order():
        stage = sub.get_stage(name).stage
        reads = set(stage.reads) if stage.reads is not None else {"input", "samples"}
        extra: list[StageRef] = []
        new_reads = {r for r in reads if r not in _STATE_READS | _STRUCTURE_READS | _SAMPLE_READS}
        if reads & _STATE_READS or stage.reads is None:
            new_reads.add(UNKEYED_INPUT)
            extra.append(state)
        if reads & _STRUCTURE_READS or stage.reads is None:
            new_reads.add(UNKEYED_INPUT)
            extra.append(structure)
        calibrates = "ctx.calibration" in reads or "samples.values" in reads
        if calibrates:
            if batches is None:
                raise ValueError(f"stage {name} of p{index}.{kind} calibrates: it needs batches")
            extra.insert(0, batches)
        extra.append(plan)
        if UNKEYED_INPUT in reads:
            new_reads.add(UNKEYED_INPUT)
        root = not sub.dependencies(name)
        own = replace.get(name, stage.fn)
        fn = functools.partial(run_in_part, own, index, kind, len(extra), root, calibrates)
        ref = p.register_stage(
            fn,
            names[name],
            capture_stage_output=stage.capture_output,
            reads=tuple(sorted(new_reads)),
            version=stage.version,
            rematerialize=stage.rematerialize,
        )
        ref.depends_on(*[names[d] for d in sub.dependencies(name)], *extra)
    return names
