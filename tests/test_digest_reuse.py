"""Tensor digests reused where that is sound (graphbuild.engine.digest_memo): within a run
always, across runs only on request, and check mode catches a reused digest that is wrong."""

from __future__ import annotations

import pytest
import torch

import graphbuild as gb
from graphbuild.engine import digest_memo
from graphbuild.engine.fingerprint import tensors as fingerprint
from graphbuild.errors import FingerprintMismatchError
from tests.models import FakeQuantConvNet

SAMPLE = (torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(5)),)


@pytest.fixture(autouse=True)
def memo():
    digest_memo.clear()
    yield
    digest_memo.reuse_across_runs(False)
    digest_memo.clear()


@pytest.fixture
def hashed(monkeypatch) -> list[torch.Tensor]:
    """Every tensor graphbuild hashes."""
    seen: list[torch.Tensor] = []
    real = fingerprint.tensor_digest
    monkeypatch.setattr(fingerprint, "tensor_digest", lambda t: seen.append(t) or real(t))
    return seen


def model() -> FakeQuantConvNet:
    torch.manual_seed(0)
    return FakeQuantConvNet().eval()


def export(m, tmp_path, **kwargs) -> gb.ExportArtifacts:
    return gb.export(m, SAMPLE, tmp_path / "out", "net", cache=tmp_path / "cache", **kwargs)


def distinct(model: torch.nn.Module) -> int:
    return len(pointers(model))


def pointers(model: torch.nn.Module) -> set[int]:
    return {t.data_ptr() for t in model.state_dict().values() if t.numel()}


def of_model(model: torch.nn.Module, hashed: list[torch.Tensor]) -> list[torch.Tensor]:
    """The model's own tensors among those hashed (bind hashes its small qparams too)."""
    return [t for t in hashed if t.data_ptr() in pointers(model)]


def test_one_run_hashes_each_tensor_once(tmp_path, hashed):
    m = model()
    art = export(m, tmp_path)
    assert "weight_digests" in art.report.ran
    assert len(of_model(m, hashed)) == distinct(m)  # weight_digests took input.state's


def test_by_default_a_new_run_hashes_again_and_sees_a_write_through_data(tmp_path, hashed):
    m = model()
    first = export(m, tmp_path)
    hashed.clear()
    m.fc.weight.data.mul_(0.5)  # a write torch's version counter does not see
    second = export(m, tmp_path)
    assert len(of_model(m, hashed)) == distinct(m)
    assert second.report["bind"].status == "ran"
    assert second.lock["files"]["net.onnx"] != first.lock["files"]["net.onnx"]


def test_across_runs_on_request_only_changed_tensors_are_hashed(tmp_path, hashed):
    digest_memo.reuse_across_runs(True)
    m = model()
    export(m, tmp_path)
    hashed.clear()
    assert export(m, tmp_path).report.ran == [] and of_model(m, hashed) == []
    with torch.no_grad():
        m.fc.weight.mul_(0.5)  # bumps the version counter
    art = export(m, tmp_path)
    assert [t.shape for t in of_model(m, hashed)] == [m.fc.weight.shape]
    assert art.report["bind"].status == "ran"


def test_a_replaced_tensor_is_hashed_even_at_a_reused_address(tmp_path, hashed):
    digest_memo.reuse_across_runs(True)
    m = model()
    export(m, tmp_path)
    hashed.clear()
    m.fc.bias = torch.nn.Parameter(m.fc.bias.detach() + 1)  # a new tensor, version 0
    export(m, tmp_path)
    assert [t.shape for t in of_model(m, hashed)] == [m.fc.bias.shape]


def test_check_mode_fails_loudly_on_a_reused_digest_a_data_write_made_wrong(tmp_path):
    digest_memo.reuse_across_runs(True)
    m = model()
    export(m, tmp_path)
    m.fc.weight.data.mul_(0.5)  # not seen by the version counter: the reuse would be wrong
    with pytest.raises(FingerprintMismatchError, match="version counter"):
        export(m, tmp_path, check_fingerprints=True)


def test_state_digests_sees_a_write_through_data_at_once():
    m = model()
    before = fingerprint.state_digests(m)
    m.fc.weight.data.mul_(2)  # a write torch's version counter does not see

    after = fingerprint.state_digests(m)

    assert after.digest != before.digest
    assert after.tensors["fc.weight"] != before.tensors["fc.weight"]


def test_after_an_export_state_digests_sees_a_write_through_data(tmp_path):
    m = model()
    export(m, tmp_path)
    before = fingerprint.state_digests(m)
    m.fc.weight.data.mul_(2)

    assert fingerprint.state_digests(m).digest != before.digest


def test_a_tensor_collected_while_another_is_remembered_does_not_deadlock(monkeypatch):
    """A remembered tensor freed while ``remember`` holds the memo's lock (the garbage
    collector runs whenever Python allocates) calls back into the memo from the same thread."""
    import gc
    import threading

    doomed = torch.ones(3)
    digest_memo.remember(doomed, "d" * 32)
    holder = [doomed]
    del doomed
    real = digest_memo._token

    def token_freeing_the_other(t):
        holder.clear()  # the last reference: its weakref callback runs here
        gc.collect()
        return real(t)

    monkeypatch.setattr(digest_memo, "_token", token_freeing_the_other)
    worker = threading.Thread(target=digest_memo.remember, args=(torch.zeros(2), "e" * 32))
    worker.daemon = True
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "remember deadlocked on its own lock"
