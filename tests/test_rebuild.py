"""The rebuilder's one decision (engine/rebuild.py): an entry under a stage's key is a hit, a
miss or stale, decided in one place that the scheduler, the planner and the batch all ask."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import graphbuild
import graphbuild.engine.codecs as codecs
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.codecs import Encoded, JsonCodec, Part, register_codec
from graphbuild.engine.keying import Keys
from graphbuild.engine.pipeline import Pipeline
from graphbuild.engine.rebuild import Freshness, decide

ENGINE = Path(graphbuild.__file__).parent / "engine"


def make(inputs, samples, ctx):
    return {"x": 1}


def pipeline() -> Pipeline:
    p = Pipeline(name="rebuild")
    p.register_stage(make, "make", reads=())
    return p


def keyed(cache: Cache | None) -> tuple[Keys, str]:
    keys = Keys(pipeline(), None, None, {}, cache, "rebuild")
    keys.begin("make")
    key = keys.compute_key("make")
    assert key is not None
    return keys, key


class ShoutingJsonCodec(JsonCodec):
    """The JSON codec's replacement: same name, other code."""

    def encode(self, value):
        return Encoded(self.name, {"loud": True}, [Part(repr(value).upper().encode())])


def test_an_entry_is_a_miss_then_a_hit_then_stale_once_its_codec_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(codecs, "_CODECS", list(codecs._CODECS))
    monkeypatch.setattr(codecs, "_BY_NAME", dict(codecs._BY_NAME))
    cache = Cache(tmp_path / "cache")
    keys, key = keyed(cache)
    assert decide(cache, key, keys).freshness is Freshness.MISS

    pipeline().run(None, cache=cache)
    found = decide(cache, key, keys)
    assert found.hit and found.manifest is not None and found.reason is None

    register_codec(ShoutingJsonCodec())
    keys, key = keyed(cache)  # a new run: the codec versions as they are now
    stale = decide(cache, key, keys)
    assert stale.freshness is Freshness.STALE and not stale.hit
    assert stale.manifest is not None and "codec 'json'" in (stale.reason or "")


def test_no_cache_or_no_key_is_a_miss(tmp_path):
    keys, key = keyed(None)
    assert decide(None, key, keys).freshness is Freshness.MISS
    assert decide(Cache(tmp_path / "cache"), None, keys).freshness is Freshness.MISS


def test_only_a_hit_counts_as_one_when_asked(tmp_path):
    cache = Cache(tmp_path / "cache")
    pipeline().run(None, cache=cache)
    keys, key = keyed(cache)
    before = cache.stats().hits

    decide(cache, key, keys, count=False)
    assert cache.stats().hits == before
    decide(cache, key, keys)
    assert cache.stats().hits == before + 1


def _calls(path: Path, name: str) -> list[int]:
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id == name)
            or (isinstance(node.func, ast.Attribute) and node.func.attr == name)
        )
    ]


@pytest.mark.parametrize("caller", ["scheduler.py", "plan.py", "batch.py"])
def test_each_caller_asks_the_decision_once_and_never_compares_codecs_itself(caller):
    assert len(_calls(ENGINE / caller, "decide")) == 1
    assert _calls(ENGINE / caller, "stale_codecs") == []


def test_the_codec_rule_lives_in_the_rebuilder_alone():
    users = sorted(p.name for p in ENGINE.rglob("*.py") if "stale_codecs" in p.read_text())
    assert users == ["rebuild.py"]
