"""Benchmark: the qnn target's llm format on a decoder of Qwen2.5-0.5B's shapes (494M parameters,
built from a config with seeded weights: nothing downloaded), context 1024, prompt 128.

One process, one fresh cache: the float export cold, warm, after a weight change in one decoder
layer (the last part's), then the ``w8a16`` preset cold, a scales-only retune (``range_method``
minmax -> moving_average: the calibration's statistics are kept, only the scales change) and a
preset change (``w8a8``, values only). With ``--contexts`` the preset path also prepares
each part's weight-shared v73 context binary, and each part's preparation time is reported.
Each case's fraction is of its path's cold export; peak RSS (the process's high-water mark
after the cold float export, which holds the model) is a multiple of the fp32 weights.

    python bench/bench_llm.py [--parts 4] [--layers 24] [--contexts] [--preset-only] [--cold-only]
        [--stage-rss] [--jobs 1] [--save FILE]

``--preset-only --cold-only`` is the preset path's cold export alone, in a process of its own
(its ``peak_rss_x_weights`` is that path's); ``--stage-rss`` samples the resident memory as each
stage settles and reports the stages it grew most at.

Targets (the issue's): warm <= 0.01 of cold; one-layer weight change <= 1/parts of cold + 0.05;
peak RSS <= 2.5 x the fp32 weights.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def qwen2_0_5b(layers: int) -> Any:
    """Qwen2.5-0.5B's shapes (tied embeddings, q/k/v biases, 14 heads over 2 KV heads)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
    )
    return Qwen2ForCausalLM(config).eval()


class _Done(Exception):
    """The cases asked for ran (``--cold-only``)."""


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class StageRss:
    """A run listener: (stage, resident bytes) as each stage ran or was loaded."""

    def __init__(self, samples: list[tuple[str, int]]) -> None:
        self.samples = samples

    def __call__(self, event: Any) -> None:
        if event.kind.value in ("ran", "loaded"):
            self.samples.append((f"{event.kind.value} {event.stage}", resident_bytes()))


def stage_rss(samples: list[tuple[str, int]], weights: int) -> dict[str, Any]:
    """Where the resident memory peaked, and the stages it grew most at (x the weights)."""
    steps = [
        (name, rss - prev) for (name, rss), (_, prev) in zip(samples[1:], samples[:-1], strict=True)
    ]
    top = sorted(steps, key=lambda s: -s[1])[:8]
    at, high = max(samples, key=lambda s: s[1])
    return {
        "high_at": at,
        "high_x_weights": high / weights,
        "grew_most": {name: round(d / weights, 3) for name, d in top},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument(
        "--contexts", action="store_true", help="prepare the preset path's HTP context binaries"
    )
    parser.add_argument(
        "--preset-only", action="store_true", help="skip the float cases (cold, warm, one layer)"
    )
    parser.add_argument(
        "--cold-only", action="store_true", help="each path's cold export alone (no retunes)"
    )
    parser.add_argument(
        "--stage-rss", action="store_true", help="the resident memory as each stage settles"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="stages at once (0: the export's default, one per core); the recorded results "
        "are one at a time",
    )
    parser.add_argument("--save", default=None, help="write the JSON document here too")
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    import torch

    import graphbuild as gb

    model = qwen2_0_5b(args.layers)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    prompt = (torch.randint(0, 151000, (1, 24), generator=g),)
    calibration = [torch.randint(0, 151000, (1, 40), generator=g) for _ in range(2)]
    tmp = Path(tempfile.mkdtemp(prefix="graphbuild-bench-llm-"))
    cases: dict[str, Any] = {}
    geometry = dict(prompt_len=args.prompt, context_len=args.context, parts=args.parts)

    def run(case: str, path: str, **options: Any) -> None:
        gc.collect()
        samples: list[tuple[str, int]] = []
        listeners = [StageRss(samples)] if args.stage_rss else []
        t0 = time.perf_counter()
        art = gb.export(
            model,
            prompt,
            tmp / f"out-{path}",
            "qwen",
            target="qnn",
            format="llm",
            options={**geometry, **options},
            cache=str(tmp / f"cache-{path}"),
            listeners=listeners,
            jobs=args.jobs,
        )
        seconds = time.perf_counter() - t0
        load = os.getloadavg()[0]
        ran = art.report.ran
        parts = sorted({s.split(".")[0] for s in ran if s.endswith((".bind", ".graph"))})
        cases[case] = {"seconds": seconds, "ran": len(ran), "parts_rebuilt": parts, "load": load}
        traced = sorted(s for s in ran if s.endswith(".capture"))
        cases[case]["traced"] = traced
        contexts = {
            r.name: r.seconds for r in art.report.stages if ".context." in r.name and r.name in ran
        }
        if contexts:
            cases[case]["context_seconds"] = contexts
            print("  contexts: " + ", ".join(f"{k} {v:.1f} s" for k, v in contexts.items()))
        cases[case]["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if samples:
            cases[case]["stage_rss"] = stage_rss(samples, weights)
        print(f"{case:14s} {seconds:8.2f} s  load {load:.2f}  {len(ran)} ran, parts {parts}")

    htp = {"contexts": True, "htp_arch": "v73"} if args.contexts else {}
    preset = {"quantizer": "w8a16", "calibration": calibration, **htp}
    failed = None
    try:
        if not args.preset_only:
            run("cold", "float")
            cases["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            if args.cold_only:
                raise _Done
            run("warm", "float")
            with torch.no_grad():
                model.model.layers[args.layers - 1].mlp.down_proj.weight.mul_(1.01)
            run("one_layer", "float")
        run("preset_cold", "preset", **preset)
        if args.cold_only:
            raise _Done
        run("scales_only", "preset", **preset, range_method="moving_average")
        run(
            "preset_change",
            "preset",
            **preset | {"quantizer": "w8a8"},
            range_method="moving_average",
        )
    except _Done:
        pass
    except Exception as exc:  # keep what was measured, and say which case failed
        failed = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"failed: {failed}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fractions: dict[str, float] = {}
    if "cold" in cases and "warm" in cases and "one_layer" in cases:
        cold = cases["cold"]["seconds"]
        fractions |= {
            "warm": cases["warm"]["seconds"] / cold,
            "one_layer": cases["one_layer"]["seconds"] / cold,
            "one_layer_target": 1 / args.parts + 0.05,
        }
    for case in ("scales_only", "preset_change"):
        if case in cases:
            fractions[case] = cases[case]["seconds"] / cases["preset_cold"]["seconds"]
    doc = {
        "model": f"Qwen2.5-0.5B shapes, {args.layers} layers",
        "weights_fp32_bytes": weights,
        **geometry,
        "contexts": args.contexts,
        "cases": cases,
        "fractions": fractions,
        "failed": failed,
    }
    if "peak_rss_bytes" in cases:
        doc["peak_rss_x_weights"] = cases["peak_rss_bytes"] / weights
    elif args.preset_only and args.cold_only and "preset_cold" in cases:
        doc["peak_rss_x_weights"] = cases["preset_cold"]["peak_rss_bytes"] / weights
    end_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the whole run's
    doc["peak_rss_end_x_weights"] = end_rss / weights
    text = json.dumps(doc, indent=2)
    print(text)
    if args.save:
        Path(args.save).write_text(text + "\n")


if __name__ == "__main__":
    main()
