"""How a model file's tensors are laid out: inline, one ``.onnx.data`` file, or one data file
per large tensor (``per_tensor``, the default above 32 MiB), where a re-export writes the
files of the tensors that changed and hard-links the others."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import graphbuild as gb
from graphbuild.errors import ExportError
from graphbuild.onnx import bind as bind_module
from graphbuild.onnx.bind import BoundModel
from graphbuild.onnx.save import (
    PER_TENSOR_THRESHOLD,
    data_file_name,
    is_data_file,
    materialize,
    save_model,
)
from tests.test_bind_save import reference

X = np.random.default_rng(1).standard_normal((2, 256), dtype=np.float32)


def mlp_bound_model(big: int = 256, seed: int = 0) -> BoundModel:
    """x @ w1 + b1 @ w2 + b2: two [big, big] weights (256 KiB each at 256), two small biases."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"]),
        helper.make_node("Add", ["h1", "b1"], ["a1"]),
        helper.make_node("MatMul", ["a1", "w2"], ["h2"]),
        helper.make_node("Add", ["h2", "b2"], ["y"]),
    ]
    inits = [
        reference("w1", [big, big], TensorProto.FLOAT),
        reference("b1", [big], TensorProto.FLOAT),
        reference("w2", [big, big], TensorProto.FLOAT),
        reference("b2", [big], TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, big])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, big])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    tensors = {
        "w1": rng.standard_normal((big, big), dtype=np.float32) / 16,
        "b1": rng.standard_normal(big, dtype=np.float32),
        "w2": rng.standard_normal((big, big), dtype=np.float32) / 16,
        "b2": rng.standard_normal(big, dtype=np.float32),
    }
    return BoundModel(model, tensors)


def run(model: str | onnx.ModelProto, x: np.ndarray = X) -> np.ndarray:
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_per_tensor_gives_each_large_tensor_a_file_and_keeps_small_ones_inline(tmp_path):
    bound = mlp_bound_model()
    paths = save_model(bound, tmp_path / "m.onnx", external_data="per_tensor")
    assert [p.name for p in paths] == ["m.onnx", "m.onnx.data.0", "m.onnx.data.1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in paths]
    saved = onnx.load(str(paths[0]), load_external_data=False)
    where = {
        i.name: {e.key: e.value for e in i.external_data}.get("location")
        for i in saved.graph.initializer
    }
    assert where == {"w1": "m.onnx.data.0", "b1": None, "w2": "m.onnx.data.1", "b2": None}
    assert (tmp_path / "m.onnx.data.1").read_bytes() == bound.tensors["w2"].tobytes()
    np.testing.assert_array_equal(run(str(paths[0])), run(materialize(bound)))
    loaded = onnx.load(str(paths[0]))
    for init in loaded.graph.initializer:
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(init), bound.tensors[init.name])


def test_by_default_a_model_over_32_mib_is_written_per_tensor(tmp_path):
    big = 3072  # two 36 MiB weights: over the threshold together
    bound = mlp_bound_model(big)
    assert sum(a.nbytes for a in bound.tensors.values()) > PER_TENSOR_THRESHOLD
    paths = save_model(bound, tmp_path / "m.onnx")
    assert [p.name for p in paths] == ["m.onnx", "m.onnx.data.0", "m.onnx.data.1"]
    x = np.random.default_rng(2).standard_normal((2, big), dtype=np.float32)
    np.testing.assert_allclose(run(str(paths[0]), x), run(materialize(bound), x), rtol=0, atol=0)


def test_by_default_a_small_model_stays_one_file(tmp_path):
    paths = save_model(mlp_bound_model(), tmp_path / "m.onnx")
    assert [p.name for p in paths] == ["m.onnx"]


def test_an_unknown_layout_is_refused(tmp_path):
    with pytest.raises(ExportError, match="per_tensor"):
        save_model(mlp_bound_model(), tmp_path / "m.onnx", external_data="sharded")


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("m.onnx.data", True),
        ("m.onnx.data.0", True),
        ("m.onnx.data.17", True),
        ("m.onnx.data.017", False),
        ("m.onnx.data.", False),
        ("m.onnx.data.-1", False),
        ("m.onnx.data.1x", False),
        ("m.onnx.data.\u0663", False),  # a digit, but not an ASCII one
        ("n.onnx.data.0", False),
        ("m.onnx", False),
    ],
)
def test_data_file_names(name, ok):
    assert is_data_file(name, "m.onnx") is ok
    assert is_data_file(data_file_name("m.onnx", 3), "m.onnx")


# ------------------------------------------------------------------ re-exports


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(256, 256)
        self.b = torch.nn.Linear(256, 256)
        self.c = torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


SAMPLE = (torch.randn(2, 256, generator=torch.Generator().manual_seed(3)),)


def export(model, out: Path, cache, external_data="per_tensor") -> gb.ExportArtifacts:
    return gb.export(
        model,
        SAMPLE,
        out,
        "mlp",
        options=gb.QnnOnnxOptions(external_data=external_data),
        cache=cache,
    )


def inodes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in directory.iterdir() if ".data" in p.name}


def contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if "lock" not in p.name}


@pytest.fixture(autouse=True)
def fresh_memo():
    bind_module._Memo.clear()
    yield
    bind_module._Memo.clear()


def test_a_re_export_writes_the_changed_tensor_and_links_the_others(tmp_path):
    m = Mlp().eval()
    out = tmp_path / "out"
    export(m, out, tmp_path / "cache")
    before = inodes(out)
    assert len(before) == 3  # the three weights; the biases are inline
    with torch.no_grad():
        m.b.weight.mul_(0.5)
    export(m, out, tmp_path / "cache")
    after = inodes(out)
    changed = {n for n in after if after[n] != before.get(n)}
    assert len(changed) == 1
    weight = m.b.weight.detach().numpy()
    assert (out / changed.pop()).read_bytes() in (weight.tobytes(), weight.T.copy().tobytes())
    bind_module._Memo.clear()
    export(m, tmp_path / "fresh", False)
    assert contents(out) == contents(tmp_path / "fresh")
    np.testing.assert_allclose(
        run(str(out / "mlp.onnx"), SAMPLE[0].numpy()), m(*SAMPLE).detach().numpy(), atol=1e-5
    )


def test_an_edited_data_file_is_written_again_not_linked(tmp_path):
    m = Mlp().eval()
    out = tmp_path / "out"
    export(m, out, tmp_path / "cache")
    victim = sorted(inodes(out))[0]
    path = out / victim
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))  # same inode, new mtime
    with torch.no_grad():
        m.c.bias.add_(1.0)  # the model file changes; the weights do not
    export(m, out, tmp_path / "cache")
    bind_module._Memo.clear()
    export(m, tmp_path / "fresh", False)
    assert contents(out) == contents(tmp_path / "fresh")


def test_a_change_of_layout_leaves_no_data_file_of_the_old_one(tmp_path):
    m = Mlp().eval()
    out = tmp_path / "out"
    export(m, out, tmp_path / "cache")
    (out / "notes.txt").write_text("mine")
    export(m, out, tmp_path / "cache", external_data=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "graphbuild.lock.json",
        "mlp.encodings",
        "mlp.onnx",
        "mlp.onnx.data",
        "notes.txt",
    ]
    export(m, out, tmp_path / "cache", external_data=False)
    assert not any(is_data_file(p.name, "mlp.onnx") for p in out.iterdir())
    assert (out / "notes.txt").read_text() == "mine"
    assert os.path.getsize(out / "mlp.onnx") > 256 * 256 * 4


def test_a_write_that_fails_midway_leaves_no_temporary_file(tmp_path, monkeypatch):
    from graphbuild.onnx import save as save_module

    real = save_module._payload
    seen = []

    def failing(bound, init):
        seen.append(init.name)
        if init.name == "w2":
            raise OSError(28, "No space left on device")
        return real(bound, init)

    monkeypatch.setattr(save_module, "_payload", failing)
    with pytest.raises(OSError, match="No space"):
        save_model(mlp_bound_model(), tmp_path / "m.onnx", external_data="per_tensor")
    assert "w2" in seen
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert not (tmp_path / "m.onnx").exists()  # the model file comes last


def test_a_re_export_leaves_every_data_file_with_one_link_and_onnx_loads_it(tmp_path):
    """onnx refuses external data with more than one hard link (a possible hard-link attack):
    the replaced export's names are gone when the export returns, and two tensors with the
    same bytes never share a file."""
    m = Mlp().eval()
    with torch.no_grad():
        m.b.weight.copy_(m.a.weight)  # two tensors, one digest
    out = tmp_path / "out"
    export(m, out, tmp_path / "cache")
    with torch.no_grad():
        m.c.bias.add_(1.0)
    export(m, out, tmp_path / "cache")
    data = [p for p in out.iterdir() if is_data_file(p.name, "mlp.onnx")]
    assert len(data) == 3
    assert [p.stat().st_nlink for p in data] == [1, 1, 1]
    loaded = onnx.load(str(out / "mlp.onnx"))
    onnx.checker.check_model(str(out / "mlp.onnx"), full_check=True)
    assert len(loaded.graph.initializer) >= 3
    np.testing.assert_allclose(
        run(str(out / "mlp.onnx"), SAMPLE[0].numpy()), m(*SAMPLE).detach().numpy(), atol=1e-5
    )


def test_a_previous_file_replaced_after_it_was_opened_is_not_linked(tmp_path, monkeypatch):
    """write_model links a previous file only while its path still names the file it opened:
    here the two previous files trade places just before the first link."""
    from graphbuild.onnx.save import PreviousFile, write_model

    bound = mlp_bound_model()
    old = write_model(bound, tmp_path / "a" / "m.onnx", external_data="per_tensor")
    previous = [PreviousFile(f.path, f.ranges, intact=True) for f in old[1:]]
    real_link = os.link

    def swap_then_link(src, dst, **kwargs):
        a, b = old[1].path, old[2].path
        os.replace(a, a.with_name("swap"))
        os.replace(b, a)
        os.replace(a.with_name("swap"), b)
        monkeypatch.setattr(os, "link", real_link)
        return real_link(src, dst, **kwargs)

    monkeypatch.setattr(os, "link", swap_then_link)
    new = write_model(
        bound, tmp_path / "b" / "m.onnx", external_data="per_tensor", previous=previous
    )
    assert [f.path.read_bytes() for f in new[1:]] == [
        bound.tensors["w1"].tobytes(),
        bound.tensors["w2"].tobytes(),
    ]
