"""``check_numerics`` for the llm format: generation, compared with the model's own.

The CPU bundle generates greedily from the sample prompt in onnxruntime-genai (graphbuild's own
onnxruntime runner of the same protocol where genai is not installed, and the report says
so), and transformers generates from the same prompt with its own KV cache. The report gives
both token lists, whether they agree, the step where they first differ with each side's lead
of its token over the runner-up (a near-tie flipped by rounding, or not), and the SQNR of the
bundle's logits against the model's at each step up to there.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphbuild.engine.codecs import FileArtifact
from graphbuild.frontend.reference import sqnr_db
from graphbuild.onnx.save import write_model
from graphbuild.targets.qnn.llm.adapters import find_causal_lm
from graphbuild.targets.qnn.llm.bundle import CPU
from graphbuild.targets.qnn.llm.genai_config import CONFIG_NAME
from graphbuild.targets.qnn.llm.plan import LlmPlan
from graphbuild.targets.qnn.llm.stages import token_ids

#: Tokens generated for the check (fewer when the context ends first).
CHECK_TOKENS = 32


def _steps(plan: LlmPlan, prompt: list[int], most: int) -> int:
    """Tokens to generate: ``most``, fewer where the context ends first (the prompt counted
    padded to whole windows, as genai pads it)."""
    padded = -(-len(prompt) // plan.prompt_len) * plan.prompt_len
    return max(1, min(most, plan.context_len - padded - 1))


def reference_generation(
    model: torch.nn.Module, prompt: list[int], steps: int
) -> tuple[list[int], list[np.ndarray]]:
    """transformers' greedy decoding with its own KV cache: the tokens and their logits."""
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            row = out.logits[0, -1].float()
            logits.append(row.numpy().copy())
            tokens.append(int(row.argmax()))
            out = model(
                input_ids=torch.tensor([[tokens[-1]]]),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return tokens, logits


def _lead(row: np.ndarray) -> float:
    top = np.sort(row)[-2:]
    return float(top[1] - top[0])


def compare(
    tokens: list[int], logits: list[np.ndarray], ref_tokens: list[int], ref_logits: list[np.ndarray]
) -> dict[str, Any]:
    """Agreement of a generation with the reference, token by token (see the module)."""
    n = min(len(tokens), len(ref_tokens))
    first = next((i for i in range(n) if tokens[i] != ref_tokens[i]), None)
    upto = n if first is None else first + 1
    out: dict[str, Any] = {
        "tokens": tokens,
        "reference_tokens": ref_tokens[: len(tokens)],
        "equal": first is None,
        "sqnr_db": [round(sqnr_db(ref_logits[i], logits[i]), 2) for i in range(upto)],
    }
    if first is not None:
        out["first_difference"] = {
            "step": first,
            "reference_lead": round(_lead(ref_logits[first]), 5),
            "bundle_lead": round(_lead(logits[first]), 5),
        }
    return out


def _write_bundle(directory: Path, graphs: list[dict], files: dict[str, FileArtifact]) -> Path:
    for product in graphs:
        for name, bound in product.items():
            write_model(bound, directory / name)
    for name, item in files.items():
        (directory / name).parent.mkdir(exist_ok=True)
        (directory / name).write_bytes(item.data)
    return directory / CPU


def check_generation(inputs: tuple, samples: Any, context: Any) -> dict[str, Any]:
    """Generate from the sample prompt with the CPU bundle and with transformers, and
    compare (see the module's docstring). Inputs: the plan, the bundle's files, the graphs."""
    plan_json, files, *graphs = inputs
    plan = LlmPlan.from_json(plan_json)
    model = context.input
    prompt = token_ids(samples, "the sample inputs")
    steps = _steps(plan, prompt, CHECK_TOKENS)
    ref_tokens, ref_logits = reference_generation(model, prompt, steps)
    with tempfile.TemporaryDirectory(prefix="graphbuild-llm-check-") as tmp:
        bundle = _write_bundle(Path(tmp), graphs, files)
        if importlib.util.find_spec("onnxruntime_genai") is not None:
            from graphbuild.targets.qnn.llm.generate import generate

            result = generate(bundle, prompt, steps)
            tokens, logits = result.tokens, list(result.logits)
            runtime = f"onnxruntime-genai {result.genai_version}"
        else:
            if _is_float(files):
                from graphbuild.targets.qnn.llm.float_runner import float_generation

                tokens, logits = float_generation(bundle, prompt, steps)
            else:
                tokens, logits = _onnxruntime_generation(
                    bundle, plan, find_causal_lm(model), prompt, steps
                )
            runtime = (
                "onnxruntime (graphbuild's runner; pip install onnxruntime-genai to run genai)"
            )
    report = {
        "runtime": runtime,
        "prompt": prompt,
        **compare(tokens, logits, ref_tokens, ref_logits),
    }
    report["summary"] = _summary(report)
    return report


def _is_float(files: dict[str, FileArtifact]) -> bool:
    """Whether the bundle is the float one: genai keeps its default cache (no window)."""
    config = json.loads(files[f"{CPU}/{CONFIG_NAME}"].data)
    return "sliding_window" not in config["model"]["decoder"]


def _onnxruntime_generation(
    bundle: Path,
    plan: LlmPlan,
    lm: Any,
    prompt: list[int],
    steps: int,
    session_factory: Any = None,
) -> tuple[list[int], list[np.ndarray]]:
    from graphbuild.targets.qnn.llm.ort_runner import onnx_caller
    from graphbuild.targets.qnn.llm.runner import PartRunner

    call, encodings = onnx_caller(bundle, plan, session_factory=session_factory)
    runner = PartRunner(
        lm, plan.specs, plan.prompt_len, plan.context_len, kv_encodings=encodings, caller=call
    )
    out = runner.generate(prompt, steps)
    return out.tokens, [row.numpy() for row in out.logits]


def _summary(report: dict[str, Any]) -> str:
    n = len(report["tokens"])
    if report["equal"]:
        sqnr = min(report["sqnr_db"]) if report["sqnr_db"] else float("nan")
        return (
            f"{n} tokens equal to transformers' ({report['runtime']}; logits SQNR >= {sqnr:.1f} dB)"
        )
    diff = report["first_difference"]
    return (
        f"tokens differ from transformers' at step {diff['step']} of {n} ({report['runtime']}; "
        f"leads there: transformers {diff['reference_lead']}, bundle {diff['bundle_lead']})"
    )


#: Tokens the HTP check generates (each a run of every part graph on the x86 simulator).
HTP_CHECK_TOKENS = 16
#: How the HTP check compiles the graphs, as its report says.
PER_GRAPH = (
    "a context per graph: onnxruntime-qnn's x86 simulator cannot load a weight-shared binary "
    "(it crashes in libQnnHtp), so each QDQ part graph is compiled on its own"
)


def check_generation_htp(
    htp_arch: str, soc_model: str, inputs: tuple, samples: Any, context: Any
) -> dict[str, Any]:
    """The part graphs on QNN's HTP (CPU fallback disabled) against the same graphs on the
    CPU: both generate greedily from the sample prompt through graphbuild's runner; the report
    gives both token lists, the first step they differ with each side's lead there (QNN's
    16-bit kernels flip near-ties), and the HTP logits' SQNR against the CPU's per step."""
    from graphbuild.targets.qnn.arch.targets import HtpTarget
    from graphbuild.targets.qnn.htp_runtime import open_session

    plan_json, *graphs = inputs
    plan = LlmPlan.from_json(plan_json)
    lm = find_causal_lm(context.input)
    prompt = token_ids(samples, "the sample inputs")
    steps = _steps(plan, prompt, HTP_CHECK_TOKENS)
    target = HtpTarget(htp_arch, soc_model)
    with tempfile.TemporaryDirectory(prefix="graphbuild-llm-htp-") as tmp:
        bundle = _write_bundle(Path(tmp), graphs, {})
        cpu = _onnxruntime_generation(bundle, plan, lm, prompt, steps)
        htp = _onnxruntime_generation(
            bundle, plan, lm, prompt, steps, lambda path: open_session(path, target).session
        )
    result = compare(*htp, *cpu)
    result["cpu_tokens"] = result.pop("reference_tokens")
    # against the float model too, while all three chose the same tokens: QNN's 16-bit kernels
    # round differently from onnxruntime's CPU, so what matters is how far each is from float
    ref_tokens, ref_logits = reference_generation(context.input, prompt, steps)
    agree = 0
    while (
        agree < min(len(htp[0]), len(cpu[0]), len(ref_tokens))
        and htp[0][agree] == cpu[0][agree] == ref_tokens[agree]
    ):
        agree += 1
    upto = min(agree + 1, len(htp[0]), len(cpu[0]), len(ref_tokens))
    result["sqnr_db_vs_float"] = {
        "cpu": [round(sqnr_db(ref_logits[i], cpu[1][i]), 2) for i in range(upto)],
        "htp": [round(sqnr_db(ref_logits[i], htp[1][i]), 2) for i in range(upto)],
    }
    if "first_difference" in result:
        diff = result["first_difference"]
        diff["cpu_lead"] = diff.pop("reference_lead")
        diff["htp_lead"] = diff.pop("bundle_lead")
    n = len(result["tokens"])
    if result["equal"]:
        floats = result["sqnr_db_vs_float"]
        cpu_low = min(floats["cpu"], default=float("nan"))
        htp_low = min(floats["htp"], default=float("nan"))
        summary = (
            f"{target}: {n} tokens equal to the CPU graphs' (logits SQNR against the float "
            f"model >= {htp_low:.1f} dB on the HTP, {cpu_low:.1f} dB on the CPU; a context "
            "per graph)"
        )
    else:
        diff = result["first_difference"]
        summary = (
            f"{target}: tokens differ from the CPU graphs' at step {diff['step']} of {n} "
            f"(leads there: CPU {diff['cpu_lead']}, HTP {diff['htp_lead']}; a context per graph)"
        )
    return {
        "target": str(target),
        "contexts": PER_GRAPH,
        "prompt": prompt,
        **result,
        "summary": summary,
    }
