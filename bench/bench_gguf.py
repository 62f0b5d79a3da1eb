"""Benchmark: the GGUF target's re-exports against its cold export, and the bytes each writes.

One process, one transformers Llama (random weights, built offline; ``--quick``: a small one),
exported with the ``q8_0`` preset into a fresh cache:

* **baseline**: what a one-shot exporter does (FastForward's GGUF pipeline): llama.cpp's own
  reference quantizer (``gguf.quants.quantize``) on every 2-D weight, RoPE rows permuted, and
  ``gguf.GGUFWriter`` writing the file with the same metadata and vocabulary;
* **cold**: graphbuild's export into an empty cache;
* **warm**: nothing changed;
* **weights**: one MLP weight scaled (the other tensors unchanged), in this process (the pack
  memo holds the unchanged tensors' blocks);
* **weights, new process**: the same after forgetting the memo (what a new ``graphbuild
  export`` process does: every tensor repacked, unchanged ranges still copied);
* **tokenizer**: another tokenizer.json; **metadata**: a ``general.*`` entry added.

For each case: seconds (best of ``--repeat``), the stages that ran, and the bytes of the new
file copied from the one it replaces (``os.copy_file_range``, verified) against those written.

    python bench/bench_gguf.py [--quick] [--repeat N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MID = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
)
QUICK = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
)


def build_model(settings: dict[str, Any]):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from examples.tiny_llama import LogitsOnly

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=False, **settings)
    with torch.device("cpu"):
        model = LogitsOnly(LlamaForCausalLM(config)).eval()
    return model


class CopySpy:
    """Counts the bytes the range-copying writer copies (``os.copy_file_range``) and those it
    writes."""

    def __init__(self) -> None:
        from graphbuild.onnx import files

        self._save, self.copied, self.written = files, 0, 0
        self._copy, self._write = files.os.copy_file_range, files._FileWriter._write

    def __enter__(self) -> CopySpy:
        def copy(*args):
            n = self._copy(*args)
            self.copied += n
            return n

        def write(writer, data):
            self.written += len(data)
            return self._write(writer, data)

        self._save.os.copy_file_range = copy
        self._save._FileWriter._write = write
        return self

    def __exit__(self, *exc: object) -> None:
        self._save.os.copy_file_range = self._copy
        self._save._FileWriter._write = self._write


def baseline(model, tokenizer_path: Path, out: Path) -> float:
    """gguf.quants + GGUFWriter, as a one-shot exporter writes the file."""
    import gguf
    import numpy as np

    from graphbuild.targets.gguf.adapters import LLAMA, find_config
    from graphbuild.targets.gguf.tensors import plan_tensors, rope_order
    from graphbuild.targets.gguf.vocab import vocab_entries

    t0 = time.perf_counter()
    config, _ = find_config(model)
    entries, _ = plan_tensors(model, LLAMA, config)
    writer = gguf.GGUFWriter(str(out), "llama")
    for key, kind, value in LLAMA.hparams(config):
        writer.add_key_value(key, value, _value_type(gguf, kind), _sub_type(gguf, kind))
    vocab = vocab_entries(tokenizer_path.read_bytes(), config.vocab_size, None, "llama-bpe")
    for key, kind, value in vocab:
        writer.add_key_value(key, value, _value_type(gguf, kind), _sub_type(gguf, kind))
    state = dict(model.named_parameters())
    for e in entries:
        w = state[e["source"]].detach().float().numpy()
        if e["rope_heads"]:
            w = w[rope_order(w.shape[0], e["rope_heads"])]
        if w.ndim == 1 or e["name"].endswith("norm.weight"):
            writer.add_tensor(e["name"], np.ascontiguousarray(w))
        else:
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(e["name"], q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return time.perf_counter() - t0


def _value_type(gguf, kind: str):
    return gguf.GGUFValueType[("array" if kind.startswith("array") else kind).upper()]


def _sub_type(gguf, kind: str):
    return gguf.GGUFValueType[kind[6:-1].upper()] if kind.startswith("array[") else None


def run(quick: bool, repeat: int) -> dict[str, Any]:
    import torch

    import graphbuild as gb
    from examples.tiny_gguf import tokenizer
    from graphbuild.targets.gguf import tensors as tensors_module

    warnings.simplefilter("ignore")
    model = build_model(QUICK if quick else MID)
    weights = sum(p.numel() for p in model.parameters())
    tmp = Path(tempfile.mkdtemp(prefix="bench-gguf-"))
    tok_a, tok_b = tmp / "a.json", tmp / "b.json"
    tokenizer(tok_a)
    tokenizer(tok_b, vocab_size=300)
    ids = (torch.randint(0, 256, (1, 16)),)
    best: dict[str, dict[str, Any]] = {}

    def export(out: Path, cache, tok: Path, **options):
        options = {"quantizer": "q8_0", **options}
        with CopySpy() as spy:
            t0 = time.perf_counter()
            art = gb.export(
                model,
                ids,
                out,
                "llama",
                target="gguf",
                options=gb.GgufOptions(tokenizer=tok, **options),
                cache=cache,
            )
            seconds = time.perf_counter() - t0
        size = art.files["gguf"].stat().st_size
        return {
            "seconds": seconds,
            "ran": art.report.ran,
            "file_bytes": size,
            "copied_bytes": spy.copied,
            "written_bytes": spy.written,
        }

    def keep(case: str, result: dict[str, Any]) -> None:
        if case not in best or result["seconds"] < best[case]["seconds"]:
            best[case] = result

    for i in range(repeat):
        base = baseline(model, tok_a, tmp / f"baseline{i}.gguf")
        keep("baseline", {"seconds": base})
        tensors_module._Memo.clear()
        cache, out = gb.Cache(tmp / f"cache{i}"), tmp / f"out{i}"
        keep("cold", export(out, cache, tok_a))
        keep("warm", export(out, cache, tok_a))
        with torch.no_grad():
            model.model.model.layers[1].mlp.down_proj.weight.mul_(1.01)
        keep("weights", export(out, cache, tok_a))
        with torch.no_grad():
            model.model.model.layers[2].mlp.up_proj.weight.mul_(1.01)
        tensors_module._Memo.clear()
        keep("weights, new process", export(out, cache, tok_a))
        keep("tokenizer", export(out, cache, tok_b))
        keep("metadata", export(out, cache, tok_b, metadata={"general.author": f"run {i}"}))
        shutil.rmtree(tmp / f"cache{i}", ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    cold = best["cold"]["seconds"]
    for result in best.values():
        result["fraction_of_cold"] = result["seconds"] / cold
    return {
        "model": "llama " + ("quick" if quick else "mid") + f" ({weights / 1e6:.0f}M parameters)",
        "load_average": os.getloadavg(),
        "repeat": repeat,
        "cases": best,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small Llama")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    doc = run(args.quick, args.repeat)
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"{doc['model']}, best of {doc['repeat']}, load {doc['load_average']}")
    print(f"{'case':<22} {'seconds':>8} {'of cold':>8} {'written':>12} {'copied':>12}  ran")
    for case, r in doc["cases"].items():
        written = f"{r['written_bytes']:,}" if "written_bytes" in r else "-"
        copied = f"{r['copied_bytes']:,}" if "copied_bytes" in r else "-"
        print(
            f"{case:<22} {r['seconds']:8.3f} {r['fraction_of_cold']:8.3f} {written:>12} "
            f"{copied:>12}  {', '.join(r.get('ran', [])) or '-'}"
        )


if __name__ == "__main__":
    main()
