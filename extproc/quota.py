"""Per-tenant quotas shared by every extproc process: concurrency, requests and tokens per minute, in Redis.

One scripted call per request admits it (or names the limit it would break), and one at its end releases
it, so several extproc processes enforce one limit without a lock held across awaits. The keys of one
tenant share the hash tag ``{tenant:NAME}`` and so one Redis Cluster slot, as a multi-key script needs:

- ``{prefix}:quota:{tenant:NAME}:concurrent`` sorted set, member = request ticket, score = lease end. A
  process that dies without releasing stops counting when the lease (``tenancy.lease_s``) ends.
- ``{prefix}:quota:{tenant:NAME}:rpm:{minute}`` / ``…:tpm:{minute}`` counters of one fixed minute each.
  The rate over the last sixty seconds is estimated as ``previous × (1 − f) + current``, f being how far
  into the current minute we are (the sliding-window counter): no burst at a minute boundary gets 2× the
  limit, as a plain fixed window would allow, and it costs two GETs instead of a log of every request.

Tokens per minute are reserved at admission (prompt estimate + expected output) and corrected at the end
by the difference to the usage the response reported (``release`` with ``used_tokens``), in the counter
of the minute the request was admitted in.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from extproc import errors
from extproc.errors import ApiError
from extproc.tenancy import Tenant

WINDOW_S = 60
WINDOW_TTL_MS = 3 * WINDOW_S * 1000
"""A minute's counter is read as "previous" during the next minute and corrected by late releases after."""

LIMIT_NAMES = {1: "max_concurrent", 2: "requests_per_minute", 3: "tokens_per_minute"}

_ADMIT = """
local now = tonumber(ARGV[1])
local max_conc = tonumber(ARGV[4])
local rpm = tonumber(ARGV[5])
local tpm = tonumber(ARGV[6])
local tokens = tonumber(ARGV[7])
local frac = tonumber(ARGV[8])
local ttl = tonumber(ARGV[9])
local remaining = tonumber(ARGV[10])
local function wait_s(prev, cur, est, cost, limit)
  local excess = est + cost - limit
  if prev > 0 and excess <= prev * (1 - frac) then
    return math.ceil(excess / prev * 60)
  end
  local into_next = 0
  if cur > 0 then into_next = math.max(0, 1 - (limit - cost) / cur) end
  return math.ceil(remaining + into_next * 60)
end
if max_conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= max_conc then return {1, 1} end
end
if rpm > 0 then
  local cur = tonumber(redis.call('GET', KEYS[2]) or '0')
  local prev = tonumber(redis.call('GET', KEYS[3]) or '0')
  local est = prev * (1 - frac) + cur
  if est + 1 > rpm then return {2, wait_s(prev, cur, est, 1, rpm)} end
end
if tpm > 0 then
  local cur = tonumber(redis.call('GET', KEYS[4]) or '0')
  local prev = tonumber(redis.call('GET', KEYS[5]) or '0')
  local est = prev * (1 - frac) + cur
  if est + tokens > tpm then return {3, wait_s(prev, cur, est, tokens, tpm)} end
end
if max_conc > 0 then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
  redis.call('PEXPIREAT', KEYS[1], math.floor(tonumber(ARGV[3]) * 1000))
end
if rpm > 0 then
  redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ttl)
end
if tpm > 0 then
  redis.call('INCRBY', KEYS[4], tokens)
  redis.call('PEXPIRE', KEYS[4], ttl)
end
return {0, 0}
"""

_RELEASE = """
if ARGV[1] ~= '' then redis.call('ZREM', KEYS[1], ARGV[1]) end
local delta = tonumber(ARGV[2])
if delta ~= 0 and redis.call('EXISTS', KEYS[2]) == 1 then redis.call('INCRBY', KEYS[2], delta) end
return 1
"""


class QuotaKeys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def tenant(self, name: str) -> str:
        """The common part of a tenant's keys; ``{tenant:NAME}`` is the Redis Cluster hash tag."""
        return f"{self.prefix}:quota:{{tenant:{name}}}"

    def concurrent(self, name: str) -> str:
        return f"{self.tenant(name)}:concurrent"

    def requests(self, name: str, window: int) -> str:
        return f"{self.tenant(name)}:rpm:{window}"

    def tokens(self, name: str, window: int) -> str:
        return f"{self.tenant(name)}:tpm:{window}"


@dataclass(frozen=True, slots=True)
class QuotaTicket:
    """What an admitted request holds until its end."""

    tenant: str
    ticket: str
    """Member of the concurrency set; empty when the tenant has no concurrency limit."""
    window: int
    """The minute the tokens were reserved in."""
    reserved_tokens: int
    """Tokens charged at admission; 0 when the tenant has no tokens-per-minute limit."""


class QuotaStore:
    """The Redis adapter for quotas; ``admit`` and ``release`` are one script call each."""

    def __init__(self, redis: Any, keys: QuotaKeys, lease_s: float, clock: Callable[[], float] = time.time) -> None:
        self._keys = keys
        self._lease_s = lease_s
        self._clock = clock
        self._admit = redis.register_script(_ADMIT)
        self._release = redis.register_script(_RELEASE)
        self._ids = itertools.count()
        self._process = os.urandom(6).hex()

    async def admit(self, tenant: Tenant, tokens: int) -> QuotaTicket | ApiError:
        """Admit the request or answer 429 naming the limit. Redis errors propagate (the caller decides)."""
        tpm = tenant.tokens_per_minute or 0
        if tpm and tokens > tpm:
            return errors.request_over_quota(tenant.name, tokens, tpm)
        now = self._clock()
        window = int(now // WINDOW_S)
        into = now - window * WINDOW_S
        name = tenant.name
        keys = self._keys
        ticket = f"{self._process}:{next(self._ids)}" if tenant.max_concurrent else ""
        code, retry_after = await self._admit(
            keys=[keys.concurrent(name), keys.requests(name, window), keys.requests(name, window - 1),
                  keys.tokens(name, window), keys.tokens(name, window - 1)],
            args=[now, ticket, now + self._lease_s, tenant.max_concurrent or 0, tenant.requests_per_minute or 0,
                  tpm, tokens, into / WINDOW_S, WINDOW_TTL_MS, WINDOW_S - into],
        )
        if code:
            limit = LIMIT_NAMES[int(code)]
            value = int(getattr(tenant, limit) or 0)
            return errors.quota_exceeded(name, limit, value, min(WINDOW_S, max(1, int(retry_after))))
        return QuotaTicket(name, ticket, window, tokens if tpm else 0)

    async def release(self, ticket: QuotaTicket, used_tokens: int | None = None) -> None:
        """Free the concurrency slot and correct the reserved tokens to ``used_tokens`` when known."""
        delta = 0 if used_tokens is None or not ticket.reserved_tokens else used_tokens - ticket.reserved_tokens
        if not ticket.ticket and not delta:
            return
        await self._release(keys=[self._keys.concurrent(ticket.tenant), self._keys.tokens(ticket.tenant,
                                                                                            ticket.window)],
                            args=[ticket.ticket, delta])

