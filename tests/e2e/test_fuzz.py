"""Hostile HTTP through Envoy: every answer to a bad request is a 4xx/5xx with a JSON error body, a 2xx only
ever answers a valid request, nothing crashes, and the stack serves normal traffic afterwards.

Inputs are hand-written cases (malformed JSON, deep nesting, huge strings, wrong types, invalid UTF-8, odd
``max_tokens``, 100k messages, oversized and slow bodies) plus seeded random mutations of valid requests.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import orjson
import pytest

from tests.e2e.conftest import RunningStack

pytestmark = pytest.mark.e2e

MODELS = ("chat-model", "code-model")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MUTATIONS = 400
SEED = 20240611


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes
    valid: bool = False
    """A request the API must serve (2xx); others must get a JSON error."""
    headers: tuple[tuple[str, str], ...] = ()


def chat(**fields: object) -> bytes:
    return orjson.dumps({"model": "chat-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                         **fields})


def handwritten() -> list[Case]:
    cases = [
        Case("valid chat", CHAT, chat(), valid=True),
        Case("valid completion", COMPLETIONS,
             orjson.dumps({"model": "code-model", "prompt": "def f(", "max_tokens": 2}), valid=True),
        Case("empty body", CHAT, b""),
        Case("not json", CHAT, b"hello"),
        Case("truncated json", CHAT, chat()[:-5]),
        Case("trailing garbage", CHAT, chat() + b"}}"),
        Case("json array", CHAT, b"[1, 2, 3]"),
        Case("json string", CHAT, b'"model"'),
        Case("json null", CHAT, b"null"),
        Case("nan literal", CHAT, b'{"model": "chat-model", "messages": [], "max_tokens": NaN}'),
        Case("deep array nesting", CHAT, b"[" * 100_000 + b"]" * 100_000),
        Case("deep object nesting", CHAT, b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
        Case("deep nesting in messages", CHAT, b'{"model":"chat-model","messages":' + b"[" * 5000 + b"]" * 5000
             + b"}"),
        Case("huge model name", CHAT, chat(model="m" * 500_000)),
        Case("huge prompt over context", CHAT, chat(messages=[{"role": "user", "content": "word " * 180_000}])),
        Case("huge key", CHAT, orjson.dumps({"k" * 300_000: 1, "model": "chat-model"})),
        Case("model is a number", CHAT, chat(model=7)),
        Case("model is a list", CHAT, chat(model=["chat-model"])),
        Case("model empty", CHAT, chat(model="")),
        Case("model missing", CHAT, orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})),
        Case("unknown model", CHAT, chat(model="no-such-model")),
        Case("model with nul", CHAT, chat(model="chat-model\x00")),
        Case("messages is a string", CHAT, chat(messages="hi")),
        Case("messages empty", CHAT, chat(messages=[])),
        Case("message is a number", CHAT, chat(messages=[1])),
        Case("content is a number", CHAT, chat(messages=[{"role": "user", "content": 5}])),
        Case("content parts not objects", CHAT, chat(messages=[{"role": "user", "content": [1, 2]}])),
        Case("stream is a string", CHAT, chat(stream="yes")),
        Case("prompt is an object", COMPLETIONS, orjson.dumps({"model": "code-model", "prompt": {"a": 1}})),
        Case("prompt mixed list", COMPLETIONS, orjson.dumps({"model": "code-model", "prompt": ["a", 1]})),
        Case("invalid utf-8 everywhere", CHAT, b"\xff\xfe\xfd" * 100),
        Case("invalid utf-8 in a string", CHAT, b'{"model": "chat-model", "messages": [{"role": "user", "content": "'
             + b"\xc3\x28\xa0\xa1" + b'"}]}'),
        Case("lone surrogate escape", CHAT, b'{"model": "chat-model", "messages": [{"role": "user", "content": '
             b'"\\ud800"}]}'),
        Case("utf-16 body", CHAT, chat().decode().encode("utf-16")),
        Case("bom then json", CHAT, b"\xef\xbb\xbf" + chat()),
        Case("100k messages", CHAT, orjson.dumps({"model": "chat-model",
                                                  "messages": [{"role": "user", "content": "x"}] * 100_000})),
        Case("oversized body", CHAT, chat(messages=[{"role": "user", "content": "a" * (3 * 1024 * 1024)}])),
        Case("wrong content type", CHAT, chat(), valid=True, headers=(("content-type", "text/plain"),)),
    ]
    prefix = b'{"model": "chat-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
    for literal in (b"0", b"-1", b"-9223372036854775808", b"9223372036854775808", b"18446744073709551617",
                    b"1" + b"0" * 30, b"1.5", b"1e400", b'"10"', b"true", b"[]", b"{}"):
        cases.append(Case(f"max_tokens {literal[:12]!r}", CHAT, prefix + literal + b"}"))
    # Valid forms: 2xx allowed (the engine may still refuse an enormous one, as JSON 4xx).
    for literal in (b"null", b"9223372036854775807"):
        cases.append(Case(f"max_tokens {literal!r}", CHAT, prefix + literal + b"}", valid=True))
    for path in ("/v1/chat/completions?x=1", "/v1/completions/", "/V1/CHAT/COMPLETIONS", "/v1/chat//completions"):
        cases.append(Case(f"path {path}", path, b"{"))
    return cases


def mutations(seed: int, count: int) -> Iterator[Case]:
    """Seeded random damage to valid requests: byte flips, cuts, splices, type swaps of one field."""
    rng = random.Random(seed)
    odd_values: list[object] = [None, True, -1, 0, 2**62, 1.5, "", "x" * 1000, [], {}, [[]], {"a": {"b": []}},
                                "\u202e", "\x00", "chat-model", ["chat-model"]]
    for index in range(count):
        base = {"model": rng.choice(MODELS), "max_tokens": rng.randint(1, 8), "stream": rng.random() < 0.3}
        path = rng.choice((CHAT, COMPLETIONS))
        if path == CHAT:
            base["messages"] = [{"role": "user", "content": "say something " * rng.randint(1, 20)}]
        else:
            base["prompt"] = "x = " * rng.randint(1, 20)
        kind = rng.randrange(5)
        if kind == 0:
            key = rng.choice([*base, "user", "stream_options", "n", "tools"])
            base[key] = rng.choice(odd_values)
            yield Case(f"mutation {index}: {key} swapped", path, orjson.dumps(base))
            continue
        raw = bytearray(orjson.dumps(base))
        if kind == 1:
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
        elif kind == 2:
            raw = raw[: rng.randrange(len(raw))]
        elif kind == 3:
            at = rng.randrange(len(raw))
            raw[at:at] = rng.choice([b"{", b"[", b'"', b"\\", b"\xff", b"\x00", b",", b"1e999", b'"\\u0000"'])
        else:
            raw = bytearray(rng.randbytes(rng.randint(0, 400)))
        yield Case(f"mutation {index}: bytes", path, bytes(raw))


def is_json_error(response: httpx.Response) -> bool:
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and bool(body["error"].get("message"))


def request_is_valid(case: Case) -> bool:
    """Whether a 2xx may answer: the hand-written verdict, or for mutations a body any OpenAI server accepts."""
    if case.valid:
        return True
    try:
        data = orjson.loads(case.body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(data, dict) and data.get("model") in MODELS


def send(client: httpx.Client, base: str, case: Case) -> tuple[Case, int, bool, str]:
    headers = {"content-type": "application/json", **dict(case.headers)}
    try:
        response = client.post(base + case.path, content=case.body, headers=headers)
    except httpx.HTTPError as exc:
        return case, 0, False, repr(exc)
    ok = (200 <= response.status_code < 300 and request_is_valid(case)) or (
        400 <= response.status_code < 600 and is_json_error(response))
    return case, response.status_code, ok, response.text[:160]


def slow_body(chunks: list[bytes], pause_s: float) -> Iterator[bytes]:
    for chunk in chunks:
        time.sleep(pause_s)
        yield chunk


def test_http_fuzz_through_envoy(stack: RunningStack) -> None:
    base = stack.base_url.removesuffix("/v1")
    before = stack.children()
    cases = [*handwritten(), *mutations(SEED, MUTATIONS)]
    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda case: send(client, base, case), cases))
        # Slow bodies: a valid one trickled in, and one abandoned half way (no answer expected, no crash).
        body = chat()
        slow = client.post(f"{base}{CHAT}", content=slow_body([body[:10], body[10:30], body[30:]], 0.4),
                           headers={"content-type": "application/json"})
        results.append((Case("slow valid body", CHAT, body, valid=True), slow.status_code,
                        slow.status_code == 200, slow.text[:160]))
        slow_bad = client.post(f"{base}{CHAT}", content=slow_body([b'{"model": ', b'"chat-model", "mess'], 0.4),
                               headers={"content-type": "application/json"})
        results.append((Case("slow truncated body", CHAT, b""), slow_bad.status_code,
                        400 <= slow_bad.status_code < 600 and is_json_error(slow_bad), slow_bad.text[:160]))
        bad = [(case.name, status, text) for case, status, ok, text in results if not ok]
        statuses: dict[int, int] = {}
        for _, status, _, _ in results:
            statuses[status] = statuses.get(status, 0) + 1
        after = stack.children()
        healthy = [client.post(f"{base}{CHAT}", content=chat(), headers={"content-type": "application/json"})
                   .status_code for _ in range(20)]
    restarted = sorted(name for name in before if before[name] != after.get(name))
    print(f"\nFUZZ: {len(results)} inputs sent, statuses {dict(sorted(statuses.items()))}, {len(bad)} bad answers, "
          f"restarted processes {restarted}, normal traffic after: {healthy.count(200)}/20 ok")
    assert not restarted, f"crashed (restarted by up): {restarted}"
    assert stack.process.poll() is None
    assert healthy == [200] * 20
    assert not bad, bad[:10]
