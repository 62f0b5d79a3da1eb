"""One weight-shared QNN context binary for the two graphs of an LLM part (prompt AR-N and
token AR-1): the binary holds the weights once, every EPContext model points at it, the bytes
are the same every time, and the numbers match onnxruntime's CPU. The part is a toy made here
with onnx.helper: a 2-layer MLP whose int8 weights (2 MiB) dominate, w8a16, seq len 8 and 1."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphbuild.errors import ConfigError, ExportError
from graphbuild.targets.qnn import htp_runtime as hr
from graphbuild.targets.qnn.htp_runtime import backend, shared_check, shared_context, shared_weights
from graphbuild.targets.qnn.htp_runtime.errors import HtpRefusedError, HtpUnavailableError

needs_htp = pytest.mark.skipif(
    not hr.availability().available, reason=hr.availability().reason or "no HTP backend"
)

V73 = hr.HtpTarget.of("v73")
WIDTH, LAYERS = 1024, 2
PROMPT, TOKEN = "prompt_ar8_cl64_1_of_1", "token_ar1_cl64_1_of_1"


def mlp(seq: int, *, seed: int = 0, quantize_input: bool = True) -> onnx.ModelProto:
    """x [1, seq, WIDTH] -> LAYERS x (MatMul with an int8 per-channel weight, Relu between),
    uint16 activations. The same ``seed`` gives the same weights at any ``seq``."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def qdq(name: str, scale: float, zero: int = 32768) -> str:
        s, z = f"{name}_s", f"{name}_z"
        inits.append(numpy_helper.from_array(np.array(scale, np.float32), s))
        inits.append(numpy_helper.from_array(np.array(zero, np.uint16), z))
        nodes.append(helper.make_node("QuantizeLinear", [name, s, z], [f"{name}_q"]))
        nodes.append(helper.make_node("DequantizeLinear", [f"{name}_q", s, z], [f"{name}_dq"]))
        return f"{name}_dq"

    a = qdq("x", 8 / 65535) if quantize_input else "x"
    for layer in range(LAYERS):
        w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        scale = np.abs(w).max(axis=0) / 127
        q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
        names = [f"w{layer}_q", f"w{layer}_s", f"w{layer}_z"]
        inits += [
            numpy_helper.from_array(q, names[0]),
            numpy_helper.from_array(scale.astype(np.float32), names[1]),
            numpy_helper.from_array(np.zeros_like(scale, dtype=np.int8), names[2]),
        ]
        nodes.append(helper.make_node("DequantizeLinear", names, [f"w{layer}"], axis=1))
        nodes.append(helper.make_node("MatMul", [a, f"w{layer}"], [f"h{layer}"]))
        a = qdq(f"h{layer}", 16 / 65535)
        if layer < LAYERS - 1:
            nodes.append(helper.make_node("Relu", [a], [f"r{layer}"]))
            a = qdq(f"r{layer}", 8 / 65535, 0)
    nodes.append(helper.make_node("Identity", [a], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, WIDTH])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, WIDTH])
    graph = helper.make_graph(nodes, f"mlp_seq{seq}", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


#: one copy of the quantized weights: LAYERS int8 [WIDTH, WIDTH] matrices
ONE_COPY = LAYERS * WIDTH * WIDTH


def part(**token_kw) -> list[tuple[str, bytes]]:
    return [
        (PROMPT, mlp(8).SerializeToString()),
        (TOKEN, mlp(1, **token_kw).SerializeToString()),
    ]


def feeds() -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return {
        PROMPT: {"x": rng.uniform(-1, 1, (1, 8, WIDTH)).astype(np.float32)},
        TOKEN: {"x": rng.uniform(-1, 1, (1, 1, WIDTH)).astype(np.float32)},
    }


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


# --------------------------------------------------------------------------- no backend needed


@pytest.mark.parametrize("arch", ["v68", "v69"])
def test_an_arch_before_v73_is_refused_before_anything_compiles(tmp_path, monkeypatch, arch):
    def no_backend() -> None:
        raise AssertionError("the backend was reached")

    monkeypatch.setattr(shared_context, "require_backend", no_backend)
    with pytest.raises(ConfigError) as caught:
        hr.prepare_shared_context(part(), hr.HtpTarget.of(arch), tmp_path, "part")
    assert f"HTP {arch} cannot share weights" in str(caught.value)
    assert "weight sharing starts at v73" in str(caught.value)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="starts at v73"):
        hr.shared_context_key(part(), hr.HtpTarget.of(arch), "part")


def test_without_onnxruntime_qnn_preparation_says_what_to_install(tmp_path, monkeypatch):
    missing = backend.Availability(False, "onnxruntime-qnn is not installed (test)")
    monkeypatch.setattr(backend, "availability", lambda: missing)
    with pytest.raises(HtpUnavailableError, match="onnxruntime-qnn is not installed"):
        hr.prepare_shared_context(part(), V73, tmp_path, "part")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("names", "name", "message"),
    [
        ([PROMPT], "part", "two or more graphs"),
        ([PROMPT, PROMPT], "part", "more than once"),
        ([PROMPT, "../token"], "part", "plain file names"),
        ([PROMPT, TOKEN], "part/1", "plain file names"),
        ([PROMPT, TOKEN], ".hidden", "plain file names"),
    ],
)
def test_graph_and_context_names_are_plain_distinct_file_names(tmp_path, names, name, message):
    models = [(n, b"") for n in names]
    with pytest.raises(ConfigError, match=message):
        hr.prepare_shared_context(models, V73, tmp_path, name)


def _sizes(binary: int, shared: int, union: int) -> hr.WeightSharing:
    return hr.WeightSharing(binary, (union, union), shared, union)


def test_a_binary_with_two_copies_of_large_shared_weights_is_an_error():
    mib = 1 << 20
    shared_weights._check_sharing(_sizes(int(1.06 * 512 * mib), 512 * mib, 512 * mib), "part")
    with pytest.raises(ExportError, match="part is .* QNN did not share them"):
        shared_weights._check_sharing(_sizes(int(2.05 * 512 * mib), 512 * mib, 512 * mib), "part")
    # small weights: the binary's own overhead may match them, nothing to judge
    shared_weights._check_sharing(_sizes(3 * mib, mib, mib), "part")


def _external_weight_model(path: Path, name: str, data: np.ndarray) -> Path:
    """A model whose one initializer, ``name``, lies in a data file beside it."""
    init = numpy_helper.from_array(data, name)
    node = helper.make_node("Identity", [name], ["y"])
    y = helper.make_tensor_value_info("y", TensorProto.INT8, list(data.shape))
    model = helper.make_model(helper.make_graph([node], "g", [], [y], [init]))
    onnx.save(model, path, save_as_external_data=True, location=f"{path.name}.data")
    return path


def test_weight_sharing_reads_large_weights_a_chunk_at_a_time(tmp_path):
    """The check hashes each graph's weights by content; an LLM part's embedding is hundreds of
    MiB, so a whole tensor read at once would add that to the export's peak memory."""
    import tracemalloc

    size = 48 << 20
    data = np.random.default_rng(0).integers(-128, 127, size, dtype=np.int8)
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    sources = [
        _external_weight_model(tmp_path / "a" / "a.onnx", "w", data),
        _external_weight_model(tmp_path / "b" / "b.onnx", "other_name", data),
    ]
    del data
    tracemalloc.start()
    try:
        sharing = shared_weights._weight_sharing(sources, binary_bytes=size)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (sharing.shared_bytes, sharing.union_bytes) == (size, size)
    assert peak < size // 4


# --------------------------------------------------------------------------- on the HTP


@needs_htp
def test_one_binary_holds_both_graphs_and_one_copy_of_the_weights(tmp_path):
    out = tmp_path / "shared"
    out.mkdir()
    prepared = hr.prepare_shared_context(part(), V73, out, "part_1_of_1")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["part_1_of_1.bin", f"{PROMPT}.onnx", f"{TOKEN}.onnx"]
    )
    assert prepared.binary == out / "part_1_of_1.bin"
    assert prepared.models == {PROMPT: out / f"{PROMPT}.onnx", TOKEN: out / f"{TOKEN}.onnx"}
    qnn_graphs = [g.qnn_graph for g in prepared.graphs]
    assert len(set(qnn_graphs)) == 2
    for graph in prepared.graphs:
        assert graph.partition.fully_on_qnn and graph.partition.qnn_graphs == 1
        model = onnx.load(str(graph.model))
        assert model.graph.name == graph.name
        (node,) = model.graph.node
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["ep_cache_context"] == b"part_1_of_1.bin"
        assert attrs["embed_mode"] == 0 and attrs["main_context"] == 1
        assert attrs["partition_name"].decode() == graph.qnn_graph == node.name
        assert attrs["source"] == b"QNNExecutionProvider"
    binary = prepared.binary.read_bytes()
    assert all(q.encode() in binary for q in qnn_graphs)

    size = prepared.binary.stat().st_size
    assert prepared.weights.binary_bytes == size
    assert prepared.weights.shared_bytes == prepared.weights.union_bytes > ONE_COPY
    assert size < 1.5 * ONE_COPY, f"{size} bytes for {ONE_COPY} bytes of weights"

    # the same graphs prepared one context each: two copies of the weights
    separate = []
    for name, model in part():
        (tmp_path / name).mkdir()
        ctx = hr.prepare_context(model, V73, tmp_path / name / f"{name}.onnx")
        (binary_file,) = ctx.binaries
        separate.append(binary_file.stat().st_size)
    assert all(ONE_COPY < s < 1.5 * ONE_COPY for s in separate)
    assert sum(separate) > 1.8 * ONE_COPY
    assert sum(separate) > 1.7 * size


@needs_htp
def test_the_binary_names_its_graphs_after_onnxruntimes_fused_nodes_not_the_given_names(tmp_path):
    """onnxruntime names the node it fuses for a plugin execution provider itself, and
    onnxruntime-qnn 2.7 names the QNN graph after it (``ep.context_node_name_prefix`` is read
    but not applied): AI Hub's names are not in the binary, only in the EPContext models.
    Should a later onnxruntime-qnn name the graphs, this fails and docs/qnn-llm.md changes."""
    prepared = hr.prepare_shared_context(part(), V73, tmp_path, "part_1_of_1")
    binary = prepared.binary.read_bytes()
    for graph in prepared.graphs:
        fused = r"QNNExecutionProvider_QNNExecutionProvider_\d+_\d+_0"
        assert re.fullmatch(fused, graph.qnn_graph), graph.qnn_graph
        assert graph.qnn_graph.encode() in binary
        assert graph.name.encode() not in binary
        assert onnx.load(str(graph.model)).graph.name == graph.name


@needs_htp
def test_the_same_graphs_give_the_same_bytes_from_bytes_or_files_with_external_data(tmp_path):
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        out.mkdir()
        hr.prepare_shared_context(part(), V73, out, "part")
        runs.append(digests(out))
    src = tmp_path / "src"
    src.mkdir()
    files = []
    for name, seq in ((PROMPT, 8), (TOKEN, 1)):
        path = src / f"{name}_qdq.onnx"
        onnx.save(mlp(seq), str(path), save_as_external_data=True, location=f"{path.name}.data")
        files.append((name, path))
    out = tmp_path / "from_files"
    out.mkdir()
    hr.prepare_shared_context(files, V73, out, "part")
    runs.append(digests(out))
    assert runs[0] == runs[1] == runs[2]
    assert set(runs[0]) == {"part.bin", f"{PROMPT}.onnx", f"{TOKEN}.onnx"}


@needs_htp
def test_a_graph_qnn_refuses_is_named_with_qnn_reasons_and_nothing_is_written(tmp_path):
    with pytest.raises(HtpRefusedError) as caught:
        hr.prepare_shared_context(part(quantize_input=False), V73, tmp_path, "part")
    refused = caught.value
    assert refused.onnxruntime_message.startswith(f"graph {TOKEN}: ")
    assert refused.partition is not None
    assert "DequantizeLinear" in {n.op_type for n in refused.partition.cpu_nodes}
    assert list(tmp_path.iterdir()) == []


@needs_htp
def test_the_graphs_run_on_the_htp_and_match_onnxruntime_cpu(tmp_path):
    prepared = hr.prepare_shared_context(part(), V73, tmp_path, "part")
    check = hr.check_shared_context(prepared, part(), feeds())
    assert check.shared_binary != bool(check.fallback_reason)
    if not check.shared_binary:  # the x86-64 simulator of onnxruntime-qnn 2.7 cannot load it
        assert prepared.binary.name in check.fallback_reason
    assert set(check.outputs) == {PROMPT, TOKEN}
    for graph, (out,) in check.outputs.items():
        assert out.name == "y", graph
        assert out.max_diff_steps is not None and out.max_diff_steps <= 2, graph
        assert out.sqnr_htp_vs_cpu_db > 50, graph
    doc = check.to_json()
    assert doc["shared_binary"] is check.shared_binary
    assert doc["outputs"][TOKEN][0]["max_diff_steps"] <= 2


@needs_htp
def test_where_the_backend_loads_the_binary_the_check_runs_the_context_models(
    tmp_path, monkeypatch
):
    """The branch a backend that loads weight-shared binaries takes, on per-graph contexts
    standing in for them (the simulator here cannot load a shared one)."""
    graphs = []
    for name, model in part():
        (tmp_path / name).mkdir()
        ctx = hr.prepare_context(model, V73, tmp_path / name / f"{name}.onnx")
        graphs.append(hr.SharedGraph(name, ctx.model, name, ctx.partition))
    unknown = hr.WeightSharing(0, (), 0, 0)
    stand_in = hr.SharedContext("part", V73, ctx.binaries[0], tuple(graphs), unknown)

    def no_fallback(*args, **kwargs):
        raise AssertionError("prepared per-graph contexts although the binary loads")

    monkeypatch.setattr(shared_check, "shared_binary_loads", lambda prepared: "")
    monkeypatch.setattr(shared_check, "prepare_context", no_fallback)
    check = hr.check_shared_context(stand_in, part(), feeds())
    assert check.shared_binary and check.fallback_reason == ""
    assert all(o.max_diff_steps <= 2 for outs in check.outputs.values() for o in outs)


@needs_htp
def test_the_key_holds_the_graphs_bytes_the_target_and_the_backend_versions(tmp_path):
    key = hr.shared_context_key(part(), V73, "part")
    assert key == hr.shared_context_key(part(), V73, "part")
    assert key["versions"] == hr.backend_versions()
    assert (key["htp_arch"], key["soc_model"]) == ("73", "43")
    assert [g["name"] for g in key["graphs"]] == [PROMPT, TOKEN]
    assert key["recipe"] == shared_context.RECIPE
    other_weights = hr.shared_context_key(part(seed=1), V73, "part")
    assert other_weights["graphs"][0] == key["graphs"][0]
    assert other_weights["graphs"][1] != key["graphs"][1]
    assert hr.shared_context_key(part(), hr.HtpTarget.of("v81"), "part") != key
    assert hr.shared_context_key(part(), V73, "part2") != key
    # a file's digest covers its external data
    path = tmp_path / "token.onnx"
    onnx.save(mlp(1), str(path), save_as_external_data=True, location="token.onnx.data")
    before = hr.shared_context_key([(PROMPT, part()[0][1]), (TOKEN, path)], V73, "part")
    data = bytearray((tmp_path / "token.onnx.data").read_bytes())
    data[0] ^= 1
    (tmp_path / "token.onnx.data").write_bytes(bytes(data))
    after = hr.shared_context_key([(PROMPT, part()[0][1]), (TOKEN, path)], V73, "part")
    assert before["graphs"][1] != after["graphs"][1]
