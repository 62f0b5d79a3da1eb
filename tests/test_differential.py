"""Differential test of the cache: after any sequence of changes, a cached export equals an
uncached export of the same state, byte for byte.

A model whose code sits in files written here (its activation comes from an ops module
through a module-level alias in a helper module; one kind of change rewrites the ops),
pre-quantized with fake-quant ops whose scales are buffers, or float and quantized by a
preset. Each step draws one change from: weights, activation scales, weight scales,
bit-widths, preset, calibration batches, range method, opset, format, encodings version,
output names, the ops' code, a registered recogniser, and a custom stage after
``marker_graph`` that edits a copy (fine) or its input in place (``InputMutationError``,
cached and uncached alike, when there is a relu to rewrite). After each step the cached
export (one cache for the whole sequence) must give the same ONNX, encodings and lock file as
an export without a cache, and a preset export with min/max ranges what the one-stage PT2E
pipeline writes (splitting quantization into structure, statistics and values changes no
byte); an export that forces
one drawn stage (it reruns on upstream outputs loaded from the cache, where the uncached
export computed them) must give them too; and a second cached export must be all hits. The
model swaps the halves of a feature map as rotary embeddings do: views that start inside
their storage, which a program loaded from the cache must digest as the computed one. The sequence is drawn by hypothesis, derandomized: every run draws
the same one; ``-m slow`` runs longer ones.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import random
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

import graphbuild as gb
from graphbuild.errors import InputMutationError, StageError
from graphbuild.frontend.normalize import recognizers, register_recognizer, unregister_recognizer
from graphbuild.frontend.programs import ProgramArtifact
from graphbuild.targets.qnn import build_qnn_pipeline

MODEL_SOURCE = '''
import torch
from torch import nn
from torch.nn import functional as F

from gb_diff_helper import act


class DiffNet(nn.Module):
    """conv -> act (from the helper module) -> linear; fake-quantized (scales and zero points are buffers)
    unless a preset quantizes it."""

    def __init__(self, act_bits=8, weight_bits=8, fake_quant=True):
        super().__init__()
        self.act_bits, self.weight_bits, self.fake_quant = act_bits, weight_bits, fake_quant
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 5)
        wmax = 2 ** (weight_bits - 1) - 1
        for name, layer in (("conv", self.conv), ("fc", self.fc)):
            w = layer.weight.detach()
            self.register_buffer(f"{name}_w_scale", w.abs().flatten(1).amax(1) / wmax)
            self.register_buffer(f"{name}_w_zp", torch.zeros(w.shape[0], dtype=torch.int32))
        for name, zp in (("x", 128), ("a", 0), ("out", 100)):
            self.register_buffer(f"{name}_scale", torch.tensor([0.03]))
            self.register_buffer(f"{name}_zp", torch.tensor([zp], dtype=torch.int32))

    def act(self, x, name):
        if not self.fake_quant:
            return x
        qmax = 2 ** self.act_bits - 1
        scale, zp = getattr(self, f"{name}_scale"), getattr(self, f"{name}_zp")
        return torch.fake_quantize_per_tensor_affine(x, scale, zp, 0, qmax)

    def weight(self, name):
        layer = getattr(self, name)
        if not self.fake_quant:
            return layer.weight
        wmax = 2 ** (self.weight_bits - 1) - 1
        scale, zp = getattr(self, f"{name}_w_scale"), getattr(self, f"{name}_w_zp")
        return torch.fake_quantize_per_channel_affine(layer.weight, scale, zp, 0, -wmax, wmax)

    def forward(self, x):
        x = self.act(x, "x")
        x = F.conv2d(x, self.weight("conv"), self.conv.bias, padding=1)
        x = torch.cat([x[..., 4:], x[..., :4]], -1)
        x = self.act(act(x), "a")
        return self.act(F.linear(torch.flatten(x, 1), self.weight("fc"), self.fc.bias), "out")
'''

# the model reaches the ops through a module-level alias in another module
HELPER_SOURCE = "import gb_diff_ops as _ops\n\nact = _ops.act\n"

# equal lengths: an edit that keeps the file's size (and, written at once, its mtime)
HELPERS = {"relu": "x.relu()", "tanh": "x.tanh()", "sigmoid": "torch.sigmoid(x)"}

SAMPLES = (torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(0)),)


def calibration(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 3, 8, 8, generator=g),) for _ in range(2)]


@dataclasses.dataclass(frozen=True)
class State:
    weight_seed: int = 0
    act_scale: float = 0.03
    weight_scale: float = 1.0
    act_bits: int = 8
    weight_bits: int = 8
    preset: str | None = None
    calibration: int = 1
    range_method: str = "minmax"
    opset: int = 21
    format: str = "onnx"
    encodings_version: str = "1.0.0"
    output_names: tuple[str, ...] | None = None
    helper: str = "relu"
    recognizer: bool = False
    stage: str = "none"
    layer_overrides: tuple[tuple[str, str], ...] | None = None


#: Every kind of change, and the values it draws from.
CHANGES: dict[str, list] = {
    "weight_seed": [0, 1, 2, 3],
    "act_scale": [0.03, 0.05, 0.011],
    "weight_scale": [1.0, 1.5, 0.75],
    "act_bits": [8, 16],
    "weight_bits": [8, 4],
    "preset": [None, "w8a8", "w8a16", "w4a16"],
    "calibration": [1, 2, 3],
    "range_method": ["minmax", "moving_average", "percentile", "mse"],
    "opset": [21, 22],
    "format": ["onnx", "onnx_qdq"],
    "encodings_version": ["1.0.0", "0.6.1", "2.0.0"],
    "output_names": [None, ("logits",), ("scores",)],
    "helper": sorted(HELPERS),
    "recognizer": [False, True],
    "stage": ["none", "copy", "in_place"],
}


#: Stages a step may force (the custom stage too, when there is one).
FORCED = [
    "capture", "quantize", "normalize", "quant_map", "qparams", "marker_graph", "to_onnx",
    "lower_markers", "weight_qparams", "weight_digests", "bind", "encodings", "coverage",
    "clamp", "place_quantizers", "placement", "fold_weights", "weight_stats", "calibrate",
    "left_float", "quant_sites",
]  # fmt: skip

#: The changes a user tuning a preset export makes (the preset stays set, LPBQ and per-layer
#: overrides among them): quantization is split into structure, statistics and values, and
#: each of these reaches another part.
#: Min/max ranges throughout, so every step is also compared with the one-stage pipeline.
PRESET_CHANGES: dict[str, list] = {
    "preset": ["w8a8", "w8a16", "w4a16", "w4a16_lpbq"],
    "layer_overrides": [None, (("conv", "w4"),), (("fc", "float"),), (("conv", "a16"),)],
    "calibration": [1, 2, 3],
    "weight_seed": [0, 1, 2, 3],
    "format": ["onnx", "onnx_qdq"],
    "helper": sorted(HELPERS),
}


def draw_changes(
    rng: random.Random, state: State, rounds: int, changes: dict[str, list] = CHANGES
) -> list[tuple[str, object, str]]:
    """``rounds`` shuffles of every kind of change, each to a value other than the one it
    had, and a stage to force after it: every kind is exercised, in a drawn order, against a
    drawn history."""
    steps = []
    for _ in range(rounds):
        kinds = sorted(changes)
        rng.shuffle(kinds)
        for kind in kinds:
            value = rng.choice([v for v in changes[kind] if v != getattr(state, kind)])
            state = dataclasses.replace(state, **{kind: value})
            steps.append((kind, value, rng.choice(FORCED)))
    return steps


# --------------------------------------------------------------------------- the world


class SymmetricActivations:
    """A user recogniser: per-tensor fake quantizers, declared symmetric."""

    def __init__(self):
        self.inner = next(r for r in recognizers() if "per_tensor_affine" in repr(r))

    def match(self, node, program):
        m = self.inner.match(node, program)
        return None if m is None else dataclasses.replace(m, symmetric=True)


def relu_to_clamp(program: torch.export.ExportedProgram) -> None:
    gm = program.graph_module
    for node in list(gm.graph.nodes):
        if node.target == torch.ops.aten.relu.default:
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(torch.ops.aten.clamp_min.default, (node.args[0], 0.0))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
    gm.recompile()


def clamp_a_copy(inputs, samples, context):
    program = copy.deepcopy(inputs[0].program)
    relu_to_clamp(program)
    return ProgramArtifact(program)


def clamp_in_place(inputs, samples, context):
    relu_to_clamp(inputs[0].program)
    return inputs[0]


def factory_for(stage: str, split: bool | None = None):
    if stage == "none":
        return None
    fn = clamp_a_copy if stage == "copy" else clamp_in_place

    def factory(request):
        p = build_qnn_pipeline(request, one_stage_oracle=split is False)
        p.insert_stage_after("marker_graph", fn, "clamp", reads=())
        return p

    return factory


def one_stage_pipeline(request):
    """The pipeline before quantization was split: PT2E quantize as one stage."""
    return build_qnn_pipeline(request, one_stage_oracle=True)


class World:
    """The files, registrations and cache that a sequence of changes acts on."""

    def __init__(self, root: Path):
        self.root = root
        self.cache = gb.Cache(root / "cache")
        self.recognizer = None
        self.state = State()
        (root / "gb_diff_model.py").write_text(MODEL_SOURCE)
        (root / "gb_diff_helper.py").write_text(HELPER_SOURCE)
        self.write_helper("relu")
        importlib.invalidate_caches()
        self.model_module = importlib.import_module("gb_diff_model")
        # reloaded in this order after an edit of the ops: each binds the one before by name
        self.modules = ["gb_diff_ops", "gb_diff_helper", "gb_diff_model"]

    def write_helper(self, name: str) -> None:
        source = f"import torch\n\n\ndef act(x):\n    return {HELPERS[name]}\n"
        (self.root / "gb_diff_ops.py").write_text(source)

    def apply(self, kind: str, value) -> None:
        old = self.state
        self.state = dataclasses.replace(old, **{kind: value})
        if kind == "helper" and value != old.helper:
            self.write_helper(value)
            for name in self.modules:
                importlib.reload(sys.modules[name])
            self.model_module = sys.modules["gb_diff_model"]
        if kind == "recognizer" and value != old.recognizer:
            if value:
                self.recognizer = register_recognizer(SymmetricActivations(), first=True)
            else:
                unregister_recognizer(self.recognizer)
                self.recognizer = None

    def model(self) -> torch.nn.Module:
        s = self.state
        torch.manual_seed(s.weight_seed)
        model = self.model_module.DiffNet(s.act_bits, s.weight_bits, fake_quant=s.preset is None)
        with torch.no_grad():
            model.a_scale.fill_(s.act_scale)
            model.conv_w_scale.mul_(s.weight_scale)
            model.fc_w_scale.mul_(s.weight_scale)
        return model.eval()

    def export(
        self, out: Path, cache, force: tuple[str, ...] = (), one_stage: bool = False
    ) -> dict[str, bytes] | str:
        """The exported files' bytes, or the name of the error a failed export raised;
        ``one_stage``: with the PT2E quantize the split replaced (no lock file: its stages
        differ)."""
        s = self.state
        options = gb.QnnOnnxOptions(
            opset=s.opset,
            encodings_version=s.encodings_version,
            output_names=s.output_names,
            quantizer=s.preset,
            calibration=calibration(s.calibration) if s.preset else None,
            range_method=s.range_method,
            layer_overrides=dict(s.layer_overrides) if s.layer_overrides else None,
        )
        factory = factory_for(s.stage)
        if one_stage:
            factory = factory_for(s.stage, split=False) or one_stage_pipeline
        try:
            art = gb.export(
                self.model(),
                SAMPLES,
                out,
                "m",
                format=s.format,
                options=options,
                cache=cache,
                pipeline_factory=factory,
                force=force,
            )
        except StageError as err:
            return f"{err.stage}: {type(err.cause).__name__}"
        if not one_stage:  # the split pipeline's report, whose stages a step may force
            self.last_report = art.report
        kept = [k for k in art.files if not (one_stage and k == "lock")]
        return {k: Path(art.files[k]).read_bytes() for k in kept}

    def close(self) -> None:
        if self.recognizer is not None:
            unregister_recognizer(self.recognizer)


@pytest.fixture
def world_factory(tmp_path_factory):
    """A fresh world per drawn sequence (hypothesis runs several in one test): its own
    directory on ``sys.path``, no bytecode written (a helper rewritten within a second keeps
    its .pyc's timestamp), its modules and recogniser gone afterwards."""

    @contextlib.contextmanager
    def make():
        root = tmp_path_factory.mktemp("world")
        saved = sys.dont_write_bytecode
        sys.dont_write_bytecode = True
        sys.path.insert(0, str(root))
        world = None
        try:
            world = World(root)
            yield world
        finally:
            if world is not None:
                world.close()
            sys.path.remove(str(root))
            sys.dont_write_bytecode = saved
            for name in ("gb_diff_model", "gb_diff_helper", "gb_diff_ops"):
                sys.modules.pop(name, None)

    return make


def check_sequence(world: World, steps) -> None:
    for i, (kind, value, forced) in enumerate(steps):
        world.apply(kind, value)
        note(f"step {i}: {kind} = {value!r} -> {world.state}")
        cached = world.export(world.root / "out", world.cache)
        uncached = world.export(world.root / f"plain{i}", False)
        assert cached == uncached, f"step {i} ({kind} = {value!r}): cached != uncached"
        if world.state.preset and world.state.range_method == "minmax":
            golden = world.export(world.root / f"one{i}", False, one_stage=True)
            if isinstance(golden, dict) and isinstance(cached, dict):
                golden = {**golden, "lock": cached["lock"]}
            assert cached == golden, f"step {i} ({kind} = {value!r}): split != one stage"
        if world.state.stage == "in_place" and world.state.helper == "relu":
            assert cached == f"clamp: {InputMutationError.__name__}"  # it rewrote the relu
            continue
        assert isinstance(cached, dict) and set(cached) == {"onnx", "encodings", "lock"}
        if forced in world.last_report.statuses:
            recomputed = world.export(world.root / "out", world.cache, force=(forced,))
            assert recomputed == uncached, f"step {i}: forcing {forced} over loaded upstreams"
        world.export(world.root / "out", world.cache)
        assert set(world.last_report.statuses.values()) == {"hit"}, world.last_report.statuses


_SETTINGS = {
    "derandomize": True,
    "database": None,
    "deadline": None,
    "phases": [Phase.generate],  # a shrink would rerun whole sequences of exports
    "suppress_health_check": list(HealthCheck),
}


@settings(max_examples=1, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_cached_exports_equal_uncached_exports_after_every_change(world_factory, seed):
    note(f"seed {seed}")
    with world_factory() as world:
        check_sequence(world, draw_changes(random.Random(seed), world.state, rounds=1))


@pytest.mark.slow
@settings(max_examples=3, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_cached_exports_equal_uncached_exports_after_long_sequences(world_factory, seed):
    note(f"seed {seed}")
    with world_factory() as world:
        check_sequence(world, draw_changes(random.Random(seed), world.state, rounds=3))


@settings(max_examples=1, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_retuning_a_preset_export_equals_uncached_and_one_stage_exports(world_factory, seed):
    note(f"seed {seed}")
    with world_factory() as world:
        world.state = State(preset="w8a16")
        steps = draw_changes(random.Random(seed), world.state, rounds=2, changes=PRESET_CHANGES)
        check_sequence(world, steps)
