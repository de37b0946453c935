"""Inputs a reviewer attacked the library with (a new user's trial): each must give a clear error
naming the problem, or the right result, never a silently wrong cache or file."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import jacap_attn
from jacap_attn import JacapConfig
from jacap_attn.methods import Jacap, Method, SnapKV, register, unregister
from jacap_attn.files.persist import CacheFileError
from conftest import random_ids, tiny_model
from test_robustness import kept_prompt_positions


@pytest.fixture(autouse=True)
def _attack_methods():
    """The deliberately broken methods exist only during these tests (other test files build their
    matrices from the registry)."""
    for name, cls in (("attack_scores", ScoresAs), ("attack_heads", BadHeads)):
        register(name)(cls)
    yield
    for name in ("attack_scores", "attack_heads", "attack_twice"):
        if name in jacap_attn.methods.names():
            unregister(name)


@dataclass(frozen=True)
class ScoresAs(Method):
    """Returns whatever ``kind`` says (the attacks below)."""

    kind: str = "nan"

    def score(self, inputs):
        b, h, n, _ = inputs.keys.shape
        if self.kind == "nan":
            return torch.full((b, h, n), float("nan"))
        if self.kind == "some_nan":
            s = torch.rand(b, h, n)
            s[..., -20:] = float("nan")  # the window and a few before it
            return s
        if self.kind == "short":
            return torch.rand(b, h, n - 1)
        if self.kind == "list":
            return [[0.0] * n]
        return None


def test_non_finite_scores_never_displace_the_window():
    model = tiny_model("llama")
    for kind in ("nan", "some_nan"):
        jacap_attn.patch(model, ratio=0.3, method="attack_scores", kind=kind, window=8)
        cache = jacap_attn.compress(model, random_ids(1, 60))
        for layer in cache.layers:
            for head in kept_prompt_positions(layer, 0, 60):
                assert set(range(52, 60)) <= set(head) and len(head) == 18, (kind, head)


@pytest.mark.parametrize("kind", ["short", "list", "none"])
def test_a_score_of_the_wrong_shape_or_type_names_the_method(kind):
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.3, method="attack_scores", kind=kind, window=8)
    with pytest.raises(ValueError, match="method 'attack_scores': score must return a float tensor"):
        jacap_attn.compress(model, random_ids(1, 60))


@dataclass(frozen=True)
class BadHeads(SnapKV):
    value: int = -3

    def head_budgets(self, scores, budgets, key_valid, window):
        return torch.full(scores.shape[:2], self.value, dtype=torch.int64)


@pytest.mark.parametrize("value", [-3, 10**6])
def test_bad_head_budgets_name_the_method(value):
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.3, method="attack_heads", value=value, window=8)
    with pytest.raises(ValueError, match="method 'attack_heads': head_budgets"):
        jacap_attn.compress(model, random_ids(1, 60))


def test_save_cache_refuses_another_prompt_batch_or_model(tmp_path):
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    jacap_attn.patch(model, ratio=0.3, window=8)
    jacap_attn.patch(other, ratio=0.3, window=8)
    prompt = random_ids(1, 60)
    cache = jacap_attn.compress(model, prompt)
    path = tmp_path / "c.safetensors"
    with pytest.raises(ValueError, match="do not start with the prompt this cache was built from"):
        jacap_attn.save_cache(cache, path, model=model, prompt_ids=random_ids(1, 60, seed=5))
    with pytest.raises(ValueError, match="1 row"):
        jacap_attn.save_cache(cache, path, model=model, prompt_ids=prompt.expand(2, -1))
    with pytest.raises(ValueError, match="weights fingerprint"):
        jacap_attn.save_cache(cache, path, model=other, prompt_ids=prompt)
    assert not path.exists()


def test_unregistered_or_non_dataclass_methods_are_refused():
    model = tiny_model("llama")

    @dataclass(frozen=True)
    class Unregistered(Method):
        def score(self, inputs):
            return inputs.keys.float().norm(dim=-1)

    class NotADataclass(Method):
        """A Method subclass without the frozen-dataclass decorator."""

    @dataclass(frozen=True)
    class SnapKVVariant(SnapKV):
        """A registered parent's subclass that is not registered itself."""

    for method, match in ((Unregistered(), "not registered"), (NotADataclass(), "frozen dataclass"),
                          (SnapKVVariant(), "not registered"), (Method(), "frozen dataclass")):
        with pytest.raises(ValueError, match=match):
            jacap_attn.patch(model, ratio=0.3, method=method)
    assert not jacap_attn.is_patched(model)


def test_one_class_one_name_and_no_keywords():
    @dataclass(frozen=True)
    class Twice(Method):
        def score(self, inputs):
            return inputs.keys.float().norm(dim=-1)

    register("attack_twice")(Twice)
    with pytest.raises(ValueError, match="already registered as 'attack_twice'"):
        register("attack_twice_again")(Twice)
    with pytest.raises(ValueError, match="keyword"):
        register("class")


@pytest.mark.parametrize("data", [[], "jacap", {"windw": 4}, {"method": "snapkv", "options": {"ridge": 1}},
                                  {"method": "snapkv", "options": 3}, {"method": "nope"}])
def test_config_from_a_bad_dict_is_a_value_error(data):
    with pytest.raises(ValueError):
        JacapConfig.from_dict(data)


def test_config_from_a_minimal_dict_uses_defaults():
    # A saved config without `chunk_scores` was written before it existed: chunk cuts scored by the window.
    assert JacapConfig.from_dict({"method": "snapkv"}) == JacapConfig(method=SnapKV(), chunk_scores="rescore",
                                                                   chunk_mass=False)
    # A saved config without `spans` was written before word spans existed: token by token.
    # ... and without `lookahead` before lookahead queries: scored by the window alone.
    # ... and without the carry's and prompt lookup's options before they were on by default (2026-12-05/06).
    # ... and without `chunk_mass` before it existed (2026-12-06): no mass carried.
    assert JacapConfig.from_dict({}) == JacapConfig(spans="none", chunk_scores="rescore", chunk_mass=False, lookahead=0,
                                                    method=Jacap(carry=0.0, carry_len=64, carry_count=0, carry_by="score",
                                                                 lookup=0, lookup_share=0.5, lookup_free=0, lookup_ahead=False))


def test_load_cache_turns_a_bad_stored_config_into_a_cache_file_error(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=0.3, window=8)
    prompt = random_ids(1, 60)
    path = tmp_path / "c.safetensors"
    jacap_attn.save_cache(jacap_attn.compress(model, prompt), path, model=model, prompt_ids=prompt)
    with safe_open(path, "pt") as handle:
        metadata = dict(handle.metadata())
    for bad in ("[]", '{"method": "jacap", "windw": 3}'):
        save_file(load_file(path), tmp_path / "bad.safetensors", metadata={**metadata, "jacap_config": bad})
        with pytest.raises(CacheFileError, match="jacap_config"):
            jacap_attn.load_cache(tmp_path / "bad.safetensors", model)


@pytest.mark.parametrize("n,ratio,kept", [(100, 0.07, 7), (25, 7 / 25, 7), (1000, 0.1, 100), (101, 0.07, 8)])
def test_budget_is_the_ceiling_of_ratio_times_n_without_float_error(n, ratio, kept):
    model = tiny_model("llama")
    jacap_attn.patch(model, ratio=ratio, window=4, method="knorm")
    cache = jacap_attn.compress(model, random_ids(1, n, seed=3))
    assert int(cache.layers[0].valid[0, 0].sum()) == kept
