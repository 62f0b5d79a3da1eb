"""The HTP bundles of an ``llm`` export (``contexts = true``): each part's two graphs prepared
into one weight-shared QNN context binary, and the configurations that run them.

::

    p<i>.prompt.graph ─┬─► p<i>.context.<label> ─► htp/<graph>.onnx (EPContext, both graphs)
    p<i>.token.graph  ─┘        (one per target)   htp/<name>.bin, genie/<name>.bin
    llm_plan, rotary ──► htp_bundle   ─► htp/genai_config.json, htp/position-processor.onnx
    llm_plan ──────────► genie_bundle ─► genie/genie_config.json, genie/htp_backend_ext_config.json

``<name>`` is ``<model name>_part_<i>_of_<n>``; with several HTP targets each has its own
folders, ``htp_<label>/`` and ``genie_<label>/`` (label ``v73``, or ``v73_soc<id>`` off the
arch's default SoC). Each context stage keys on its two graphs (by digest), its target (its
arguments) and the HTP backend's versions, so a weight change re-prepares the contexts of the
part that holds it alone. Every EPContext model names its binary by a plain file name in its
own folder. Genie resolves ``ctx-bins`` relative to the bundle it runs from, so ``genie/``
holds its own copy of each binary (the same bytes; the cache stores them once); the tokenizer,
``tokenizer.json``, is the user's to add.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from graphbuild.engine.codecs import FileArtifact
from graphbuild.errors import ConfigError, ExportError
from graphbuild.targets.qnn.arch.targets import HtpTarget
from graphbuild.targets.qnn.htp_runtime.backend import ep_options_for
from graphbuild.targets.qnn.llm.bundle import PROCESSOR, genai_bundle_files, genai_facts
from graphbuild.targets.qnn.llm.genai_config import CONFIG_NAME
from graphbuild.targets.qnn.llm.genai_pipeline import Session
from graphbuild.targets.qnn.llm.genie_config import (
    GENIE_CONFIG_NAME,
    HTP_EXT_CONFIG_NAME,
    genie_config,
    htp_backend_ext_config,
)
from graphbuild.targets.qnn.llm.plan import KINDS, LlmPlan

__all__ = [
    "bundle_files",
    "context_name",
    "folders",
    "genie_bundle",
    "htp_bundle",
    "part_context",
    "rope_facts",
]

HTP = "htp"
GENIE = "genie"


def folders(target: HtpTarget, targets: Sequence[HtpTarget]) -> tuple[str, str]:
    """(HTP bundle folder, Genie bundle folder) of ``target`` among ``targets``."""
    if len(targets) == 1:
        return HTP, GENIE
    return f"{HTP}_{target.label}", f"{GENIE}_{target.label}"


def context_name(model_name: str, index: int, count: int) -> str:
    """The file stem of part ``index``'s context binary."""
    return f"{model_name}_part_{index}_of_{count}"


def bundle_files(
    plan: LlmPlan, model_name: str, targets: Sequence[HtpTarget], *, genai: bool
) -> set[str]:
    """Every file the HTP stages place, for the pipeline's ``output_files`` (``genai``: with
    the onnxruntime-genai files, which need an 8-bit KV cache)."""
    files = set()
    for t in targets:
        htp, genie = folders(t, targets)
        for spec in plan.specs:
            files |= {f"{htp}/{plan.graph_name(spec.index, k)}.onnx" for k in KINDS}
            binary = f"{context_name(model_name, spec.index, len(plan.specs))}.bin"
            files |= {f"{htp}/{binary}", f"{genie}/{binary}"}
        if genai:
            files |= {f"{htp}/{CONFIG_NAME}", f"{htp}/{PROCESSOR}"}
        files |= {f"{genie}/{GENIE_CONFIG_NAME}", f"{genie}/{HTP_EXT_CONFIG_NAME}"}
    return files


def _graph(product: Mapping[str, Any]) -> tuple[str, Any]:
    """(graph name, BoundModel) of a ``p<i>.<kind>.graph`` product."""
    ((file, bound),) = product.items()
    return Path(file).stem, bound


def part_context(
    index: int,
    count: int,
    htp: str,
    genie: str,
    inputs: tuple,
    samples: Any,
    context: Any,
    *,
    htp_arch: str,
    soc_model: str,
) -> dict[str, FileArtifact]:
    """Part ``index``'s prompt and token graphs prepared for one HTP target into one
    weight-shared context (in a fresh process, so the same graphs give the same bytes): an
    EPContext model per graph and the binary, in ``htp``; the binary again in ``genie``."""
    from graphbuild.onnx.save import write_model
    from graphbuild.targets.qnn.htp_runtime.shared_context import prepare_shared_context

    target = HtpTarget(htp_arch, soc_model)
    name = context_name(context["model_name"], index, count)
    with tempfile.TemporaryDirectory(prefix="graphbuild-llm-context-") as tmp:
        work = Path(tmp)
        models = []
        for product in inputs:
            graph, bound = _graph(product)
            (work / graph).mkdir()
            path = work / graph / f"{graph}.onnx"
            write_model(bound, path)
            models.append((graph, path))
        out = work / "out"
        out.mkdir()
        shared = prepare_shared_context(models, target, out, name)
        files = {f"{htp}/{g}.onnx": FileArtifact.read(m) for g, m in shared.models.items()}
        data = shared.binary.read_bytes()
    if shared.binary.name != f"{name}.bin":
        raise ExportError(f"the shared context of part {index} is {shared.binary.name}")
    for folder in (htp, genie):
        files[f"{folder}/{name}.bin"] = FileArtifact(f"{folder}/{name}.bin", data)
    return {k: FileArtifact(k, v.data) for k, v in sorted(files.items())}


def htp_bundle(
    targets: Sequence[tuple[str, str]], inputs: tuple, samples: Any, context: Any
) -> dict[str, FileArtifact]:
    """Per target, ``genai_config.json`` running every part's EPContext model on QNN's HTP
    and ``position-processor.onnx``. The backend is named by its file name (``libQnnHtp.so``),
    found on the runtime's library path: a bundle holds no path of the machine that built it."""
    plan_json, rotary_json = inputs
    plan = LlmPlan.from_json(plan_json)
    all_targets = [HtpTarget(a, s) for a, s in targets]
    files: dict[str, FileArtifact] = {}
    for t in all_targets:
        folder = folders(t, all_targets)[0]
        backend = Path(ep_options_for(t)["backend_path"]).name
        session = Session.qnn_htp(t, backend_path=backend)
        files |= genai_bundle_files(folder, plan, rotary_json, session, context["kv_bits"] or 8)
    return files


def rope_facts(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, RoPE scaling or None) of a transformers config: Genie computes the
    rotary tables from them."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ConfigError(
            f"{type(config).__name__} names no rope_theta: Genie needs the rotary base to "
            "compute the position tables; set config.rope_theta"
        )
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), None if kind in (None, "default") else params


def genie_bundle(
    targets: Sequence[tuple[str, str]], inputs: tuple, samples: Any, context: Any
) -> dict[str, FileArtifact]:
    """Per target, Genie's ``genie_config.json`` (the parts' binaries as ``ctx-bins``, in
    part order) and ``htp_backend_ext_config.json`` (the device)."""
    from graphbuild.targets.qnn.llm.adapters import find_causal_lm

    (plan_json,) = inputs
    plan = LlmPlan.from_json(plan_json)
    theta, scaling = rope_facts(find_causal_lm(context.input).config)
    count = len(plan.specs)
    bins = [f"{context_name(context['model_name'], s.index, count)}.bin" for s in plan.specs]
    config = genie_config(genai_facts(plan), bins, rope_theta=theta, rope_scaling=scaling)
    all_targets = [HtpTarget(a, s) for a, s in targets]
    files = {}
    for t in all_targets:
        folder = folders(t, all_targets)[1]
        for name, content in (
            (GENIE_CONFIG_NAME, config),
            (HTP_EXT_CONFIG_NAME, htp_backend_ext_config(t)),
        ):
            text = (json.dumps(content, indent=2) + "\n").encode()
            files[f"{folder}/{name}"] = FileArtifact(f"{folder}/{name}", text)
    return files
