"""Per-second quota buckets on a real Redis, driven by an injected clock: no 60 s window ever gets more than
the tokens-per-minute limit, however bursty the arrivals, and a refusal's Retry-After is when it fits."""

from __future__ import annotations

import random
from typing import Any

import pytest

from extproc.errors import ApiError
from extproc.quota import WINDOW_S, QuotaStore, QuotaTicket
from extproc.tenancy import Tenant
from poolgate.kernel.keys import QuotaKeys
from tests.manual_clock import ManualClock

KEYS = QuotaKeys("quota-test")
LIMIT = 100_000


def metered(tokens_per_minute: int = LIMIT, requests_per_minute: int | None = None) -> Tenant:
    return Tenant("acme", priority=1, priority_class="standard", tokens_per_minute=tokens_per_minute,
                  requests_per_minute=requests_per_minute)


def bursty_arrivals(seed: int, duration_s: float) -> list[tuple[float, int]]:
    """About 3× the limit on average: quiet background plus bursts of up to 60 requests within 0.2 s."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, int]] = []
    t = 1_000.0
    while t < 1_000.0 + duration_s:
        t += rng.expovariate(2.0)
        arrivals.append((t, rng.randint(200, 1500)))
        if rng.random() < 0.1:
            arrivals += [(t + rng.uniform(0, 0.2), rng.randint(500, 3000)) for _ in range(rng.randint(20, 60))]
    return sorted(arrivals)


def busiest_window(admitted: list[tuple[float, int]], span_s: float = WINDOW_S) -> int:
    """Largest sum of tokens admitted within any closed interval of ``span_s`` seconds."""
    best = total = left = 0
    for right in range(len(admitted)):
        total += admitted[right][1]
        while admitted[right][0] - admitted[left][0] > span_s:
            total -= admitted[left][1]
            left += 1
        best = max(best, total)
    return best


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_no_minute_gets_more_than_the_limit_under_bursts(redis_client: Any, seed: int) -> None:
    clock = ManualClock(1_000.0)
    store = QuotaStore(redis_client, KEYS, lease_s=900, clock=clock)
    tenant = metered()
    duration_s = 240.0
    admitted: list[tuple[float, int]] = []
    offered = 0
    for at, tokens in bursty_arrivals(seed, duration_s):
        clock.now = at
        offered += tokens
        outcome = await store.admit(tenant, tokens)
        if isinstance(outcome, QuotaTicket):
            admitted.append((at, tokens))
        else:
            assert outcome.param == "tokens_per_minute" and 1 <= (outcome.retry_after_s or 0) <= WINDOW_S
    assert offered > 2.5 * LIMIT * duration_s / WINDOW_S  # the tenant really asks for more than its share
    overshoot = busiest_window(admitted) / LIMIT - 1
    assert overshoot <= 0.05  # by construction 0: any 60 s lies inside the 61 buckets an admission counts
    # ... and the limit is used: at most one bucket in 61 (plus the last request's rounding) is left idle.
    used = sum(tokens for _, tokens in admitted) / (LIMIT * duration_s / WINDOW_S)
    assert used >= 0.85


async def test_retry_after_is_when_the_oldest_bucket_leaves_the_window(redis_client: Any) -> None:
    clock = ManualClock(1_000.5)
    store = QuotaStore(redis_client, KEYS, lease_s=900, clock=clock)
    tenant = metered(tokens_per_minute=1_000)
    assert isinstance(await store.admit(tenant, 600), QuotaTicket)
    clock.now = 1_010.2
    assert isinstance(await store.admit(tenant, 300), QuotaTicket)
    refused = await store.admit(tenant, 300)
    assert isinstance(refused, ApiError) and refused.retry_after_s == 51  # bucket 1000 leaves at 1061
    clock.now = 1_060.9
    assert isinstance(await store.admit(tenant, 300), ApiError)
    clock.now = 1_061.0
    assert isinstance(await store.admit(tenant, 300), QuotaTicket)
    assert await redis_client.hkeys(KEYS.token_buckets("acme")) == [b"1010", b"1061"]  # 1000 was pruned


async def test_release_corrects_the_bucket_and_the_minute_counter(redis_client: Any) -> None:
    clock = ManualClock(1_200.3)
    store = QuotaStore(redis_client, KEYS, lease_s=900, clock=clock)
    tenant = metered(tokens_per_minute=1_000)
    ticket = await store.admit(tenant, 800)
    assert isinstance(ticket, QuotaTicket) and ticket.second == 1_200
    await store.release(ticket, used_tokens=150)
    assert int(await redis_client.hget(KEYS.token_buckets("acme"), "1200")) == 150
    assert int(await redis_client.get(KEYS.tokens("acme", 1_200 // WINDOW_S))) == 150
    clock.now = 1_201.0
    assert isinstance(await store.admit(tenant, 850), QuotaTicket)  # the reserve was given back at once


async def test_requests_per_minute_use_buckets_too(redis_client: Any) -> None:
    clock = ManualClock(2_000.0)
    store = QuotaStore(redis_client, KEYS, lease_s=900, clock=clock)
    tenant = metered(tokens_per_minute=10**9, requests_per_minute=3)
    for at in (2_000.0, 2_030.0, 2_059.9):
        clock.now = at
        assert isinstance(await store.admit(tenant, 1), QuotaTicket)
    clock.now = 2_060.5
    refused = await store.admit(tenant, 1)
    assert isinstance(refused, ApiError) and refused.param == "requests_per_minute"
    assert refused.retry_after_s == 1  # bucket 2000 leaves at 2061
