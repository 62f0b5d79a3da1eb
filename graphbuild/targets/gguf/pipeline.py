"""The GGUF pipeline: ``gguf/llama_cpp``, a ``.gguf`` file that llama.cpp loads and runs.

::

    plan -> tensor_plan -> weight_digests -> weight_digests_<k> -> pack_<k> -+-> pack -> report
      |                                                               ^      |      |
      |    capture -> normalize -> qparams -> qparams_<k> ------------+      |      v
      |    (the model's own quantizers only)                                 |  gguf_file
      +-> arch_metadata -> vocab ---------------------------------------------+------^
                                                            [check_numerics: the file in llama.cpp]

``plan`` reads the model's structure: its transformers config picks the architecture
adapter, which names each parameter for llama.cpp and gives the hyperparameters;
``tensor_plan`` and ``arch_metadata`` pass on one part each, so a hyperparameter change
stops before the weights. ``weight_digests`` hashes exactly the tensors the file takes, and
the tensors are packed into blocks in ``SHARDS`` stages (``pack_<k>``), each keyed by its own
tensors' digests (``weight_digests_<k>``) and quantizer values (``qparams_<k>``; the model's
own quantizers are read by the front end the QNN target uses: capture, normalize, qparams; a
preset needs no trace at all). ``pack`` gathers the shards; ``vocab`` reads the tokenizer;
``gguf_file`` lays out header and tensors. A weights-only change reruns the shards holding a
changed tensor (and within a process only that tensor: :mod:`.tensors`), and the placement
copies every unchanged tensor from the file it replaces; a tokenizer or metadata change
reruns ``vocab`` or ``gguf_file`` only, and every tensor is copied.
"""

from __future__ import annotations

import warnings
from collections import Counter
from functools import partial
from typing import Any

from graphbuild.engine.pipeline import UNKEYED_INPUT, Pipeline
from graphbuild.engine.toolchain import Tool, register_tool
from graphbuild.errors import ConfigError
from graphbuild.frontend.capture import capture
from graphbuild.frontend.devices import host_state, model_tensors
from graphbuild.quant.quantmap import QuantMap, QuantValues
from graphbuild.targets.base import Request, coerce_options
from graphbuild.targets.gguf import blocks, container
from graphbuild.targets.gguf.adapters import find_adapter, find_config
from graphbuild.targets.gguf.artifacts import GgufFile, PackedTensors
from graphbuild.targets.gguf.options import FORMATS, GgufOptions
from graphbuild.targets.gguf.tensors import SHARDS

#: ``general.quantization_version``: ggml's block layouts as of GGML_QNT_VERSION 2.
QUANTIZATION_VERSION = 2

# --------------------------------------------------------------------------- stages


def plan(model: Any, samples: Any, context: Any) -> dict[str, Any]:
    """What the file holds, from the model's structure: the architecture, its
    hyperparameters, and each tensor's GGUF name, source parameter, shape and RoPE rows."""
    from graphbuild.targets.gguf.tensors import plan_tensors

    config, _ = find_config(model)
    adapter = find_adapter(config, context["architecture"])
    tensors, left_out = plan_tensors(model, adapter, config)
    return {
        "architecture": adapter.name,
        "hparams": [[k, t, v] for k, t, v in adapter.hparams(config)],
        "tensors": tensors,
        "left_out": left_out,
        "vocab_size": int(config.vocab_size),
        "bos_token_id": _token_id(getattr(config, "bos_token_id", None)),
        "eos_token_id": _token_id(getattr(config, "eos_token_id", None)),
        "tokenizer_pre": adapter.tokenizer_pre,
        "output_fallback": list(adapter.output_fallback) if adapter.output_fallback else None,
    }


def tensor_plan(inputs: tuple, samples: Any, context: Any) -> dict[str, Any]:
    """The tensors alone: a hyperparameter change stops here, before any weight is read."""
    ((planned),) = inputs
    return {k: planned[k] for k in ("tensors", "output_fallback")}


def arch_metadata(inputs: tuple, samples: Any, context: Any) -> dict[str, Any]:
    """The architecture's metadata alone: what the header and the vocabulary need."""
    ((planned),) = inputs
    return {k: v for k, v in planned.items() if k not in ("tensors", "output_fallback")}


def _token_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def weight_digests(inputs: tuple, samples: Any, context: Any) -> dict:
    """Digests of exactly the tensors the file holds: ``pack`` keys on these, so a change to
    anything else of the model (a quantizer's buffer) does not repack weights."""
    from graphbuild.engine.fingerprint import tensor_digests

    (planned,) = inputs
    state = model_tensors(context.input)
    names = sorted({e["source"] for e in planned["tensors"]})
    digests = tensor_digests([state[n] for n in names], reuse=True)  # input.state's, this run
    return {
        n: f"{state[n].dtype}{list(state[n].shape)}:{d}"
        for n, d in zip(names, digests, strict=True)
    }


def normalize(inputs: tuple, samples: Any, context: Any) -> tuple:
    """The front end's normalize, keeping what the file needs of it: the quant map (with
    the ops that read each quantizer's output) and the values written into the graph."""
    from graphbuild.frontend.normalize import fixed_values, normalize_program

    (program,) = inputs
    marker, qmap = normalize_program(program.program)
    fixed = fixed_values(program.program, qmap)
    doc = qmap.to_json()
    doc["uses"] = _marker_uses(marker)
    return doc, fixed


def _marker_uses(program: Any) -> dict[str, list[str]]:
    """qid -> the ops that read each quantizer's output (through views), so that a tied
    parameter's quantizer is given to the use it quantizes."""
    from graphbuild.frontend.recognizers import op_name
    from graphbuild.quant.markers import is_marker

    passthrough = {"aten.t.default", "aten.permute.default", "aten.view.default"}
    uses: dict[str, list[str]] = {}
    for node in program.graph.nodes:
        if not is_marker(node):
            continue
        ops, todo = set(), list(node.users)
        while todo:
            user = todo.pop()
            name = op_name(user.target) if user.op == "call_function" else user.op
            if name in passthrough:
                todo.extend(user.users)
            else:
                ops.add(name)
        uses[str(node.args[1])] = sorted(ops)
    return uses


def qparams(inputs: tuple, samples: Any, context: Any) -> dict:
    """Scales and zero points of the model's quantizers, from its state."""
    from graphbuild.frontend.normalize import qvalues_from

    ((qmap, fixed),) = inputs
    values = qvalues_from(QuantMap.from_json(qmap), fixed, host_state(context.input))
    return values.to_tensors()


def shard_digests(shard: int, inputs: tuple, samples: Any, context: Any) -> dict:
    """The digests of one packing shard's tensors: it reruns only when one of them changed."""
    planned, digests = inputs
    return {e["source"]: digests[e["source"]] for e in planned["tensors"] if e["shard"] == shard}


def shard_qparams(shard: int, inputs: tuple, samples: Any, context: Any) -> dict:
    """The values of the quantizers acting on one packing shard's tensors."""
    from graphbuild.targets.gguf.tensors import assign_quantizers

    planned, (qmap_doc, _), values = inputs
    specs = assign_quantizers(planned["tensors"], QuantMap.from_json(qmap_doc), qmap_doc["uses"])
    mine = {e["source"] for e in planned["tensors"] if e["shard"] == shard}
    qids = {str(spec.qid) for source, spec in specs.items() if source in mine}
    return {k: v for k, v in values.items() if k.split(".")[0] in qids}


def pack_shard(shard: int, inputs: tuple, samples: Any, context: Any) -> tuple:
    """One shard's tensors as blocks (see :mod:`.tensors`), and what each became."""
    from graphbuild.targets.gguf.tensors import assign_quantizers, pack_tensors

    planned, digests, *quant = inputs
    mine = [e for e in planned["tensors"] if e["shard"] == shard]
    specs = qvalues = None
    if quant:
        (qmap_doc, _), values = quant
        qmap = QuantMap.from_json(qmap_doc)
        specs = assign_quantizers(planned["tensors"], qmap, qmap_doc["uses"])
        qvalues = QuantValues.from_tensors(values) if values else QuantValues()
    return pack_tensors(
        mine,
        host_state(context.input),
        context["quantizer"],
        context["float_type"],
        specs,
        qvalues,
        {name: d.rpartition(":")[2] for name, d in digests.items()},
        group=shard,
    )


def pack(inputs: tuple, samples: Any, context: Any) -> tuple:
    """Every tensor of the file, in the plan's order, and what each became. An output
    projection whose blocks equal the embedding's is left out: llama.cpp then reads the
    embedding in its place (a tied embedding is stored once)."""
    planned, *shards = inputs
    by_name, report = {}, {}
    for packed, shard_report in shards:
        by_name.update(packed.by_name())
        report.update(shard_report)
    tensors = [by_name[e["name"]] for e in planned["tensors"]]
    fallback = planned["output_fallback"]
    if fallback is not None:
        output, embedding = (by_name.get(n) for n in fallback)
        if output is not None and embedding is not None and _same(output, embedding):
            tensors.remove(output)
            report[output.name] = {**report[output.name], "stored_as": embedding.name}
    order = [e["name"] for e in planned["tensors"]]
    return PackedTensors(tuple(tensors)), {n: report[n] for n in order}


def report(inputs: tuple, samples: Any, context: Any) -> dict:
    """What the file holds, for people: tensors by type, and what was left out."""
    planned, (packed, per_tensor) = inputs
    types = Counter(t.ggml for t in packed.tensors)  # what the file holds
    matrices = [t for t in packed.tensors if len(t.shape) > 1]
    quantized = sum(1 for t in matrices if t.type.quantized)
    moved = [
        r["scale_float16_rel_change"]
        for r in per_tensor.values()
        if "scale_float16_rel_change" in r
    ]
    by_type = ", ".join(f"{name}: {n}" for name, n in sorted(types.items()))
    summary = f"{quantized}/{len(matrices)} weight matrices quantized ({by_type})"
    out: dict[str, Any] = {
        "summary": summary,
        "architecture": planned["architecture"],
        "types": dict(sorted(types.items())),
        "tensors": {n: r["type"] for n, r in per_tensor.items() if "stored_as" not in r},
        "left_out": planned["left_out"],
    }
    tied = {n: r["stored_as"] for n, r in per_tensor.items() if "stored_as" in r}
    if tied:
        out["stored_once"] = tied  # llama.cpp reads the embedding in their place
    if moved:
        out["scale_float16_max_rel_change"] = max(moved)
    finer = sorted(name for name, r in per_tensor.items() if "bits" in r)
    if finer:
        out["float_from_quantizers"] = finer  # grids finer than any block type
        shapes = {t.name: t.shape for t in packed.tensors}
        weights = [n for n in finer if len(shapes.get(n, ())) > 1]
        if weights:
            out["summary"] += f"; {len(weights)} with a grid finer than 8 bits stored as float"
    return out


def vocab(inputs: tuple, samples: Any, context: Any) -> list:
    """The ``tokenizer.ggml.*`` entries from the tokenizer the options name."""
    from graphbuild.targets.gguf.vocab import vocab_entries

    (planned,) = inputs
    if context["tokenizer"] is None:
        warnings.warn(
            "gguf: no tokenizer given: the file has no vocabulary (llama.cpp runs token ids, "
            "not text); set the tokenizer option to the model's tokenizer.json",
            stacklevel=2,
        )
    entries = vocab_entries(
        context["tokenizer"],
        planned["vocab_size"],
        context["tokenizer_pre"],
        planned["tokenizer_pre"],
        planned["bos_token_id"],
        planned["eos_token_id"],
    )
    return [[k, t, v] for k, t, v in entries]


def gguf_file(inputs: tuple, samples: Any, context: Any) -> GgufFile:
    """Header (metadata and tensor infos) and tensors, laid out as llama.cpp reads them."""
    planned, entries, (packed, _) = inputs
    tensors = list(packed.tensors)
    alignment = context["alignment"]
    head, _ = container.header(
        _metadata(planned, entries, tensors, context), _infos(tensors), alignment
    )
    name = f"{context['model_name']}.gguf"
    return GgufFile(name, head, tuple(tensors), alignment)


def _same(a: Any, b: Any) -> bool:
    return a.ggml == b.ggml and a.shape == b.shape and a.digest == b.digest


def _infos(tensors: list) -> list[container.TensorInfo]:
    return [container.TensorInfo(t.name, t.shape, t.type.id, t.data.nbytes) for t in tensors]


def _metadata(planned: dict, vocab_entries: list, tensors: list, context: Any) -> list:
    arch = planned["architecture"]
    types = {t.ggml for t in tensors if len(t.shape) > 1}
    main = next((n for n in ("Q4_0", "Q8_0", "F16") if n in types), "F32")
    entries: list[tuple[str, str, Any]] = [
        ("general.architecture", "string", arch),
        ("general.name", "string", context["model_name"]),
        ("general.file_type", "uint32", blocks.FILE_TYPES[main]),
    ]
    if any(blocks.GGML_TYPES[n].quantized for n in types):
        entries.append(("general.quantization_version", "uint32", QUANTIZATION_VERSION))
    if context["alignment"] != container.DEFAULT_ALIGNMENT:
        entries.append(("general.alignment", "uint32", context["alignment"]))
    for key, value in context["metadata"].items():
        entries.append((key, _value_type(value), value))
    entries += [tuple(e) for e in planned["hparams"]]
    entries += [tuple(e) for e in vocab_entries]
    return entries


def _value_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int64"
    if isinstance(value, float):
        return "float32"
    return "string"


#: llama.cpp's shared libraries (llama-cpp-python's), which the numerics check runs the file in
LLAMA_CPP = register_tool(
    Tool.package_files(
        "llama-cpp",
        "llama_cpp",
        "lib/*",
        "*.so",
        "*.dylib",
        "*.dll",
        distribution="llama-cpp-python",
    )
)


def check_numerics(inputs: tuple, samples: Any, context: Any) -> dict:
    """Run the file in llama.cpp on the sample token ids; compare its logits with the torch
    model run on the weights the file holds (dequantized)."""
    from graphbuild.targets.gguf.numerics import compare_with_llama_cpp

    planned, (packed, _), gguf = inputs
    return compare_with_llama_cpp(gguf, planned, packed, context.input, samples)


# --------------------------------------------------------------------------- wiring


def build_gguf_pipeline(request: Request, fmt: str | None = None) -> Pipeline:
    """``gguf/llama_cpp``: see the module's docstring."""
    fmt = fmt or request.format
    if fmt not in FORMATS:
        raise ConfigError(
            f"unknown format '{fmt}' for target gguf; known: {', '.join(FORMATS)} "
            "(a custom format passes fmt= to build_gguf_pipeline)"
        )
    opts = coerce_options(GgufOptions, request.options, request.target)
    p = Pipeline(name=f"{request.target}/{fmt}")
    whole = p.register_stage(
        plan,
        "plan",
        reads=("input.structure", "registry.gguf_adapters", "ctx.architecture"),
    )
    planned = p.register_stage(tensor_plan, "tensor_plan", reads=()).depends_on(whole)
    arch = p.register_stage(arch_metadata, "arch_metadata", reads=()).depends_on(whole)
    digests = p.register_stage(weight_digests, "weight_digests", reads=("input.state",))
    digests.depends_on(planned)
    qmap = values = None
    if opts.quantizer is None:  # the model's own quantizers, as the front end reads them
        cap = p.register_stage(capture, "capture", reads=("input.structure", "samples.spec"))
        qmap = p.register_stage(normalize, "normalize", reads=("registry.recognizers",))
        qmap.depends_on(cap)
        values = p.register_stage(qparams, "qparams", reads=("input.state",)).depends_on(qmap)
    shards = []
    for k in range(SHARDS):
        mine = p.register_stage(partial(shard_digests, k), f"weight_digests_{k}", reads=())
        mine.depends_on(planned, digests)
        shard = p.register_stage(
            partial(pack_shard, k),
            f"pack_{k}",
            reads=(UNKEYED_INPUT, "ctx.quantizer", "ctx.float_type"),
        ).depends_on(planned, mine)
        if qmap is not None and values is not None:
            own = p.register_stage(partial(shard_qparams, k), f"qparams_{k}", reads=())
            shard.depends_on(qmap, own.depends_on(planned, qmap, values))
        shards.append(shard)
    packed = p.register_stage(pack, "pack", reads=()).depends_on(planned, *shards)
    summary = p.register_stage(report, "report", reads=()).depends_on(arch, packed)
    words = p.register_stage(vocab, "vocab", reads=("ctx.tokenizer", "ctx.tokenizer_pre"))
    words.depends_on(arch)
    gguf = p.register_stage(
        gguf_file,
        "gguf_file",
        reads=("ctx.model_name", "ctx.metadata", "ctx.alignment"),
    ).depends_on(arch, words, packed)
    p.products = [gguf.name]
    p.output_files = frozenset({f"{request.model_name}.gguf"})
    p.reports["coverage"] = summary.name
    if opts.check_numerics:
        reads = ("input", "samples", LLAMA_CPP)
        check = p.register_stage(check_numerics, "check_numerics", reads=reads)
        check.depends_on(planned, packed, gguf)
        p.reports["numerics"] = check.name
    return p


__all__ = ["FORMATS", "GgufOptions", "PackedTensors", "build_gguf_pipeline"]
