"""Alias resolution: weighted splits hold their shares, rules pin tenants, unknown names pass through."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from extproc.catalogue import Catalogue
from poolgate.kernel.config import CatalogueSettings, ConfigError, parse_config

POOLS = [{"name": "chat-a", "model": "chat-v1"}, {"name": "chat-b", "model": "chat-v2"},
         {"name": "code", "model": "coder"}]


def catalogue(weights: dict[str, float] | None = None, **extra: object) -> Catalogue:
    model = {"name": "chat", "aliases": ["assistant"],
             "versions": [{"name": "v1", "served_name": "chat-v1", "max_model_len": 8192, "precision": "bf16"},
                          {"name": "v2", "served_name": "chat-v2"}],
             "weights": weights if weights is not None else {"v1": 95, "v2": 5}, **extra}
    config = parse_config({"pools": POOLS, "catalogue": {"models": [model]},
                           "tenants": [{"name": "beta"}, {"name": "other"}]})
    return Catalogue(config.catalogue)


@pytest.mark.parametrize(("weights", "share_v2"), [({"v1": 95, "v2": 5}, 0.05), ({"v1": 90, "v2": 10}, 0.10),
                                                   ({"v1": 1, "v2": 1}, 0.5), ({"v1": 0, "v2": 3}, 1.0)])
def test_weights_hold_within_two_percent_over_10k_draws(weights: dict[str, float], share_v2: float) -> None:
    resolved = catalogue(weights)
    rng = random.Random(7)
    counts = Counter(resolved.resolve("chat", "other", rng).version for _ in range(10_000))  # type: ignore[union-attr]
    assert abs(counts["v2"] / 10_000 - share_v2) <= 0.02


def test_no_weights_sends_everything_to_the_first_version() -> None:
    resolved = catalogue({})
    rng = random.Random(1)
    assert {resolved.resolve("chat", "x", rng).version for _ in range(200)} == {"v1"}  # type: ignore[union-attr]


def test_rule_pins_a_tenant_whatever_the_weights() -> None:
    resolved = catalogue({"v1": 100, "v2": 0}, rules=[{"tenants": ["beta"], "version": "v2"}])
    rng = random.Random(3)
    assert {resolved.resolve("chat", "beta", rng).served_name for _ in range(100)} == {"chat-v2"}  # type: ignore[union-attr]
    assert {resolved.resolve("chat", "other", rng).served_name for _ in range(100)} == {"chat-v1"}  # type: ignore[union-attr]


def test_alias_resolves_like_the_public_name_and_keeps_its_own_name() -> None:
    route = catalogue({"v1": 1}).resolve("assistant", "x", random.Random())
    assert route is not None and route.served_name == "chat-v1" and route.public_name == "assistant"
    assert route.renames


def test_served_name_asked_directly_keeps_its_name_and_pool_models_pass_through() -> None:
    resolved = catalogue()
    direct = resolved.resolve("chat-v2", "x", random.Random())
    assert direct is not None and not direct.renames and direct.version == "v2"
    assert resolved.resolve("coder", "x", random.Random()) is None
    assert resolved.resolve("nope", "x", random.Random()) is None


def test_model_list_shows_public_names_not_served_names_unless_configured() -> None:
    resolved = catalogue()
    ids = [card.id for card in resolved.cards(("chat-v1", "chat-v2", "coder"))]
    assert ids == ["chat", "assistant", "coder"]
    assert resolved.cards(())[0].max_model_len == 8192
    config = parse_config({"pools": POOLS, "catalogue": {"list_served_names": True, "models": [
        {"name": "chat", "versions": [{"name": "v1", "served_name": "chat-v1"}]}]}})
    assert [c.id for c in Catalogue(config.catalogue).cards(("chat-v1",))] == ["chat", "chat-v1"]


def test_empty_catalogue_renames_nothing() -> None:
    assert not Catalogue(CatalogueSettings()).renames
    assert catalogue().renames


@pytest.mark.parametrize(("model", "message"), [
    ({"name": "m", "versions": [{"name": "v1", "served_name": "ghost"}]}, "no pool serves 'ghost'"),
    ({"name": "m", "versions": [{"name": "v1", "served_name": "chat-v1"}], "weights": {"v9": 1}}, "weights.v9"),
    ({"name": "m", "versions": [{"name": "v1", "served_name": "chat-v1", "pool": "chat-b"}]}, "serves 'chat-v2'"),
    ({"name": "m", "versions": [{"name": "v1", "served_name": "chat-v1"}],
      "rules": [{"tenants": ["ghost"], "version": "v1"}]}, "unknown tenant ghost"),
    ({"name": "m", "versions": [{"name": "v1", "served_name": "chat-v1", "defaults": {"stream": True}}]},
     "stream cannot have a default"),
])
def test_invalid_catalogue_names_the_field(model: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"pools": POOLS, "catalogue": {"models": [model]}})
