"""Per-tenant quotas shared by every extproc process: concurrency, requests and tokens per minute, in Redis.

One scripted call per request admits it (or names the limit it would break), and one at its end releases
it, so several extproc processes enforce one limit without a lock held across awaits. The keys of one
tenant share the hash tag ``{tenant:NAME}`` and so one Redis Cluster slot, as a multi-key script needs:

- ``{prefix}:quota:{tenant:NAME}:concurrent`` sorted set, member = request ticket, score = lease end. A
  process that dies without releasing stops counting when the lease (``tenancy.lease_s``) ends.
- ``{prefix}:quota:{tenant:NAME}:rpm`` / ``…:tpm`` hashes of per-second buckets, field = whole second
  ``b``, value = requests / tokens admitted in it. An admission at time t counts the buckets
  ``⌊t⌋ − 60 … ⌊t⌋`` (61 of them) and prunes older fields:

      used(t) = Σ_{b = ⌊t⌋−60}^{⌊t⌋} bucket[b];   admit iff used(t) + cost ≤ limit

  Any 60 s interval [a, a + 60] lies inside buckets ⌊a⌋ … ⌊a⌋ + 60, all of which the check of its last
  admission counted, so the charges of any 60 s are at most the limit (no boundary burst, unlike fixed
  windows, and no estimate error, unlike the sliding-window counter's ``previous × (1 − f) + current``,
  which let a burst overshoot by a quarter). The price is at most 1/61 of the limit left unused and a sum
  of ≤ 61 fields per admission, still inside one script call. A refused request waits until enough of
  the oldest buckets leave the window: bucket b leaves at t = b + 61.
- ``{prefix}:quota:{tenant:NAME}:tpm:{minute}`` tokens charged in one calendar minute: usage accounting for
  readers (dashboards, tests), not consulted by admission.

Tokens per minute are reserved at admission (prompt estimate + expected output) and corrected at the end
by the difference to the usage the response reported (``release`` with ``used_tokens``), in the bucket
of the second it was admitted in (skipped once that bucket left the window) and in its minute's counter.

A request admitted while Redis could not be asked (fail-open) holds an ``unwritten`` ticket: its charge
waits in ``extproc.quota_backlog`` and is written later by ``write_charges``, once (see there).
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
from extproc.quota_backlog import MARKER_TTL_MS, ChargeBatch
from extproc.tenancy import Tenant
from poolgate.kernel.keys import QuotaKeys

WINDOW_S = 60
BUCKET_TTL_MS = 2 * (WINDOW_S + 1) * 1000
"""A bucket hash untouched for this long holds nothing inside the window any more."""
MINUTE_TTL_MS = 3 * WINDOW_S * 1000
"""A minute's accounting counter stays readable, and correctable by late releases, for two more minutes."""

LIMIT_NAMES = {1: "max_concurrent", 2: "requests_per_minute", 3: "tokens_per_minute"}

_ADMIT = """
local now = tonumber(ARGV[1])
local max_conc = tonumber(ARGV[4])
local rpm = tonumber(ARGV[5])
local tpm = tonumber(ARGV[6])
local tokens = tonumber(ARGV[7])
local window = tonumber(ARGV[8])
local bucket_ttl = tonumber(ARGV[9])
local minute_ttl = tonumber(ARGV[10])
local second = math.floor(now)
local oldest = second - window
local function used(key)
  local flat = redis.call('HGETALL', key)
  local total, live, stale = 0, {}, {}
  for i = 1, #flat, 2 do
    local b = tonumber(flat[i])
    if b < oldest then
      stale[#stale + 1] = flat[i]
    else
      local n = tonumber(flat[i + 1])
      total = total + n
      live[#live + 1] = {b, n}
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  return total, live
end
local function wait_s(live, total, cost, limit)
  table.sort(live, function(x, y) return x[1] < y[1] end)
  local excess = total + cost - limit
  for _, entry in ipairs(live) do
    excess = excess - entry[2]
    if excess <= 0 then return math.max(1, math.ceil(entry[1] + window + 1 - now)) end
  end
  return window + 1
end
if max_conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= max_conc then return {1, 1} end
end
if rpm > 0 then
  local total, live = used(KEYS[2])
  if total + 1 > rpm then return {2, wait_s(live, total, 1, rpm)} end
end
if tpm > 0 then
  local total, live = used(KEYS[3])
  if total + tokens > tpm then return {3, wait_s(live, total, tokens, tpm)} end
end
if max_conc > 0 then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
  redis.call('PEXPIREAT', KEYS[1], math.floor(tonumber(ARGV[3]) * 1000))
end
if rpm > 0 then
  redis.call('HINCRBY', KEYS[2], second, 1)
  redis.call('PEXPIRE', KEYS[2], bucket_ttl)
end
if tpm > 0 then
  redis.call('HINCRBY', KEYS[3], second, tokens)
  redis.call('PEXPIRE', KEYS[3], bucket_ttl)
  redis.call('INCRBY', KEYS[4], tokens)
  redis.call('PEXPIRE', KEYS[4], minute_ttl)
end
return {0, second}
"""

_RELEASE = """
if ARGV[1] ~= '' then redis.call('ZREM', KEYS[1], ARGV[1]) end
local delta = tonumber(ARGV[2])
if delta ~= 0 then
  if redis.call('HEXISTS', KEYS[2], ARGV[3]) == 1 then redis.call('HINCRBY', KEYS[2], ARGV[3], delta) end
  if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('INCRBY', KEYS[3], delta) end
end
return 1
"""


_CHARGE = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then return 0 end
local oldest = math.floor(tonumber(ARGV[2])) - tonumber(ARGV[3])
local bucket_ttl = tonumber(ARGV[4])
local minute_ttl = tonumber(ARGV[5])
for i = 6, #ARGV, 4 do
  local second = tonumber(ARGV[i])
  local requests = tonumber(ARGV[i + 1])
  local tokens = tonumber(ARGV[i + 2])
  if second >= oldest then
    if requests ~= 0 then
      redis.call('HINCRBY', KEYS[2], second, requests)
      redis.call('PEXPIRE', KEYS[2], bucket_ttl)
    end
    if tokens ~= 0 then
      redis.call('HINCRBY', KEYS[3], second, tokens)
      redis.call('PEXPIRE', KEYS[3], bucket_ttl)
    end
  end
  if tokens ~= 0 then
    local minute = KEYS[3 + tonumber(ARGV[i + 3])]
    redis.call('INCRBY', minute, tokens)
    if redis.call('PTTL', minute) < 0 then redis.call('PEXPIRE', minute, minute_ttl) end
  end
end
return 1
"""


@dataclass(frozen=True, slots=True)
class QuotaTicket:
    """What an admitted request holds until its end."""

    tenant: str
    ticket: str
    """Member of the concurrency set; empty when the tenant has no concurrency limit."""
    second: int
    """The whole second (bucket) the tokens were reserved in."""
    reserved_tokens: int
    """Tokens charged at admission; 0 when the tenant has no tokens-per-minute limit."""
    unwritten: bool = False
    """Admitted while Redis could not be asked: its charge waits in the backlog, and so does its correction."""

    def correction(self, used_tokens: int | None) -> int:
        """Tokens to add to the charge once the request used ``used_tokens`` (None: unknown, keep the estimate)."""
        return 0 if used_tokens is None or not self.reserved_tokens else used_tokens - self.reserved_tokens


class QuotaStore:
    """The Redis adapter for quotas; ``admit`` and ``release`` are one script call each."""

    def __init__(self, redis: Any, keys: QuotaKeys, lease_s: float, clock: Callable[[], float] = time.time) -> None:
        self._keys = keys
        self._lease_s = lease_s
        self._clock = clock
        self._admit = redis.register_script(_ADMIT)
        self._release = redis.register_script(_RELEASE)
        self._charge = redis.register_script(_CHARGE)
        self._ids = itertools.count()
        self._process = os.urandom(6).hex()

    async def admit(self, tenant: Tenant, tokens: int) -> QuotaTicket | ApiError:
        """Admit the request or answer 429 naming the limit. Redis errors propagate (the caller decides)."""
        tpm = tenant.tokens_per_minute or 0
        if tpm and tokens > tpm:
            return errors.request_over_quota(tenant.name, tokens, tpm)
        now = self._clock()
        second = int(now // 1)
        name = tenant.name
        keys = self._keys
        ticket = f"{self._process}:{next(self._ids)}" if tenant.max_concurrent else ""
        code, value = await self._admit(
            keys=[keys.concurrent(name), keys.request_buckets(name), keys.token_buckets(name),
                  keys.tokens(name, second // WINDOW_S)],
            args=[now, ticket, now + self._lease_s, tenant.max_concurrent or 0, tenant.requests_per_minute or 0,
                  tpm, tokens, WINDOW_S, BUCKET_TTL_MS, MINUTE_TTL_MS],
        )
        if code:
            limit = LIMIT_NAMES[int(code)]
            limit_value = int(getattr(tenant, limit) or 0)
            return errors.quota_exceeded(name, limit, limit_value, min(WINDOW_S, max(1, int(value))))
        return QuotaTicket(name, ticket, int(value), tokens if tpm else 0)

    async def release(self, ticket: QuotaTicket, used_tokens: int | None = None) -> None:
        """Free the concurrency slot and correct the reserved tokens to ``used_tokens`` when known."""
        delta = ticket.correction(used_tokens)
        if not ticket.ticket and not delta:
            return
        keys = self._keys
        await self._release(keys=[keys.concurrent(ticket.tenant), keys.token_buckets(ticket.tenant),
                                  keys.tokens(ticket.tenant, ticket.second // WINDOW_S)],
                            args=[ticket.ticket, delta, ticket.second])

    def unwritten_ticket(self, tenant: Tenant, tokens: int) -> QuotaTicket:
        """The ticket of a request admitted without asking Redis (no concurrency slot; its charge is kept)."""
        return QuotaTicket(tenant.name, "", int(self._clock() // 1), tokens if tenant.tokens_per_minute else 0,
                           unwritten=True)

    async def write_charges(self, batch: ChargeBatch) -> bool:
        """Charge a batch kept while Redis was away: buckets still inside the window and minute counters.
        False when a call with this batch's id had already written it (its reply was lost). Redis errors
        propagate (the batch is sent again later)."""
        keys = self._keys
        minutes = sorted({c.second // WINDOW_S for c in batch.charges})
        args: list[int | float] = [MARKER_TTL_MS, self._clock(), WINDOW_S, BUCKET_TTL_MS, MINUTE_TTL_MS]
        for charge in batch.charges:
            args += [charge.second, charge.requests, charge.tokens, minutes.index(charge.second // WINDOW_S) + 1]
        written = await self._charge(keys=[keys.charged(batch.tenant, batch.id), keys.request_buckets(batch.tenant),
                                           keys.token_buckets(batch.tenant),
                                           *(keys.tokens(batch.tenant, m) for m in minutes)],
                                     args=args)
        return bool(written)
