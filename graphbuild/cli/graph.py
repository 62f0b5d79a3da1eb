"""``graphbuild graph`` and ``graphbuild targets``: the pipeline DAG and the known targets."""

from __future__ import annotations

import enum
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any

import typer

from graphbuild.cli.errors import handles_errors
from graphbuild.cli.options import (
    ConfigOpt,
    JsonOpt,
    SetOpt,
    TargetOpt,
    build_request,
    load_cli_config,
)
from graphbuild.cli.output import emit_json

if TYPE_CHECKING:
    from graphbuild.engine.pipeline import Pipeline

__all__ = ["GraphStyle", "graph", "targets"]


class GraphStyle(str, enum.Enum):
    text = "text"
    dot = "dot"
    mermaid = "mermaid"


def _graph_doc(pipeline: Pipeline) -> dict[str, Any]:
    products = set(pipeline.products)
    return {
        "pipeline": pipeline.name,
        "stages": [
            {
                "name": s.name,
                "depends_on": pipeline.dependencies(s.name),
                "reads": list(s.reads) if s.reads is not None else None,
                "product": s.name in products,
            }
            for s in pipeline.stages
        ],
    }


def _reads_label(reads: list[str] | None) -> str:
    if reads is None:
        return "everything (undeclared)"
    return ", ".join(reads) or "upstream outputs only"


def _render_graph(doc: dict[str, Any], style: str) -> str:
    stages = doc["stages"]
    if style == "dot":
        lines = [f'digraph "{doc["pipeline"]}" {{', "  rankdir=LR;", "  node [shape=box];"]
        for s in stages:
            label = f"{s['name']}\\n{_reads_label(s['reads'])}"
            shape = ", peripheries=2" if s["product"] else ""
            lines.append(f'  "{s["name"]}" [label="{label}"{shape}];')
        for s in stages:
            lines += [f'  "{d}" -> "{s["name"]}";' for d in s["depends_on"]]
        return "\n".join([*lines, "}"])
    if style == "mermaid":
        lines = ["flowchart LR"]
        for s in stages:
            label = f"{s['name']}<br/><small>{_reads_label(s['reads'])}</small>"
            lines.append(f'  {s["name"]}["{label}"]')
        for s in stages:
            lines += [f"  {d} --> {s['name']}" for d in s["depends_on"]]
        return "\n".join(lines)
    width = max(len(s["name"]) for s in stages) + 2
    lines = [f"{doc['pipeline']}: {len(stages)} stages"]
    for s in stages:
        after = ", ".join(s["depends_on"]) or "(model input)"
        mark = " *" if s["product"] else ""
        lines.append(f"  {s['name'] + mark:<{width}} after {after}")
        lines.append(f"  {'':<{width}} reads {_reads_label(s['reads'])}")
    lines.append("  (* placed in the output directory)")
    return "\n".join(lines)


@handles_errors
def graph(
    style: Annotated[
        GraphStyle, typer.Option("--format", "-f", help="Output: text, dot or mermaid.")
    ] = GraphStyle.text,
    target: TargetOpt = None,
    export_format: Annotated[
        str | None, typer.Option("--export-format", help="Export format: onnx or onnx_qdq.")
    ] = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    sets: SetOpt = None,
) -> None:
    """The pipeline DAG with each stage's declared reads."""
    cfg = load_cli_config(config, target=target, format=export_format, sets=sets, required=False)
    if not cfg.model_name:
        cfg = replace(cfg, model_name="model")  # the graph does not depend on the model
    _, pipeline = build_request(cfg, None, load_model=False)
    doc = {"target": cfg.target, "format": cfg.format, **_graph_doc(pipeline)}
    if as_json:
        emit_json(doc)
    else:
        typer.echo(_render_graph(doc, style.value))


@handles_errors
def targets(as_json: JsonOpt = False) -> None:
    """The export targets, their formats (the first is the default) and options."""
    from graphbuild.targets.registry import all_targets

    found = all_targets()
    if as_json:
        emit_json(
            {
                "targets": [
                    {
                        "target": t.name,
                        "formats": list(t.formats),
                        "default_format": t.default_format,
                        "description": t.description,
                        "options": list(t.config_schema),
                        "top_level": list(t.top_level_options),
                        "presets": list(t.presets),
                    }
                    for t in found
                ]
            }
        )
        return
    for t in found:
        typer.echo(f"{t.name}: {t.description}")
        typer.echo(f"  formats: {', '.join(t.formats)} (default {t.default_format})")
        typer.echo(f"  [options]: {', '.join(t.config_schema) or 'none'}")
        if t.top_level_options:
            typer.echo(f"  also at the top level: {', '.join(t.top_level_options)}")
        if t.presets:
            typer.echo(f"  presets: {', '.join(t.presets)}")
