"""The fleet's Lua scripts: each write and its change record happen in one atomic step in Redis.

A change that readers must see bumps the fleet version (``INCR``) and sets the worker's score in a change
log (a sorted set: worker id → version of its last change) in the same script, so a reader that asks
"what changed since version v" can never miss one (``FleetView``). The ``changed`` log holds membership,
identity and state (what Envoy's endpoints depend on), the ``live`` log the facts the agent and heartbeats
report (KV, queue): the xDS bridge follows the first only. The ``epoch`` (Redis's clock when the version
was first written) tells a reader that Redis lost its data and it must read everything again.

Key names are built inside the scripts from the fleet tag (``ARGV[1]``, ``{poolgate}``), as
``poolgate.kernel.keys`` spells them: all share that Cluster hash tag and so one slot. ``KEYS[1]`` is one
key of that slot, which only routes the call to its master on Cluster.
"""

from __future__ import annotations

EXPIRY_HOLD_MS = 30_000
"""A worker's record outlives its heartbeat deadline by this long, for the mass-expiry guard (``POLL``): readers
expire an overdue worker themselves, at its deadline, unless too many are overdue at once; then it stays until
its heartbeats come back or this runs out."""
MASS_EXPIRY_SHARE = 0.1
"""More than this share of the fleet overdue at once (and more than ``MASS_EXPIRY_FLOOR`` workers) is the
registry's trouble, not the workers': the API stalled, or the agents lost their way to it."""
MASS_EXPIRY_FLOOR = 10
REGISTRY_ALIVE_S = 0.25
"""Each registry API process says it serves this often (``REGISTRY_SERVES``). A worker whose heartbeat deadline
passed while no registry said so is held, not expired: the registry that should have taken its heartbeat was
away (restarting, failing over, stalled), and expiring the fleet would bring it back as a storm of
re-registrations. Deadlines spread over a whole (stretched) interval, so a stalled registry's workers go overdue
a few at a time, never "at once" in a poll as the mass-expiry guard counts them."""
REGISTRY_QUIET_MS = 1000
"""No registry API process said it serves for this long: the registry was away, and when it is back its workers
get one TTL to find it again before an overdue one is expired."""

_COMMON = (f"local HOLD_MS = {EXPIRY_HOLD_MS}\nlocal MASS_SHARE = {MASS_EXPIRY_SHARE}\n"
           f"local MASS_FLOOR = {MASS_EXPIRY_FLOOR}\n") + """
local P = ARGV[1]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function bump(id, log)
  if redis.call('EXISTS', P .. ':fleet:epoch') == 0 then
    redis.call('SET', P .. ':fleet:epoch', tostring(now_ms()))
  end
  local v = redis.call('INCR', P .. ':fleet:version')
  redis.call('ZADD', P .. ':fleet:' .. log, v, id)
  return v
end
"""

REGISTRY_SERVES = _COMMON + f"local QUIET_MS = {REGISTRY_QUIET_MS}" + """
local now = now_ms()
local last = tonumber(redis.call('GET', P .. ':fleet:registry_at') or '0')
if now - last > QUIET_MS then  -- back after a silence: its workers have until then to find it again
  redis.call('SET', P .. ':fleet:registry_settled_at', now + tonumber(ARGV[2]))
end
redis.call('SET', P .. ':fleet:registry_at', now)
return 1
"""
"""ARGV: fleet tag, the longest TTL the registry hands (ms). A registry API process serves
(``REGISTRY_ALIVE_S``); when none had said so for ``REGISTRY_QUIET_MS``, the workers get one TTL from now to
reach it again before their silence counts as theirs. Said on Redis's clock, which the deadlines use too."""

REGISTER = _COMMON + """
local id, ttl, quiet = ARGV[2], tonumber(ARGV[3]), ARGV[4] == 'q'
local key = P .. ':worker:' .. id
redis.call('DEL', key)
redis.call('HSET', key, unpack(ARGV, 5))
redis.call('PEXPIRE', key, ttl + HOLD_MS)
redis.call('SADD', P .. ':workers', id)
redis.call('ZADD', P .. ':fleet:deadlines', now_ms() + ttl, id)
local v = bump(id, 'changed')
if not quiet then redis.call('PUBLISH', P .. ':events', 'register ' .. id .. ' ' .. v) end
return v
"""
"""KEYS: one key of the fleet slot (routes the call on Cluster). ARGV: the fleet tag, id, ttl ms, announce
(1, or q: publish nothing, the caller announces a batch), field/value pairs of the full record."""

_WRITE_FACTS_FN = """
local function scan_facts(key, first, last, state_changed, live)
  for i = first, last, 2 do
    if ARGV[i] == 'state' then
      state_changed = redis.call('HGET', key, 'state') ~= ARGV[i + 1]
    elseif ARGV[i] ~= 'updated_at' then
      live = true
    end
  end
  return state_changed, live
end

local function write_facts(id, ttl, announce, quiet, first, last, common_first, common_last, deadlines)
  local key = P .. ':worker:' .. id
  if ttl > 0 then
    if redis.call('PEXPIRE', key, ttl + HOLD_MS) == 0 then return 0 end  -- 0: no such key (one call, not EXISTS too)
    deadlines[#deadlines + 1] = id
  elseif redis.call('EXISTS', key) == 0 then
    return 0
  end
  local state_changed, live = scan_facts(key, common_first, common_last, false, false)
  state_changed, live = scan_facts(key, first, last, state_changed, live)
  if common_last >= common_first then redis.call('HSET', key, unpack(ARGV, common_first, common_last)) end
  if last >= first then redis.call('HSET', key, unpack(ARGV, first, last)) end
  if state_changed then
    local v = bump(id, 'changed')
    if not quiet then redis.call('PUBLISH', P .. ':events', 'update ' .. id .. ' ' .. v) end
    return 2
  end
  if live then
    local v = bump(id, 'live')
    if announce then redis.call('PUBLISH', P .. ':events', 'update ' .. id .. ' ' .. v) end
  end
  return 1
end

local function set_deadlines(deadlines, ttl)
  if #deadlines == 0 then return end
  local at, args = now_ms() + ttl, {}
  for j, id in ipairs(deadlines) do
    args[2 * j - 1], args[2 * j] = at, id
  end
  redis.call('ZADD', P .. ':fleet:deadlines', unpack(args))
end
"""

WRITE_FACTS = _COMMON + _WRITE_FACTS_FN + """
local deadlines = {}
local answer = write_facts(ARGV[2], tonumber(ARGV[3]), ARGV[4] == '1', ARGV[4] == 'q', 5, #ARGV, 1, 0, deadlines)
set_deadlines(deadlines, tonumber(ARGV[3]))
return answer
"""
"""ARGV: fleet tag, id, ttl ms (0: leave the TTL alone), announce (1, 0, or q: publish nothing, the caller
announces a batch), field/value pairs. Returns 0 when the
worker is not registered, 2 when its state changed (announced), else 1. A state change is announced and
goes to the ``changed`` log; other facts go to the ``live`` log, announced only when asked; a heartbeat
that carries nothing but its time writes no change at all."""

WRITE_FACTS_MANY = _COMMON + _WRITE_FACTS_FN + """
local ttl, announce, quiet = tonumber(ARGV[2]), ARGV[3] == '1', ARGV[3] == 'q'
local common_last = 4 + tonumber(ARGV[4])
local answers, deadlines, i = {}, {}, common_last + 1
while i <= #ARGV do
  local n = tonumber(ARGV[i + 1])
  answers[#answers + 1] = write_facts(ARGV[i], ttl, announce, quiet, i + 2, i + 1 + n, 5, common_last, deadlines)
  i = i + 2 + n
end
set_deadlines(deadlines, ttl)  -- one ZADD and one clock read for the call, not one per worker
return answers
"""
"""``WRITE_FACTS`` for many workers in one call (a batch of heartbeats or a round's states: one command, not
one per worker). ARGV: fleet tag, ttl ms, announce, the count of field/value items every worker gets and
those items (a heartbeat's time: sent once, not once per worker), then per worker its id, the count of its
own items and those items (written after the common ones). Returns ``WRITE_FACTS``'s answer per worker, in
order."""

DEREGISTER = _COMMON + """
local id = ARGV[2]
redis.call('DEL', P .. ':worker:' .. id, P .. ':passive:' .. id)
redis.call('HDEL', P .. ':inflight', id)
redis.call('SREM', P .. ':workers', id)
redis.call('ZREM', P .. ':fleet:deadlines', id)
local v = bump(id, 'changed')
redis.call('PUBLISH', P .. ':events', 'deregister ' .. id .. ' ' .. v)
return v
"""

_EXPIRE_DUE_FN = """
local function expire_due(now)
  local members = redis.call('SCARD', P .. ':workers')
  local overdue = redis.call('ZCOUNT', P .. ':fleet:deadlines', '-inf', now)
  local registry_at = tonumber(redis.call('GET', P .. ':fleet:registry_at') or '0')
  local settled_at = tonumber(redis.call('GET', P .. ':fleet:registry_settled_at') or '0')
  local mass = overdue > MASS_FLOOR and overdue > MASS_SHARE * members
  local held = 0
  local due = redis.call('ZRANGEBYSCORE', P .. ':fleet:deadlines', '-inf', now, 'WITHSCORES', 'LIMIT', 0, 1000)
  for i = 1, #due, 2 do
    local id, deadline = due[i], tonumber(due[i + 1])
    local key = P .. ':worker:' .. id
    local pttl = redis.call('PTTL', key)
    -- the registry served at the deadline and had been back long enough for the worker to find it (or no
    -- registry says so: the registrant is the controller itself), and few are overdue at once: the worker,
    -- not its registry, went quiet
    local worker_silent = not mass and (registry_at == 0 or (registry_at >= deadline and settled_at <= deadline))
    if pttl == -1 then
      redis.call('ZREM', P .. ':fleet:deadlines', id)
    elseif pttl ~= -2 and not worker_silent then
      held = held + 1
    else  -- its record ran out, or it went quiet alone: it leaves
      redis.call('DEL', key)
      redis.call('ZREM', P .. ':fleet:deadlines', id)
      redis.call('SREM', P .. ':workers', id)
      redis.call('HDEL', P .. ':inflight', id)
      local v = bump(id, 'changed')
      redis.call('PUBLISH', P .. ':events', 'expire ' .. id .. ' ' .. v)
    end
  end
  if mass then held = overdue end
  return held
end
"""

EXPIRE_DUE = _COMMON + _EXPIRE_DUE_FN + """
return expire_due(now_ms())
"""
"""ARGV: fleet tag. Expires the workers whose heartbeat deadline passed, as ``POLL`` does first; returns how many
overdue workers the mass-expiry guard held."""

POLL = _COMMON + _EXPIRE_DUE_FN + """
local since, with_live, limit, read_up_to = tonumber(ARGV[2]), ARGV[3] == '1', tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
local held = expire_due(now)
local members = redis.call('SCARD', P .. ':workers')
local floor = tonumber(redis.call('GET', P .. ':fleet:floor') or '0')
for _, log in ipairs({'changed', 'live'}) do
  local excess = redis.call('ZCARD', P .. ':fleet:' .. log) - 2 * members - 1024
  if excess > 0 then
    local oldest = redis.call('ZRANGE', P .. ':fleet:' .. log, excess - 1, excess - 1, 'WITHSCORES')
    redis.call('ZREMRANGEBYRANK', P .. ':fleet:' .. log, 0, excess - 1)
    if tonumber(oldest[2]) > floor then
      floor = tonumber(oldest[2])
      redis.call('SET', P .. ':fleet:floor', floor)
    end
  end
end
local epoch = redis.call('GET', P .. ':fleet:epoch') or ''
local version = tonumber(redis.call('GET', P .. ':fleet:version') or '0')
if since < floor or since > version then return {epoch, version, floor, false, false, false, held} end
local changed = redis.call('ZRANGEBYSCORE', P .. ':fleet:changed', '(' .. since, '+inf', 'LIMIT', 0, limit)
local live = {}
if with_live then
  live = redis.call('ZRANGEBYSCORE', P .. ':fleet:live', '(' .. since, '+inf', 'LIMIT', 0, limit)
end
local records = false
if #changed + #live <= read_up_to then
  local read = {}
  records = {}
  for _, ids in ipairs({changed, live}) do
    for _, id in ipairs(ids) do
      if not read[id] then  -- a worker in both logs is read once
        read[id] = true
        records[#records + 1] = id
        records[#records + 1] = redis.call('HGETALL', P .. ':worker:' .. id)
      end
    end
  end
end
return {epoch, version, floor, changed, live, records, held}
"""
"""ARGV: fleet tag, the reader's version, 1 to include the live log, the most ids to return per log.

First expires the workers whose heartbeat deadline passed (the first reader to look writes the change for
everyone), unless more than ``MASS_EXPIRY_SHARE`` of the fleet is overdue at once, or no registry API process
has said it serves since the worker's deadline (``REGISTRY_ALIVE_S``): then only those whose record ran out
(``EXPIRY_HOLD_MS`` later) leave, and the rest stay until their heartbeats come back. Then trims the
logs to about twice the fleet (readers older than the trimmed part read everything again), and answers epoch,
version, floor and the ids changed since ``since`` (false instead of the ids when ``since`` is below the floor
or above the version: read everything), when they are ``read_up_to`` (ARGV[5]) or fewer each id followed by its
record's fields (empty: gone), and how many overdue workers the guard held (0: none)."""

ADD_INFLIGHT = """
for i = 1, #ARGV, 2 do
  if redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) <= 0 then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
"""
"""KEYS: the in-flight hash. ARGV: worker id, delta pairs. A count that falls to zero (or below: an increment
lost with a Redis restart) leaves the hash, so it holds only the workers with requests in flight."""
