"""Tenants: configuration checks, identity from keys or a trusted header, rights, and the usage reader."""

from __future__ import annotations

import orjson
import pytest

from extproc.errors import ApiError
from extproc.request import parse_head
from extproc.tenancy import Tenant, TenantDirectory, key_digest
from extproc.usage import UsageWatch, with_usage_requested
from poolgate.kernel.config import ConfigError, parse_config

GOLD_KEY, BRONZE_KEY = "sk-gold-1", "sk-bronze-1"


def config(**tenancy: object) -> dict[str, object]:
    return {
        "pools": [{"name": "chat", "model": "llama"}, {"name": "vip", "model": "llama"},
                  {"name": "code", "model": "coder"}],
        "tenancy": tenancy,
        "tenants": [
            {"name": "gold", "api_key_sha256": [key_digest(GOLD_KEY)], "priority": "high",
             "dedicated_pools": ["vip"], "dedicated_only": False, "tokens_per_minute": 1000},
            {"name": "bronze", "api_key_sha256": [key_digest(BRONZE_KEY)], "priority": "low", "models": ["llama"],
             "max_concurrent": 2},
        ],
    }


def directory(**tenancy: object) -> TenantDirectory:
    cfg = parse_config(config(**tenancy))
    return TenantDirectory(cfg.tenancy, cfg.tenants)


def test_keys_map_to_tenants_and_unknown_keys_are_refused_when_required() -> None:
    tenants = directory(require_api_key=True)
    gold = tenants.identify(f"Bearer {GOLD_KEY}", "")
    assert isinstance(gold, Tenant) and (gold.name, gold.priority_class, gold.priority) == ("gold", "high", 0)
    for authorization in ("Bearer sk-wrong", "", "Basic abc", GOLD_KEY):
        error = tenants.identify(authorization, "")
        assert isinstance(error, ApiError) and (error.status, error.code) == (401, "invalid_api_key")


def test_open_gateway_ignores_placeholder_keys() -> None:
    tenants = directory()
    assert tenants.identify("Bearer unused", "") is tenants.default
    assert tenants.default.name == "default" and tenants.default.priority_class == "standard"
    assert not tenants.default.has_quota and tenants.default.excluded_pools == {"vip"}


def test_rights_and_dedicated_pools() -> None:
    tenants = directory()
    gold, bronze = tenants.by_name["gold"], tenants.by_name["bronze"]
    assert gold.may_use("coder") and bronze.may_use("llama") and not bronze.may_use("coder")
    assert gold.only_pools is None and gold.excluded_pools == frozenset()  # dedicated_only false
    assert bronze.excluded_pools == {"vip"} and bronze.only_pools is None


def test_tenant_header_is_read_only_when_trusted() -> None:
    pairs = [(":method", "POST"), (":path", "/v1/chat/completions"), ("x-tenant-id", "gold"),
             ("authorization", "Bearer x")]
    untrusted = parse_head(pairs, "x-tenant-id", trust_tenant_header=False)
    assert untrusted.tenant_claim == "" and "x-tenant-id" in untrusted.client_routing_headers
    trusted = parse_head(pairs, "x-tenant-id", trust_tenant_header=True)
    assert trusted.tenant_claim == "gold" and trusted.authorization == "Bearer x"
    tenants = directory(tenant_header="x-tenant-id", trust_tenant_header=True, require_api_key=True)
    assert tenants.identify("", "gold") is tenants.by_name["gold"]
    assert isinstance(tenants.identify("", "nobody"), ApiError)


@pytest.mark.parametrize(("change", "words"), [
    ({"tenancy": {"require_api_key": True}, "tenants": []}, "api_key_sha256"),
    ({"tenants": [{"name": "a", "priority": "vip"}]}, "unknown class"),
    ({"tenants": [{"name": "a", "dedicated_pools": ["chat"]}, {"name": "b", "dedicated_pools": ["chat"]}]},
     "already dedicated"),
    ({"tenants": [{"name": "a", "api_key_sha256": ["plain-key"]}]}, "SHA-256"),
    ({"tenancy": {"tenant_header": "x-poolgate-tenant", "trust_tenant_header": True}}, "removed by Envoy"),
    ({"tenants": [{"name": "a"}, {"name": "a"}]}, "unique"),
])
def test_bad_tenancy_configs_name_the_problem(change: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_config({**config(), **change})


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else orjson.dumps(e)) + b"\n\n" for e in events)


CHUNK = {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": None}
USAGE = {"id": "c", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


def test_stream_usage_is_read_and_its_chunk_hidden_even_when_split() -> None:
    stream = sse(CHUNK, CHUNK, USAGE, b"[DONE]")
    watch = UsageWatch(stream=True, hide_usage_chunk=True)
    sent = b""
    for start in range(0, len(stream), 37):  # arbitrary cuts, mid-event
        piece = stream[start:start + 37]
        out = watch.feed(piece, start + 37 >= len(stream))
        sent += piece if out is None else out
    assert sent == sse(CHUNK, CHUNK, b"[DONE]") and watch.total_tokens == 10


def test_usage_kept_for_clients_that_asked_and_read_from_plain_bodies() -> None:
    watch = UsageWatch(stream=True, hide_usage_chunk=False)
    assert watch.feed(sse(CHUNK, USAGE), False) is None and watch.total_tokens == 10
    plain = UsageWatch(stream=False)
    body = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6}})
    assert plain.feed(body[:10], False) is None and plain.feed(body[10:], True) is None
    assert plain.total_tokens == 11


def test_usage_request_injection_keeps_other_options() -> None:
    body = orjson.dumps({"model": "m", "stream": True, "stream_options": {"x": 1}})
    rewritten = with_usage_requested(body)
    assert rewritten is not None
    assert orjson.loads(rewritten)["stream_options"] == {"x": 1, "include_usage": True}
