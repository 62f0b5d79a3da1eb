"""Fingerprints: the structure and state facets of a model, and tensor digests."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading

import pytest
import torch
import xxhash
from torch import nn

import graphbuild.engine.fingerprint.tensors as fp
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.fingerprint import (
    callable_version,
    state_digests,
    structure_fingerprint,
    tensor_digest,
)
from graphbuild.engine.pipeline import Pipeline
from graphbuild.errors import FingerprintError
from tests.engine_helpers import CALLS, reset, stage, tiny_net


def structure(model: nn.Module) -> str:
    return structure_fingerprint(model).digest


def state(model: nn.Module) -> str:
    return state_digests(model).digest


# --------------------------------------------------------------------------- facets


def test_two_instances_of_a_model_share_structure_but_not_state():
    a, b = tiny_net(seed=0), tiny_net(seed=1)

    assert structure(a) == structure(b)
    assert state(a) != state(b)


def test_changing_a_weight_changes_state_but_not_structure():
    model = tiny_net()
    before_structure, before = structure(model), state_digests(model)

    with torch.no_grad():
        model.conv.weight[0, 0, 0, 0] += 1.0

    after = state_digests(model)
    assert structure(model) == before_structure
    assert after.digest != before.digest
    changed = {n for n in after.tensors if after.tensors[n] != before.tensors[n]}
    assert changed == {"conv.weight"}


def test_changing_a_conv_stride_changes_structure_but_not_state():
    model = tiny_net()
    before_structure, before_state = structure(model), state(model)

    model.conv.stride = (2, 2)

    assert structure(model) != before_structure
    assert state(model) == before_state


def test_changing_layernorm_eps_changes_structure():
    model = tiny_net()
    before = structure(model)

    model.norm.eps = 1e-6

    assert structure(model) != before


def test_structure_names_the_submodule_that_changed():
    model = tiny_net()
    before = structure_fingerprint(model).modules

    model.norm.eps = 1e-6

    after = structure_fingerprint(model).modules
    assert {name for name in after if after[name] != before[name]} == {"norm"}


@dataclasses.dataclass
class RopeConfig:
    rope_theta: float = 10000.0
    scaling: dict = dataclasses.field(default_factory=lambda: {"factor": 1.0})


class PlainConfig:
    """Like a transformers PretrainedConfig: a plain object holding attributes."""

    def __init__(self) -> None:
        self.hidden_size = 4
        self.rope = RopeConfig()


class Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Linear(4, 4)


def test_a_dataclass_config_attribute_changes_structure():
    model = Attention(RopeConfig())
    before_structure, before_state = structure(model), state(model)

    model.config.rope_theta = 500000.0

    assert structure(model) != before_structure
    assert state(model) == before_state


def test_a_nested_plain_object_config_attribute_changes_structure():
    model = Attention(PlainConfig())
    s0 = structure(model)

    model.config.rope.rope_theta = 500000.0
    s1 = structure(model)
    model.config.rope.scaling["factor"] = 8.0
    s2 = structure(model)

    assert len({s0, s1, s2}) == 3


def test_editing_the_source_of_a_module_class_changes_structure(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "gb_test_blocks.py"
    source.write_text(
        "from torch import nn\n\n\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(4, 4)\n\n"
        "    def forward(self, x):\n"
        "        return self.fc(x)\n"
    )
    importlib.invalidate_caches()
    blocks = importlib.import_module("gb_test_blocks")
    monkeypatch.setitem(sys.modules, "gb_test_blocks", blocks)  # dropped after the test
    torch.manual_seed(0)
    old = blocks.Block()
    before_structure, before_state = structure(old), state(old)

    source.write_text(source.read_text().replace("self.fc(x)", "self.fc(x).relu()  # edited"))
    blocks = importlib.reload(blocks)
    new = blocks.Block()
    new.load_state_dict(old.state_dict())

    assert structure(new) != before_structure
    assert state(new) == before_state


def test_tied_weights_are_hashed_once_but_both_names_are_listed(monkeypatch):
    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.embed.weight

    model = TiedLM()
    hashed: list[tuple[int, ...]] = []
    real = fp.tensor_digest

    def counting(t):
        hashed.append(tuple(t.shape))
        return real(t)

    monkeypatch.setattr(fp, "tensor_digest", counting)

    digests = state_digests(model)

    assert hashed == [(16, 8)]
    assert set(digests.tensors) == {"embed.weight", "head.weight"}
    assert digests.tensors["embed.weight"] == digests.tensors["head.weight"]


def test_untied_equal_tensors_still_get_both_names():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].load_state_dict(model[0].state_dict())

    digests = state_digests(model)

    assert digests.tensors["0.weight"] == digests.tensors["1.weight"]
    assert len(digests.tensors) == 4


def test_an_unfingerprintable_attribute_reruns_structure_readers_every_time_naming_it(tmp_path):
    model = tiny_net()
    model.fc.lock = threading.Lock()
    p = Pipeline(name="locked")
    p.register_stage(stage("capture", lambda m, s, c: 1), "capture", reads=("input.structure",))
    p.register_stage(stage("weights", lambda m, s, c: 2), "weights", reads=("input.state",))
    cache = Cache(tmp_path / "cache")

    reports = []
    for _ in range(3):
        reset()
        reports.append(p.run(model, cache=cache).report)
        assert "capture" in CALLS

    assert [r["capture"].status for r in reports] == ["ran", "ran", "ran"]
    assert [r["weights"].status for r in reports] == ["ran", "hit", "hit"]
    reason = reports[-1]["capture"].reason
    assert reason.startswith("cannot be cached: input.structure")
    assert "fc.lock" in reason
    assert "_thread.lock" in reason
    assert reports[-1]["capture"].key is None
    cache.close()


class Link:
    def __init__(self, child=None, value=0) -> None:
        self.child = child
        self.value = value


def chain(length: int, value: int) -> Link:
    link = Link(value=value)
    for _ in range(length):
        link = Link(link)
    return link


def test_a_value_nested_too_deep_to_fingerprint_is_refused_not_ignored():
    model = nn.Linear(2, 2)
    model.config = chain(30, value=1)

    with pytest.raises(FingerprintError, match="config.child.child.*nested more than"):
        structure_fingerprint(model)


def test_a_module_referring_back_to_its_parent_is_fingerprinted():
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    model[0].owner = [model]  # a back-reference outside _modules
    before = structure(model)

    model[1].eps = 1e-3

    assert structure(model) != before


def test_a_recursive_closure_has_a_code_version():
    def make(step):
        def countdown(n):
            return countdown(n - step) if n > 0 else 0

        return countdown

    assert callable_version(make(1)) == callable_version(make(1))
    assert callable_version(make(1)) != callable_version(make(2))


# --------------------------------------------------------------------------- tensors


def test_tensor_digest_is_xxh3_128_of_the_tensor_memory():
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)

    assert tensor_digest(t) == xxhash.xxh3_128_hexdigest(t.numpy().tobytes())


def test_tensor_digest_is_equal_for_contiguous_and_non_contiguous_tensors_with_equal_values():
    base = torch.randn(6, 8)
    transposed = base.t()
    strided = base[:, ::2]
    assert not transposed.is_contiguous() and not strided.is_contiguous()

    assert tensor_digest(transposed) == tensor_digest(transposed.contiguous())
    assert tensor_digest(strided) == tensor_digest(strided.clone())
    assert tensor_digest(transposed) != tensor_digest(base)


def test_tensor_digest_of_bfloat16_covers_its_bits():
    t = torch.randn(5, 3).to(torch.bfloat16)
    bits = t.view(torch.int16).numpy().tobytes()

    assert tensor_digest(t) == xxhash.xxh3_128_hexdigest(bits)
    changed = t.clone()
    changed[4, 2] += 1
    assert tensor_digest(changed) != tensor_digest(t)


def test_tensor_digest_ignores_requires_grad():
    w = torch.randn(3, 3)

    assert tensor_digest(nn.Parameter(w.clone())) == tensor_digest(w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8, torch.bool, torch.float64])
def test_tensor_digest_reads_every_dtype(dtype):
    t = (torch.arange(10) % 3).to(dtype)

    assert tensor_digest(t) == xxhash.xxh3_128_hexdigest(t.numpy().tobytes())


def test_parallel_tensor_digests_equal_one_at_a_time(monkeypatch):
    from graphbuild.engine.fingerprint import tensors as fingerprint

    tensors = [torch.randn(1000 + i) for i in range(40)] + [torch.arange(7).t()]
    serial = [fingerprint.tensor_digest(t) for t in tensors]
    monkeypatch.setattr(fingerprint, "PARALLEL_BYTES", 0)
    assert fingerprint.tensor_digests(tensors) == serial


def test_state_digests_hash_tied_tensors_once_and_name_each(monkeypatch):
    from graphbuild.engine.fingerprint import tensors as fingerprint

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight
    hashed = []
    real = fingerprint.tensor_digests
    monkeypatch.setattr(
        fingerprint, "tensor_digests", lambda ts, **kw: hashed.extend(ts) or real(ts, **kw)
    )
    sd = fingerprint.state_digests(model)
    assert sd.tensors["0.weight"] == sd.tensors["1.weight"]
    assert len(hashed) == 3  # the shared weight and two biases
