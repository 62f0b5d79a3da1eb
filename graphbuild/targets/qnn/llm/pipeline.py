"""The ``qnn/llm`` pipeline: a causal LM as prompt and token graphs, split into parts.

::

    llm_plan ----------------------------+---------------------------------+
      |                                  |                                 |
      +-> llm_generation (digest only) -> p<i>.<kind>.batches              |
      |          +-----------------------> p<i>.kv                         |
      +-> p<i>.state, p<i>.structure (the part's weight / module digests)  |
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
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from graphbuild.engine.pipeline import UNKEYED_INPUT, Pipeline, StageRef
from graphbuild.errors import ConfigError
from graphbuild.targets.base import Request, coerce_options
from graphbuild.targets.qnn.arch.targets import HtpTarget
from graphbuild.targets.qnn.htp_runtime.shared_weights import require_weight_sharing
from graphbuild.targets.qnn.llm import bundle, htp_bundle, stages
from graphbuild.targets.qnn.llm.adapters import find_causal_lm
from graphbuild.targets.qnn.llm.bundle import CPU
from graphbuild.targets.qnn.llm.check import check_generation, check_generation_htp
from graphbuild.targets.qnn.llm.costs import (
    declare_context_cost,
    declare_generation_check_cost,
    declare_htp_check_cost,
    declare_part_costs,
    part_bytes,
)
from graphbuild.targets.qnn.llm.genai_config import CONFIG_NAME
from graphbuild.targets.qnn.llm.include import include_part
from graphbuild.targets.qnn.llm.parts import FLOAT
from graphbuild.targets.qnn.llm.plan import KINDS, LlmPlan, make_plan
from graphbuild.targets.qnn.llm.tokenizer import (
    TOKENIZER,
    TOKENIZER_CONFIG,
    model_tokenizer,
    tokenizer_files,
)
from graphbuild.targets.qnn.options import QnnOnnxOptions


def build_llm_pipeline(request: Request) -> Pipeline:
    """The pipeline of an ``llm`` export. The part count decides which stages exist, so the
    plan is made here, from the request's model (which also refuses a model or options the
    format cannot take before any stage runs); ``llm_plan`` makes it again as a keyed stage."""

    opts = coerce_options(QnnOnnxOptions, request.options, request.target)
    model = getattr(request, "model", None)
    # token ids, or an error now, before any stage runs
    stages.token_ids(getattr(request, "data", None), "the sample inputs")
    stages.token_prompts(opts.calibration, getattr(request, "data", None))
    for wanted, option in ((opts.contexts, "contexts"), (opts.check_htp, "check_htp")):
        if wanted and opts.quantizer is None:  # the HTP takes the preset's QDQ part graphs
            raise ConfigError(
                f"{option} = true runs the part graphs on Qualcomm's HTP, which takes them "
                "quantized, and this export has no preset: set one (w8a16, w8a8, w4a16 or "
                f"w4a16_lpbq), or {option} = false for the float CPU bundle"
            )
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
    # no preset and no kv_bits: the CPU bundle is float, KV and all (genai's default cache);
    # the static graphs (integer KV) are built for a preset, kv_bits, the HTP and its check
    float_cpu = opts.quantizer is None and opts.kv_bits is None
    static = not float_cpu or bool(targets) or opts.check_htp
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
    sub_opts = replace(
        opts, check_numerics=False, check_htp=False, input_names=None, output_names=None
    )
    sub_request = _SubRequest(request.target, "onnx_qdq", request.model_name, sub_opts)
    states = [
        p.register_stage(
            functools.partial(stages.part_state, index), f"p{index}.state", reads=("input.state",)
        ).depends_on(plan)
        for index in range(1, len(specs) + 1)
    ]
    structures = [
        p.register_stage(
            functools.partial(stages.part_structure, index),
            f"p{index}.structure",
            reads=("input.structure",),
        ).depends_on(plan)
        for index in range(1, len(specs) + 1)
    ]
    lm = find_causal_lm(model)
    held = {i: part_bytes(layout.part_module(lm, i)) for i in range(1, len(specs) + 1)}
    graphs_of: dict[int, list[StageRef]] = {}
    static_graphs, coverages, graph_names = [], [], []
    contexts: list[str] = []  # each part's, registered right after its graphs

    def part_contexts(index: int, graphs: list[StageRef]) -> None:
        contexts.extend(_add_part_contexts(p, targets, index, len(specs), graphs, held[index]))

    if static:
        static_graphs, coverages, graph_names = _add_static_graphs(
            p, sub_request, layout, plan, states, structures, graphs_of, held, part_contexts
        )
    products = [] if float_cpu else [g.name for g in static_graphs]
    files = set() if float_cpu else {f"{CPU}/{name}.onnx" for name in graph_names}
    rope = None
    if float_cpu:
        float_graphs, float_coverages = _add_float_graphs(
            p, sub_request, layout, plan, states, structures, held
        )
        if not static:
            coverages = float_coverages
            graph_names = [layout.graph_name(s.index, FLOAT) for s in specs]
        rope = p.register_stage(bundle.rotary, "rotary", reads=("input.state",))
        cpu = p.register_stage(bundle.float_bundle, "cpu_bundle", reads=()).depends_on(plan, rope)
        products += [g.name for g in float_graphs] + [cpu.name]
        files |= {f"{CPU}/{layout.graph_name(s.index, FLOAT)}.onnx" for s in specs}
        files |= {f"{CPU}/{CONFIG_NAME}", f"{CPU}/{bundle.PROCESSOR}"}
        checked = float_graphs
    elif (opts.kv_bits or 8) == 8:  # onnxruntime-genai's windowed cache holds uint8 only
        rope = p.register_stage(bundle.rotary, "rotary", reads=("input.state",))
        cpu = p.register_stage(bundle.cpu_bundle, "cpu_bundle", reads=("ctx.kv_bits",))
        cpu.depends_on(plan, rope)
        products.append(cpu.name)
        files |= {f"{CPU}/{CONFIG_NAME}", f"{CPU}/{bundle.PROCESSOR}"}
        checked = static_graphs
    if rope is not None and opts.check_numerics:
        check = p.register_stage(check_generation, "check_generation", reads=("input", "samples"))
        check.depends_on(plan, cpu, *checked)
        declare_generation_check_cost(p, check.name, sum(held.values()))
        p.reports["numerics"] = check.name
    coverage = p.register_stage(
        functools.partial(stages.coverage_summary, tuple(graph_names)), "coverage", reads=()
    )
    coverage.depends_on(*coverages)
    p.reports["coverage"] = coverage.name
    if opts.check_htp:
        _add_htp_checks(p, opts.htp_targets(), plan, graphs_of, sum(held.values()))
    if targets:
        products += [*contexts, *_add_bundle_stages(p, targets, plan, rope)]
        files |= htp_bundle.bundle_files(
            layout, request.model_name, targets, genai=rope is not None
        )
    if model_tokenizer(model) is not None:  # into every bundle folder
        folders = (CPU, *(f for t in targets for f in htp_bundle.folders(t, targets)))
        tok = p.register_stage(
            functools.partial(tokenizer_files, folders), "tokenizer", reads=("input.structure",)
        )
        products.append(tok.name)
        files |= {f"{f}/{name}" for f in folders for name in (TOKENIZER, TOKENIZER_CONFIG)}
    p.products = products
    p.parallel_safe = True  # the parts' stages declared their costs; the tracing ones run alone
    p.output_files = frozenset(files)
    return p


def _add_static_graphs(
    p: Pipeline,
    sub_request: Any,
    layout: LlmPlan,
    plan: StageRef,
    states: list[StageRef],
    structures: list[StageRef],
    graphs_of: dict[int, list[StageRef]],
    held: dict[int, int],
    part_done: Callable[[int, list[StageRef]], None],
) -> tuple[list[StageRef], list[str], list[str]]:
    """Each part's prompt and token graphs, with the integer KV cache their calibration
    ranges give (``llm_generation``, ``p<i>.kv``); fills ``graphs_of`` (part -> graphs).
    Returns the graph stages, their coverage stages' names and the graphs' names."""
    from graphbuild.targets.qnn.pipeline.build import build_qnn_pipeline

    generation = p.register_stage(
        stages.llm_generation,
        "llm_generation",
        reads=(
            "input.state",
            UNKEYED_INPUT,  # the parts' modules: keyed by their digests, upstream
            "ctx.calibration",
            "ctx.calibration_steps",
            "samples.values",
        ),
        rematerialize=True,
    ).depends_on(plan, *structures)
    p.declare_cost(generation, memory=sum(held.values()))
    # every part's view of the recording first: the recording itself is then let go, and
    # each part's share once that part's graphs are built (rematerialized outputs are
    # dropped when nothing left in the run reads them), not at the end of the export
    kvs, recorded = {}, {}
    for index in range(1, len(states) + 1):
        kvs[index] = p.register_stage(
            functools.partial(stages.part_kv, index), f"p{index}.kv", reads=("ctx.kv_bits",)
        ).depends_on(generation, plan)
        for kind in KINDS:
            recorded[index, kind] = p.register_stage(
                functools.partial(stages.part_batches, index, kind),
                f"p{index}.{kind}.batches",
                reads=(),
                rematerialize=True,
            ).depends_on(generation)
    graphs, coverages, names_out = [], [], []
    for index, (state, structure) in enumerate(zip(states, structures, strict=True), start=1):
        kv = kvs[index]
        for kind in KINDS:
            batches = recorded[index, kind]
            view = p.register_stage(
                functools.partial(stages.graph_plan, index, kind), f"p{index}.{kind}.plan", reads=()
            ).depends_on(plan)
            sub = build_qnn_pipeline(sub_request, "onnx_qdq")
            names = include_part(p, sub, index, kind, view, state, structure, batches)
            declare_part_costs(p, names, held[index])
            graph = p.register_stage(
                functools.partial(stages.kv_graph, index, kind),
                f"p{index}.{kind}.graph",
                reads=("ctx.kv_bits",),
                rematerialize=True,  # its weights are bind's: the model holds them
            ).depends_on(names["bind"], kv, view)
            graphs.append(graph)
            graphs_of.setdefault(index, []).append(graph)
            coverages.append(names["coverage"])
            names_out.append(layout.graph_name(index, kind))
        part_done(index, graphs_of[index])
    return graphs, coverages, names_out


def _add_float_graphs(
    p: Pipeline,
    sub_request: Any,
    layout: LlmPlan,
    plan: StageRef,
    states: list[StageRef],
    structures: list[StageRef],
    held: dict[int, int],
) -> tuple[list[StageRef], list[str]]:
    """Each part's float graph (``p<i>.float.*``): the part traced with dynamic lengths and
    genai's default cache layout, bound to its weights; nothing calibrates. Returns the graph
    stages and their coverage stages' names."""
    from graphbuild.targets.qnn.pipeline.build import build_qnn_pipeline

    graphs, coverages = [], []
    for index, (state, structure) in enumerate(zip(states, structures, strict=True), start=1):
        view = p.register_stage(
            functools.partial(stages.graph_plan, index, FLOAT), f"p{index}.{FLOAT}.plan", reads=()
        ).depends_on(plan)
        sub = build_qnn_pipeline(sub_request, "onnx_qdq")
        replaced = {"capture": stages.capture_float}
        names = include_part(p, sub, index, FLOAT, view, state, structure, None, replaced)
        declare_part_costs(p, names, held[index])
        graph = p.register_stage(
            functools.partial(stages.float_graph, index),
            f"p{index}.{FLOAT}.graph",
            reads=(),
            rematerialize=True,  # its weights are bind's: the model holds them
        ).depends_on(names["bind"], view)
        graphs.append(graph)
        coverages.append(names["coverage"])
    return graphs, coverages


def _add_part_contexts(
    p: Pipeline,
    targets: Sequence[HtpTarget],
    index: int,
    count: int,
    graphs: list[StageRef],
    weight_bytes: int,
) -> list[str]:
    """``p<index>.context.<label>`` per HTP target (:func:`.htp_bundle.part_context`), each
    declaring what its child process holds; their names. Registered right after the part's
    graphs, so a sequential build prepares a part's contexts before it builds the next part
    and lets the part's graphs go."""
    from graphbuild.targets.qnn.pipeline.htp import HTP_BACKEND, QNN_HTP

    names = []
    for t in targets:
        htp, genie = htp_bundle.folders(t, targets)
        stage = functools.partial(
            htp_bundle.part_context,
            index,
            count,
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
        declare_context_cost(p, ref, weight_bytes)
        names.append(ref.name)
    return names


def _add_bundle_stages(
    p: Pipeline,
    targets: Sequence[HtpTarget],
    plan: StageRef,
    rope: StageRef | None,
) -> list[str]:
    """``htp_bundle`` (with an 8-bit KV cache: genai's) and ``genie_bundle``
    (:mod:`.htp_bundle`); their names, as products."""
    from graphbuild.targets.qnn.pipeline.htp import HTP_BACKEND

    names = []
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
    p: Pipeline,
    targets: Sequence[HtpTarget],
    plan: StageRef,
    graphs_of: dict[int, list[StageRef]],
    weight_bytes: int,
) -> None:
    """``check_htp_<label>`` per HTP target (:func:`.check.check_generation_htp`), each
    declaring what it holds for the parts' ``weight_bytes`` in all; the first target's report
    is the export's ``htp`` report."""
    from graphbuild.targets.qnn.pipeline.htp import HTP_BACKEND, QNN_HTP

    graphs = [g for index in sorted(graphs_of) for g in graphs_of[index]]
    for i, t in enumerate(targets):
        check = p.register_stage(
            functools.partial(check_generation_htp, t.htp_arch, t.soc_model),
            f"check_htp_{t.label}",
            reads=("input", "samples", HTP_BACKEND, QNN_HTP),
        ).depends_on(plan, *graphs)
        declare_htp_check_cost(p, check.name, weight_bytes)
        if i == 0:
            p.reports["htp"] = check.name


class _SubRequest:
    """The request a part graph's ``onnx_qdq`` pipeline is built from."""

    def __init__(self, target: str, fmt: str, model_name: str, options: Any) -> None:
        self.target = target
        self.format = fmt
        self.model_name = model_name
        self.options = options
