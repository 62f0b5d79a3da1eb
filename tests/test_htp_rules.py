"""The HTP rules (AIMET's htp_v81 semantics) on small hand-written graph views.

tests/test_aimet_interop.py checks the same rules against aimet-onnx itself on the zoo; these
state them one at a time."""

from __future__ import annotations

from graphbuild.targets.qnn.rules import config
from graphbuild.targets.qnn.rules.plan import SOFTMAX_MIN_INPUT_SCALE, GraphView, OpNode, plan


def view(ops: list[OpNode], inputs=("x",), constants=(), scalars=None) -> GraphView:
    tensors = set(inputs) | set(constants) | {t for op in ops for t in op.outputs}
    outputs = [ops[-1].outputs[0]]
    return GraphView(ops, list(inputs), outputs, tensors, set(constants), {}, dict(scalars or {}))


def op(name: str, op_type: str, inputs: tuple, **extra) -> OpNode:
    return OpNode(name, op_type, tuple(inputs), (name,), **extra)


def test_the_config_file_supplies_the_op_lists():
    assert {"Cast", "Gather"} <= config.float_output_ops()
    assert {"Conv", "ConvTranspose", "Gemm", "MatMul"} <= config.per_channel_ops()
    assert ("Conv", "Relu") in config.supergroups()
    assert ("Add", "Relu") in config.supergroups()
    assert config.encoding_constraint("Softmax") == (0.0, 1.0)


def test_a_conv_relu_supergroup_quantizes_only_the_relu_output():
    rules = plan(
        view(
            [op("conv", "Conv", ("x", "w", "b")), op("relu", "Relu", ("conv",))],
            constants=("w", "b"),
        ),
        8,
        16,
    )
    assert not rules["conv"].quantized and "supergroup" in rules["conv"].why
    assert rules["relu"].quantized and rules["relu"].bits == 16 and not rules["relu"].symmetric
    assert rules["w"].param and rules["w"].per_channel and rules["w"].symmetric
    assert not rules["b"].quantized  # biases stay float


def test_a_depthwise_conv_starts_no_supergroup_and_its_relu_shares_its_encoding():
    ops = [op("conv", "Conv", ("x", "w"), depthwise=True, groups=8), op("relu", "Relu", ("conv",))]
    rules = plan(view(ops, constants=("w",)), 8, 8)
    assert rules["conv"].quantized and rules["relu"].group == "conv"


def test_data_movement_keeps_its_input_encoding_and_gather_outputs_stay_float():
    ops = [
        op("embedding", "Gather", ("table", "ids")),
        op("view", "Reshape", ("embedding", "shape")),
        op("fc", "Gemm", ("view", "w", "b")),
    ]
    rules = plan(view(ops, inputs=(), constants=("table", "w", "b")), 8, 16)
    assert rules["table"].quantized and not rules["table"].param  # an activation table
    assert not rules["embedding"].quantized and not rules["view"].quantized
    assert rules["fc"].quantized


def test_an_activation_matmul_second_input_is_symmetric_like_a_weight():
    ops = [
        op("q", "Gemm", ("x", "wq", "bq")),
        op("k", "Gemm", ("x", "wk", "bk")),
        op("kt", "Transpose", ("k",)),
        op("scores", "MatMul", ("q", "kt")),
    ]
    consts = ("wq", "bq", "wk", "bk")
    for bits in (8, 16):
        rules = plan(view(ops, constants=consts), 8, bits)
        assert rules["k"].symmetric and rules["k"].bits == bits
        assert not rules["q"].symmetric


def test_concat_inputs_read_by_it_alone_share_its_encoding():
    ops = [op("a", "Neg", ("x",)), op("b", "Sigmoid", ("x",)), op("cat", "Concat", ("a", "x"))]
    rules = plan(view(ops), 8, 16)
    assert rules["a"].group == rules["cat"].group  # read by the Concat only: one encoding
    assert rules["x"].group == "x" != rules["cat"].group  # read elsewhere too: its own


def test_a_matmul_with_a_bias_add_is_one_linear():
    ops = [op("mm", "MatMul", ("x", "w")), op("linear", "Add", ("mm", "b"))]
    rules = plan(view(ops, constants=("w", "b")), 4, 16)
    assert not rules["mm"].quantized and not rules["b"].quantized
    assert rules["linear"].quantized and rules["w"].bits == 4 and rules["w"].per_channel


def test_a_spelled_out_rmsnorm_quantizes_its_result_and_weight_only():
    ops = [
        op("sq", "Mul", ("x", "x")),
        op("mean", "ReduceMean", ("sq",)),
        op("add", "Add", ("mean", "eps")),
        op("sqrt", "Sqrt", ("add",)),
        op("recip", "Reciprocal", ("sqrt",)),
        op("norm", "Mul", ("x", "recip")),
        op("out", "Mul", ("norm", "gamma")),
    ]
    rules = plan(view(ops, constants=("eps", "gamma")), 8, 16)
    assert [
        t for t in ("sq", "mean", "add", "sqrt", "recip", "norm", "eps") if rules[t].quantized
    ] == []
    assert rules["out"].quantized and rules["gamma"].quantized


def test_softmax_and_tanh_outputs_have_fixed_ranges():
    ops = [op("t", "Tanh", ("x",)), op("s", "Softmax", ("t",))]
    rules = plan(view(ops), 8, 16)
    assert rules["t"].fixed == (-1.0, 1.0) and rules["t"].symmetric
    assert rules["s"].fixed == (0.0, 1.0) and not rules["s"].symmetric


def test_layernorm_weights_are_8_bit_asymmetric_even_with_4_bit_weights():
    rules = plan(
        view([op("ln", "LayerNormalization", ("x", "g", "b"))], constants=("g", "b")), 4, 16
    )
    assert (rules["g"].bits, rules["g"].symmetric, rules["g"].per_channel) == (8, False, False)
    assert not rules["b"].quantized


def test_a_softmax_input_grid_is_no_finer_than_the_htp_computes_right_from():
    """The HTP's rule, not AIMET's: through data movement to the quantizer that holds it."""
    ops = [op("m", "Mul", ("x", "x")), op("r", "Reshape", ("m",)), op("s", "Softmax", ("r",))]
    rules = plan(view(ops), 8, 16)
    assert rules["m"].min_scale == SOFTMAX_MIN_INPUT_SCALE
    assert rules["s"].min_scale is None and rules["x"].min_scale is None


def test_an_encoding_that_is_no_softmax_input_has_no_minimum_step():
    rules = plan(view([op("m", "Mul", ("x", "x")), op("t", "Tanh", ("m",))]), 8, 16)
    assert all(r.min_scale is None for r in rules.rules.values())
