"""Keys depend on content only (docs/design.md, invariant 10): the same model, samples and options
give the same keys in any process, whatever its hash seed and whatever it imported first.

The zoo: the examples, a pre-quantized ConvNet, transformers GPT-2, Llama and BERT from tiny
configs, and a model with an LSTM. One script computes, for every stage of every pipeline,
what its key covers besides its upstream outputs (code, every declared read); two processes
run it with different ``PYTHONHASHSEED`` and opposite orders of models and imports, and must
agree. Then real keys end to end, from the command line: a second process on GPT-2 and on a
Llama-style decoder is all hits, and a w8a16 -> w8a8 preset change in a new process cuts
``to_onnx`` off (the README's rerun table). The ExecuTorch export joins the zoo where the
``executorch`` extra is installed; without it, the QNN exports are checked alone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the zoo builds transformers models (the dev extra)")

ROOT = Path(__file__).resolve().parent.parent

ZOO_SCRIPT = textwrap.dedent(
    """
    import json, sys

    import torch
    from torch import nn

    order, with_executorch = sys.argv[1], sys.argv[2] == "executorch"
    if order == "reverse":  # what another process may have imported first
        import graphbuild.onnx.codecs  # noqa: F401
        import graphbuild.targets.executorch.pipeline  # noqa: F401
        import graphbuild.targets.qnn.presets.quantizer  # noqa: F401

    import transformers as T

    import graphbuild as gb
    from examples import convnet, tiny_decoder, tiny_llama
    from graphbuild.api import build_pipeline
    from graphbuild.engine.plan import stage_inputs
    from tests.models import FakeQuantConvNet


    class Logits(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids).logits


    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(8, 16, batch_first=True)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.lstm(x)[0])


    def ids():
        return (torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(2)),)


    def seeded(make):
        torch.manual_seed(0)
        return make().eval()


    tiny = dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, vocab_size=64)
    ZOO = {
        "convnet": lambda: (*convnet.build(), convnet.calibration(2)),
        "tiny_decoder": lambda: (*tiny_decoder.build(), tiny_decoder.calibration(2)),
        "tiny_llama": lambda: (*tiny_llama.build(), tiny_llama.calibration(2)),
        "fake_quant_convnet": lambda: (
            seeded(FakeQuantConvNet), (torch.ones(1, 3, 16, 16),), None
        ),
        "gpt2": lambda: (
            seeded(lambda: Logits(T.GPT2LMHeadModel(T.GPT2Config(
                n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16
            )))),
            ids(),
            [ids()],
        ),
        "bert": lambda: (
            seeded(lambda: Logits(T.BertForMaskedLM(T.BertConfig(
                num_attention_heads=2, attn_implementation="eager", **tiny
            )))),
            ids(),
            [ids()],
        ),
        "lstm": lambda: (seeded(Recurrent), (torch.ones(1, 5, 8),), None),
    }
    EXPORTS = [("qnn", "onnx"), ("qnn", "onnx_qdq")]

    names = sorted(ZOO) if order == "forward" else sorted(ZOO, reverse=True)
    out = {}
    for name in names:
        model, samples, calibration = ZOO[name]()
        executorch = with_executorch and name == "convnet"
        exports = EXPORTS + ([("executorch", "xnnpack")] if executorch else [])
        for target, fmt in exports:
            if target == "qnn":
                options = gb.QnnOnnxOptions(
                    quantizer="w8a16" if calibration else None, calibration=calibration
                )
            else:
                options = {"recipe": "xnnpack_int8_static", "calibration": calibration}
            request = gb.ExportRequest(model, samples, "unused", name, target, fmt, options)
            inputs = stage_inputs(
                build_pipeline(request), model, samples, context=request.context()
            )
            out[f"{name} {target}/{fmt}"] = inputs
    print("ZOO", json.dumps(out, sort_keys=True))
    """
)


#: The ExecuTorch export joins the zoo only where its extra is installed.
WITH_EXECUTORCH = importlib.util.find_spec("executorch") is not None


def run_zoo(script: Path, order: str, seed: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(script), order, "executorch" if WITH_EXECUTORCH else "-"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def zoo_result(proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    line = next(x for x in stdout.splitlines() if x.startswith("ZOO "))
    return json.loads(line[4:])


def differences(a: dict, b: dict) -> list[str]:
    out = []
    for export in sorted(set(a) | set(b)):
        for stage in sorted(set(a.get(export, {})) | set(b.get(export, {}))):
            sa, sb = a.get(export, {}).get(stage, {}), b.get(export, {}).get(stage, {})
            if sa.get("code") != sb.get("code"):
                out.append(f"{export} {stage}: code")
            for read in sorted(set(sa.get("reads", {})) | set(sb.get("reads", {}))):
                if sa["reads"].get(read) != sb["reads"].get(read):
                    out.append(f"{export} {stage}: {read}")
    return out


def test_every_stage_key_of_the_zoo_is_the_same_in_every_process(tmp_path):
    script = tmp_path / "zoo.py"  # a file: classes defined in it have source to fingerprint
    script.write_text(ZOO_SCRIPT)
    first, second = run_zoo(script, "forward", "1"), run_zoo(script, "reverse", "2")
    a, b = zoo_result(first), zoo_result(second)

    assert len(a) == 14 + WITH_EXECUTORCH and set(a) == set(b)  # 7 models x 2 formats (+ ET)
    assert differences(a, b) == []
    uncacheable = [
        f"{export} {stage}: {value}"
        for export, stages in a.items()
        for stage, inputs in stages.items()
        for value in [inputs["code"], *inputs["reads"].values()]
        if str(value).startswith("uncacheable")
    ]
    assert uncacheable == []


# --------------------------------------------------------------------------- the CLI

GPT2_MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Logits(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits


    def build():
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
        return Logits(GPT2LMHeadModel(config)).eval(), (torch.randint(0, 64, (1, 8)),)


    def calibration():
        g = torch.Generator().manual_seed(1)
        return [(torch.randint(0, 64, (1, 8), generator=g),) for _ in range(2)]
    """
)


def cli_export(model: str, name: str, preset: str, seed: str, cwd: Path, cache: Path) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
    env["GRAPHBUILD_CACHE_DIR"] = str(cache)
    calibration = model.replace(":build", ":calibration")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphbuild",
            "export",
            "--target",
            "qnn",
            "--model",
            model,
            "--name",
            name,
            "--output-dir",
            str(cwd / f"out-{name}-{preset}-{seed}"),
            "--set",
            f'calibration="{calibration}"',
            "--set",
            f"quantization.preset={preset}",
            "--json",
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {s["name"]: s for s in json.loads(done.stdout)["stages"]}


def cli_sequence(model: str, name: str, cwd: Path) -> tuple[dict, dict, dict]:
    """Cold w8a16 export, the same in a new process, then w8a8 in a third; each process
    with its own hash seed."""
    cache = cwd / f"cache-{name}"
    cold = cli_export(model, name, "w8a16", "1", cwd, cache)
    warm = cli_export(model, name, "w8a16", "2", cwd, cache)
    retuned = cli_export(model, name, "w8a8", "3", cwd, cache)
    return cold, warm, retuned


def test_decoders_from_the_command_line_hit_in_a_new_process_and_a_retune_keeps_their_onnx(
    tmp_path,
):
    (tmp_path / "gpt2_model.py").write_text(GPT2_MODEL)
    models = {
        "gpt2": "gpt2_model.py:build",
        "tiny_llama": f"{ROOT / 'examples' / 'tiny_llama.py'}:build",  # grouped-query
    }
    with ThreadPoolExecutor(len(models)) as pool:  # one chain of processes per decoder
        futures = {n: pool.submit(cli_sequence, m, n, tmp_path) for n, m in models.items()}
        results = {n: f.result() for n, f in futures.items()}

    for name, (cold, warm, retuned) in results.items():
        assert {s["status"] for s in cold.values()} == {"ran"}, name
        assert {n: s["status"] for n, s in warm.items() if s["status"] != "hit"} == {}, name
        assert retuned["capture"]["status"] == "hit", name
        assert retuned["place_quantizers"]["status"] == "hit", name  # the presets share it
        assert retuned["qparams"]["status"] == "ran", name
        assert retuned["to_onnx"]["status"] == "hit", (name, retuned["to_onnx"])
