"""The ``qnn/llm`` pipeline: a causal LM as prompt and token graphs, split into parts.

::

    llm_plan ----------------------------+---------------------------------+
      |                                  |                                 |
      +-> llm_generation (digest only) -> p<i>.<kind>.batches              |
      |          +-----------------------> p<i>.kv                         |
      +-> p<i>.state                                                       |
                                                                           v
    p<i>.<kind>.capture -> ... -> p<i>.<kind>.bind -> p<i>.<kind>.graph (KV as integers)

Every part graph is the QNN target's ``onnx_qdq`` build of the part's module (:mod:`.include`),
so the presets, range methods and the HTP's fully quantized QDQ forms are those of the other
formats. Each part is independent: a weight change in one layer reruns the value stages of the
part that holds it (and, with a preset, the calibration of the parts after it, whose inputs
changed); a retune reruns values only; ``prompt_len`` / ``context_len`` change the shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from graphbuild.engine.pipeline import Pipeline, StageRef
from graphbuild.errors import ConfigError
from graphbuild.targets.base import Request, coerce_options
from graphbuild.targets.qnn.arch.targets import HtpTarget
from graphbuild.targets.qnn.htp_runtime.shared_weights import require_weight_sharing
from graphbuild.targets.qnn.llm import bundle, htp_bundle, stages
from graphbuild.targets.qnn.llm.adapters import find_causal_lm
from graphbuild.targets.qnn.llm.bundle import CPU
from graphbuild.targets.qnn.llm.check import check_generation, check_generation_htp
from graphbuild.targets.qnn.llm.costs import declare_part_costs, part_bytes
from graphbuild.targets.qnn.llm.genai_config import CONFIG_NAME
from graphbuild.targets.qnn.llm.include import include_part
from graphbuild.targets.qnn.llm.plan import KINDS, make_plan
from graphbuild.targets.qnn.options import QnnOnnxOptions


def build_llm_pipeline(request: Request) -> Pipeline:
    """The pipeline of an ``llm`` export. The part count decides which stages exist, so the
    plan is made here, from the request's model (which also refuses a model or options the
    format cannot take before any stage runs); ``llm_plan`` makes it again as a keyed stage."""
    from graphbuild.targets.qnn.pipeline.build import build_qnn_pipeline

    opts = coerce_options(QnnOnnxOptions, request.options, request.target)
    model = getattr(request, "model", None)
    # token ids, or an error now, before any stage runs
    stages.token_ids(getattr(request, "data", None), "the sample inputs")
    stages.token_prompts(opts.calibration, getattr(request, "data", None))
    targets = opts.htp_targets() if opts.contexts else ()
    for t in targets:  # before any work: contexts share weights from v73 on
        try:
            require_weight_sharing(t)
        except ConfigError as exc:
            raise ConfigError(
                f"contexts = true prepares each part's graphs into one weight-shared context: "
                f"{exc}. Set htp_arch to v73 or later, or contexts = false"
            ) from exc
    layout = make_plan(
        find_causal_lm(model),
        prompt_len=opts.prompt_len,
        context_len=opts.context_len,
        parts=opts.parts,
        max_part_bytes=opts.max_part_bytes,
        quantizer=opts.quantizer,
    )
    specs = layout.specs
    p = Pipeline(name=f"{request.target}/llm")
    plan = p.register_stage(
        stages.llm_plan,
        "llm_plan",
        reads=(
            "input.structure",
            "ctx.prompt_len",
            "ctx.context_len",
            "ctx.parts",
            "ctx.max_part_bytes",
            "ctx.quantizer",
            "registry.llm_adapters",
        ),
    )
    generation = p.register_stage(
        stages.llm_generation,
        "llm_generation",
        reads=(
            "input.state",
            "input.structure",
            "ctx.calibration",
            "ctx.calibration_steps",
            "samples.values",
        ),
        rematerialize=True,
    ).depends_on(plan)
    sub_opts = replace(
        opts, check_numerics=False, check_htp=False, input_names=None, output_names=None
    )
    sub_request = _SubRequest(request.target, "onnx_qdq", request.model_name, sub_opts)
    products, coverages, graph_names, graphs_of = [], [], [], {}
    lm = find_causal_lm(model)
    held = {i: part_bytes(layout.part_module(lm, i)) for i in range(1, len(specs) + 1)}
    p.declare_cost(generation, memory=part_bytes(model))
    for index in range(1, len(specs) + 1):
        state = p.register_stage(
            functools.partial(stages.part_state, index), f"p{index}.state", reads=("input.state",)
        ).depends_on(plan)
        kv = p.register_stage(
            functools.partial(stages.part_kv, index), f"p{index}.kv", reads=("ctx.kv_bits",)
        ).depends_on(generation, plan)
        for kind in KINDS:
            batches = p.register_stage(
                functools.partial(stages.part_batches, index, kind),
                f"p{index}.{kind}.batches",
                reads=(),
                rematerialize=True,
            ).depends_on(generation)
            view = p.register_stage(
                functools.partial(stages.graph_plan, index, kind), f"p{index}.{kind}.plan", reads=()
            ).depends_on(plan)
            sub = build_qnn_pipeline(sub_request, "onnx_qdq")
            names = include_part(p, sub, index, kind, view, state, batches)
            declare_part_costs(p, names, held[index])
            graph = p.register_stage(
                functools.partial(stages.kv_graph, index, kind),
                f"p{index}.{kind}.graph",
                reads=("ctx.kv_bits",),
            ).depends_on(names["bind"], kv, view)
            products.append(graph.name)
            graphs_of.setdefault(index, []).append(graph)
            coverages.append(names["coverage"])
            graph_names.append(layout.graph_name(index, kind))
    coverage = p.register_stage(
        functools.partial(stages.coverage_summary, tuple(graph_names)), "coverage", reads=()
    )
    coverage.depends_on(*coverages)
    p.reports["coverage"] = coverage.name
    files = {f"{CPU}/{name}.onnx" for name in graph_names}
    rope = None
    if opts.kv_bits == 8:  # onnxruntime-genai's windowed cache holds uint8 only
        rope = p.register_stage(bundle.rotary, "rotary", reads=("input.state",))
        cpu = p.register_stage(bundle.cpu_bundle, "cpu_bundle", reads=("ctx.kv_bits",))
        cpu.depends_on(plan, rope)
        graphs = list(products)
        products.append(cpu.name)
        files |= {f"{CPU}/{CONFIG_NAME}", f"{CPU}/{bundle.PROCESSOR}"}
        if opts.check_numerics:
            check = p.register_stage(
                check_generation, "check_generation", reads=("input", "samples")
            )
            check.depends_on(plan, cpu, *graphs)
            p.reports["numerics"] = check.name
    if opts.check_htp:
        _add_htp_checks(p, opts.htp_targets(), plan, graphs_of)
    if targets:
        products += _add_context_stages(p, targets, graphs_of, plan, rope)
        files |= htp_bundle.bundle_files(
            layout, request.model_name, targets, genai=rope is not None
        )
    p.products = products
    p.parallel_safe = True  # the parts' stages declared their costs; the tracing ones run alone
    p.output_files = frozenset(files)
    return p


def _add_context_stages(
    p: Pipeline,
    targets: Sequence[HtpTarget],
    graphs_of: dict[int, list[StageRef]],
    plan: StageRef,
    rope: StageRef | None,
) -> list[str]:
    """``p<i>.context.<label>`` per part and HTP target, ``htp_bundle`` (with an 8-bit KV
    cache: genai's) and ``genie_bundle`` (:mod:`.htp_bundle`); their names, as products."""
    from graphbuild.targets.qnn.pipeline.htp import HTP_BACKEND, QNN_HTP

    names = []
    for t in targets:
        htp, genie = htp_bundle.folders(t, targets)
        for index, graphs in graphs_of.items():
            stage = functools.partial(
                htp_bundle.part_context,
                index,
                len(graphs_of),
                htp,
                genie,
                htp_arch=t.htp_arch,
                soc_model=t.soc_model,
            )
            ref = p.register_stage(
                stage,
                f"p{index}.context.{t.label}",
                reads=("ctx.model_name", HTP_BACKEND, QNN_HTP),
            ).depends_on(*graphs)
            names.append(ref.name)
    pairs = tuple((t.htp_arch, t.soc_model) for t in targets)
    if rope is not None:
        names.append(
            p.register_stage(
                functools.partial(htp_bundle.htp_bundle, pairs),
                "htp_bundle",
                reads=("ctx.kv_bits", HTP_BACKEND),
            )
            .depends_on(plan, rope)
            .name
        )
    genie = p.register_stage(
        functools.partial(htp_bundle.genie_bundle, pairs),
        "genie_bundle",
        reads=("ctx.model_name", "input.structure"),
    ).depends_on(plan)
    return [*names, genie.name]


def _add_htp_checks(
    p: Pipeline, targets: Sequence[HtpTarget], plan: StageRef, graphs_of: dict[int, list[StageRef]]
) -> None:
    """``check_htp_<label>`` per HTP target (:func:`.check.check_generation_htp`); the first
    target's report is the export's ``htp`` report."""
    from graphbuild.targets.qnn.pipeline.htp import HTP_BACKEND, QNN_HTP

    graphs = [g for index in sorted(graphs_of) for g in graphs_of[index]]
    for i, t in enumerate(targets):
        check = p.register_stage(
            functools.partial(check_generation_htp, t.htp_arch, t.soc_model),
            f"check_htp_{t.label}",
            reads=("input", "samples", HTP_BACKEND, QNN_HTP),
        ).depends_on(plan, *graphs)
        if i == 0:
            p.reports["htp"] = check.name


class _SubRequest:
    """The request a part graph's ``onnx_qdq`` pipeline is built from."""

    def __init__(self, target: str, fmt: str, model_name: str, options: Any) -> None:
        self.target = target
        self.format = fmt
        self.model_name = model_name
        self.options = options
