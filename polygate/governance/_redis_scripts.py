"""The Lua scripts of the Redis governance backend, one per backend operation.

Each script is the whole read-check-update of one :class:`GovernanceBackend` method, so
Redis runs it atomically: no other client's command can land between a check and its
update.  They port :mod:`._memory` line by line; where the two could disagree the memory
backend is the reference and the contract suite (``tests/test_backend_contract.py``)
runs both against the same tests.

Time is the server's: every script starts with ``TIME`` (microseconds, integers, exact
in a Lua double and a sorted-set score) and never trusts a client clock, so hosts with
skewed clocks agree on windows, cooldowns and leases.  Scripts return the server's
``now`` so the client can turn server instants into its own trio clock.

Per-source keys (``KEYS`` in this order; ``P`` is the configured prefix)::

    1 P:{scope}:{source}:state    hash   breaker, cooldown, totals      TTL key_ttl (>= cooldown, open breaker)
    2 P:{scope}:{source}:window   zset   member -> admission time (us)  TTL window + 1 s
    3 P:{scope}:{source}:wtok     hash   member -> tokens, '=sum'       TTL window + 1 s
    4 P:{scope}:{source}:open     hash   member -> reserved estimate    TTL key_ttl
    5 P:{scope}:{source}:permits  zset   member -> lease expiry (us)    TTL key_ttl
    6 P:changes                   string change counter (waiters poll)  TTL key_ttl

A *member* is ``<backend token>:<reservation id>``: unique per backend instance, so a
Redis restart (which forgets everything) can never make an old admission settle a new
one.  State-hash fields: ``br`` breaker (``c``/``o``/``h``), ``cf`` consecutive
failures, ``oa`` opened at, ``pr`` the half-open probe's member, ``pn`` the breaker's
openings so far (a half-open period's number), ``lp`` that period's probes whose
leases lapsed, ``<pn>|m1|m2|`` (a late settle of one is still that period's probe's
verdict), ``oc`` recent outcomes
(``1`` = failure, newest last), ``cu`` cooldown until, ``du`` dead until (at most
``cu``; its own instant, so that a longer cooldown settled while the source is dead
does not make the dead mark longer), ``dd`` and ``cw`` for older versions on the same
Redis (a rolling upgrade): they mark a dead source with ``dd = 1``, dead until ``cu``,
so ``dd`` is kept as they read it (``1`` while ``du`` is ahead), and ``cw`` is the
``cu`` this version wrote last; a ``cu`` that is not ``cw`` beside ``dd = 1`` was an
older version's dead mark, dead until ``cu``), ``ot`` tokens held
by open reservations, ``rt``/``st``/``rl``/``ct``/``ad`` reserved, settled, released,
cost and admission totals, ``lx`` leases that expired, ``lt`` the last ``TIME`` a
script saw (a later one before it is the server's clock stepped back: every stored
instant moves back by the step).

Leases: an admission's permit is a member of ``permits`` scored with its lease expiry.
Every script first *purges* expired leases: a permit whose owner stopped renewing it
(the process crashed, or lost Redis for longer than the lease) is returned, and its
reservation is settled as the memory backend settles a cancelled attempt — it keeps its
estimate in the window.  The owner renews its live leases with :data:`RENEW`.
"""

from __future__ import annotations

from ._memory import WHOLE_TOKEN

__all__ = ["ADMIT", "BUDGET_LEVEL", "BUDGET_REFILL", "BUDGET_TAKE", "PROBE", "RENEW", "SETTLE", "SNAPSHOT"]

# Shared helpers, prepended to every per-source script.  ``unpack`` is limited by Lua's
# C stack (~8000 values), so bulk removals go in chunks.
_PRELUDE = r"""
local K_STATE, K_WINDOW, K_WTOK, K_OPEN, K_PERMITS, K_CHANGES, K_LAPSED =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Numbers go to Redis as '%.17g': never negate with unary minus, -0 is not an integer.
local function chunked(cmd, key, items)
  local i = 1
  while i <= #items do
    local j = math.min(i + 999, #items)
    redis.call(cmd, key, unpack(items, i, j))
    i = j + 1
  end
end

local function version()
  return redis.call('GET', K_CHANGES) or '0'
end

-- Whether ``key`` holds data of another type than ``kind`` (another tool's, a hand's).
local function foreign(key, kind)
  local t = redis.call('TYPE', key)['ok']
  return t ~= 'none' and t ~= kind
end

-- An instant in a reply: Redis casts a script's numbers to 64-bit integers, so one
-- past ~9.2e18 us (an open_s or a cooldown of 1e13 s) would come back negative, read
-- as "unknown".  4e18 us (~126,000 years from 1970) is "never" for every purpose.
local function inst(x)
  return math.min(x, 4e18)
end

-- Until when the source is dead, from the state's cu, dd, du and cw fields: du, or
-- cu where an older version marked it dead (dd = 1, and cu not the one written here).
local function dead_until(cu, dd, du, cw)
  local x = tonumber(du) or 0
  if dd == '1' and tonumber(cw) ~= tonumber(cu) then x = math.max(x, tonumber(cu) or 0) end
  return x
end

local function bump(ttl_ms)
  redis.call('INCR', K_CHANGES)
  redis.call('PEXPIRE', K_CHANGES, ttl_ms)
end

-- The state key lost (evicted, deleted) while reservations were open: what they hold
-- goes back into its totals, once, so that settling them (before or after others are
-- admitted) keeps reserved = settled + released + open, and ot never below 0.  Every
-- admission writes rt, so a state without it has lost its totals.
local function reseed()
  if redis.call('HEXISTS', K_STATE, 'rt') == 1 then return end
  local held = redis.call('HVALS', K_OPEN)
  if #held == 0 then return end
  local sum = 0
  for _, v in ipairs(held) do sum = sum + (tonumber(v) or 0) end
  redis.call('HINCRBY', K_STATE, 'rt', sum)
  redis.call('HINCRBY', K_STATE, 'ot', sum)
end

-- A reservation whose permit is gone settles as a cancelled attempt does: it keeps
-- its estimate in the window.  Its member goes into 'lapsed' (by when it lapsed), so
-- that the holder's own settle, if it comes after all (a paused process, one cut off
-- from Redis for longer than its lease), can still say what the upstream answered,
-- once (see SETTLE).  Kept for key_ttl: a holder that never comes back leaves no more.
local function lapse(m, probe, now, ttl_ms)
  local est = redis.call('HGET', K_OPEN, m)
  if est then
    est = tonumber(est)
    redis.call('HDEL', K_OPEN, m)
    redis.call('HINCRBY', K_STATE, 'ot', 0 - est)
    redis.call('HINCRBY', K_STATE, 'st', est)
    redis.call('HINCRBY', K_STATE, 'ct', est)
    redis.call('HINCRBY', K_STATE, 'lx', 1)
    if not foreign(K_LAPSED, 'zset') then  -- (another tool's key there: not ours to record in)
      redis.call('ZREMRANGEBYSCORE', K_LAPSED, '-inf', now - ttl_ms * 1000)
      redis.call('ZADD', K_LAPSED, now, m)
      redis.call('PEXPIRE', K_LAPSED, ttl_ms)
    end
  end
  -- A probe's late verdict is a probe's, in its own half-open period: 'lp' holds
  -- that period's number and its lapsed probes, '<pn>|m1|m2|'.  (A number, not the
  -- opening's instant: rewind() moves that when the clock steps back.)
  if probe == m then
    local head = (redis.call('HGET', K_STATE, 'pn') or '0') .. '|'
    local lp = redis.call('HGET', K_STATE, 'lp') or ''
    if string.sub(lp, 1, #head) ~= head then lp = head end
    if #lp < 4096 then lp = lp .. m .. '|' end  -- (a bound no period comes near)
    redis.call('HSET', K_STATE, 'pr', '', 'lp', lp)
  end
end

-- The server's clock stepped back (an NTP step, a VM restored, a replica promoted
-- whose clock is behind): the instants written before it are ahead of TIME, and would
-- hold a window, a cooldown, an open breaker or a dead owner's permit for as long as
-- the step (an hour's step: an rpm window full for an hour).  'lt' is the last TIME a
-- script saw; a TIME before it moves the instants written before the step back by the
-- step, so each keeps what was left of it.  (A step forward only ends them early, as
-- time passing does.)  An older version (a rolling upgrade) keeps no 'lt' and may have
-- written since the step: what it wrote is not ahead of now (a window entry), nor of
-- 'lt' (a lease shorter than the step), so it stays.  What is left in doubt stays on
-- the safe side, longer by at most the step.
local function rewind(now)
  local lt = tonumber(redis.call('HGET', K_STATE, 'lt'))
  if lt ~= nil and (lt ~= lt or lt > 4e18) then lt = nil end  -- (another tool's: none)
  if lt == nil then
    if redis.call('EXISTS', K_STATE) == 0 then return end  -- (never created here)
  elseif lt > now then
    local back = lt - now
    local function shift(key, after)
      local e = redis.call('ZRANGEBYSCORE', key, '(' .. string.format('%.17g', after), '+inf', 'WITHSCORES')
      local i = 1
      while i <= #e do
        local args = {}
        local j = math.min(i + 1999, #e)  -- (member, score pairs: i odd, j even)
        for k = i, j, 2 do
          args[#args + 1] = tonumber(e[k + 1]) - back
          args[#args + 1] = e[k]
        end
        redis.call('ZADD', key, unpack(args))
        i = j + 1
      end
    end
    shift(K_WINDOW, now)
    shift(K_PERMITS, lt)  -- (a lease before lt ran out before the step: purged then)
    local names = {'cu', 'du', 'oa', 'cw'}  -- (cu and cw alike: equal ones stay equal)
    local s = redis.call('HMGET', K_STATE, unpack(names))
    for k = 1, #names do
      local x = tonumber(s[k])
      if x and x > now and x <= 4e18 then redis.call('HSET', K_STATE, names[k], x - back) end
    end
  end
  if lt ~= now then redis.call('HSET', K_STATE, 'lt', now) end
end

-- Return the permits whose lease ran out; their reservations keep the estimate.  So
-- do reservations left without a permit at all: Redis evicted (maxmemory) or someone
-- deleted the permits key, and an owner that died then would hold them for ever.
local function purge(now, ttl_ms)
  rewind(now)
  reseed()
  local expired = redis.call('ZRANGEBYSCORE', K_PERMITS, '-inf', now)
  local orphaned = {}
  -- (Each reservation has its permit, so the counts differ only after such a loss.)
  if redis.call('HLEN', K_OPEN) > redis.call('ZCARD', K_PERMITS) then
    for _, m in ipairs(redis.call('HKEYS', K_OPEN)) do
      if not redis.call('ZSCORE', K_PERMITS, m) then orphaned[#orphaned + 1] = m end
    end
  end
  if #expired == 0 and #orphaned == 0 then return 0 end
  local probe = redis.call('HGET', K_STATE, 'pr')
  for _, m in ipairs(expired) do lapse(m, probe, now, ttl_ms) end
  for _, m in ipairs(orphaned) do lapse(m, probe, now, ttl_ms) end
  redis.call('ZREMRANGEBYSCORE', K_PERMITS, '-inf', now)
  bump(ttl_ms)
  return #expired + #orphaned
end

-- Drop window entries at or before now - window (the memory backend's expire()).
local function expire(now, window_us)
  if redis.call('EXISTS', K_WINDOW) == 0 then
    redis.call('DEL', K_WTOK)
    return
  end
  local horizon = now - window_us
  local old = redis.call('ZRANGEBYSCORE', K_WINDOW, '-inf', horizon)
  if #old == 0 then return end
  local freed = 0
  local i = 1
  while i <= #old do
    local j = math.min(i + 999, #old)
    local toks = redis.call('HMGET', K_WTOK, unpack(old, i, j))
    for k = 1, #toks do freed = freed + (tonumber(toks[k]) or 0) end
    i = j + 1
  end
  chunked('HDEL', K_WTOK, old)
  redis.call('HINCRBY', K_WTOK, '=sum', 0 - freed)
  redis.call('ZREMRANGEBYSCORE', K_WINDOW, '-inf', horizon)
end

-- Keep the long-lived keys at least key_ttl, and the state as long as its cooldown,
-- its open breaker and its longest lease (forgetting any would let calls through
-- early, and lose a held admission's settlement).  At most 1e15 ms (~31,700 years): a
-- longer TTL is written in exponent form, which PEXPIRE refuses, failing the script
-- halfway.
local function touch(now, ttl_ms)
  local s = redis.call('HMGET', K_STATE, 'cu', 'br', 'oa', 'op')
  local until_us = tonumber(s[1]) or 0
  if s[2] == 'o' then
    until_us = math.max(until_us, (tonumber(s[3]) or 0) + (tonumber(s[4]) or 0))
  end
  local last = redis.call('ZRANGE', K_PERMITS, -1, -1, 'WITHSCORES')
  if last[2] then until_us = math.max(until_us, tonumber(last[2])) end
  local keep = math.min(1e15, math.max(ttl_ms, math.ceil((until_us - now) / 1000) + 1000))
  redis.call('PEXPIRE', K_STATE, keep)
  redis.call('PEXPIRE', K_OPEN, keep)
  redis.call('PEXPIRE', K_PERMITS, keep)
end
"""

# ARGV: member, tokens, rpm, tpm, max_in_flight (-1: none), breaker open_us, lease_us,
# window_us, key_ttl_ms.
# Returns {1, probe, now, version} or {0, reason, retry_at (-1: unknown), now, version}.
ADMIT = _PRELUDE + r"""
local member = ARGV[1]
local tokens = tonumber(ARGV[2])
local rpm, tpm, mif = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local open_us, lease_us = tonumber(ARGV[6]), tonumber(ARGV[7])
local window_us, ttl_ms = tonumber(ARGV[8]), tonumber(ARGV[9])
local now = now_us()
purge(now, ttl_ms)
if redis.call('HEXISTS', K_OPEN, member) == 1 then
  -- A retry of an admission that was granted but whose reply was lost: the same one.
  local again = 0
  if redis.call('HGET', K_STATE, 'pr') == member then again = 1 end
  return {1, again, now, version()}
end

-- First: it depends on the settings alone, and no wait would ever make it admissible.
if tpm >= 0 and tokens > tpm then return {0, 'too_large', -1, now, version()} end

local s = redis.call('HMGET', K_STATE, 'cu', 'dd', 'br', 'oa', 'pr', 'op', 'du', 'cw')
local cu = tonumber(s[1]) or 0
local du = dead_until(s[1], s[2], s[7], s[8])
if du > now then return {0, 'dead', inst(du), now, version()} end
-- The dead mark is over: for older versions too (they read dd = 1 as dead until cu).
if s[2] == '1' then redis.call('HSET', K_STATE, 'dd', '0') end
if cu > now then return {0, 'cooling_down', inst(cu), now, version()} end

local br = s[3] or 'c'
local probe = 0
if br == 'o' then
  local reopen = (tonumber(s[4]) or 0) + (tonumber(s[6]) or open_us)
  if now < reopen then return {0, 'breaker_open', inst(reopen), now, version()} end
  br = 'h'
  redis.call('HSET', K_STATE, 'br', 'h', 'pr', '')
  s[5] = ''
end
if br == 'h' then
  -- The probe is out, unless its permit is gone: lost with the permits key (evicted)
  -- and its holder dead, nobody would ever settle it, and the source would stay shut
  -- until the state key expired (key_ttl_s, a day).
  if s[5] and s[5] ~= '' and redis.call('ZSCORE', K_PERMITS, s[5]) then
    return {0, 'breaker_open', -1, now, version()}
  end
  probe = 1
end

if mif >= 0 and redis.call('ZCARD', K_PERMITS) >= mif then
  return {0, 'in_flight', -1, now, version()}
end

expire(now, window_us)
if rpm >= 0 and redis.call('ZCARD', K_WINDOW) >= rpm then
  local first = redis.call('ZRANGE', K_WINDOW, 0, 0, 'WITHSCORES')
  return {0, 'rpm', tonumber(first[2]) + window_us, now, version()}
end
if tpm >= 0 then
  local sum = tonumber(redis.call('HGET', K_WTOK, '=sum')) or 0
  if sum + tokens > tpm then
    -- While reservations are open, settling them can free tokens before the window
    -- expires: its time is then only the latest ('tpm_open', as the memory backend's
    -- sooner).
    -- (Only if what they hold in the window could make room at all.)
    local excess = sum + tokens - tpm
    local reason = 'tpm'
    local freeable = 0
    for _, m in ipairs(redis.call('HKEYS', K_OPEN)) do
      freeable = freeable + (tonumber(redis.call('HGET', K_WTOK, m)) or 0)
    end
    if freeable >= excess then reason = 'tpm_open' end
    -- When enough of the window expires for the estimate to fit.
    local entries = redis.call('ZRANGE', K_WINDOW, 0, -1, 'WITHSCORES')
    local freed = 0
    local free_at = 0
    for i = 1, #entries, 2 do
      freed = freed + (tonumber(redis.call('HGET', K_WTOK, entries[i])) or 0)
      free_at = tonumber(entries[i + 1]) + window_us
      if freed >= excess then break end
    end
    return {0, reason, free_at, now, version()}
  end
end

-- Redis keeps what a script wrote before an error: every key and counter the writes
-- below touch is checked first, so that foreign data (another tool's, a hand's) fails
-- the admission before it holds a permit and a window entry that nobody owns.
local v = version()
local function not_whole(x)  -- (HINCRBY refuses it, or overflows past 18 digits)
  return x and (not string.match(x, '^%-?%d+$') or #x > 18)
end
if foreign(K_WINDOW, 'zset') or foreign(K_WTOK, 'hash') or foreign(K_OPEN, 'hash')
    or foreign(K_PERMITS, 'zset') or foreign(K_STATE, 'hash')
    or not_whole(redis.call('HGET', K_WTOK, '=sum')) then
  return redis.error_reply('polygate: foreign data in the source keys')
end
local counters = redis.call('HMGET', K_STATE, 'rt', 'ot', 'ad')
for i = 1, 3 do
  if not_whole(counters[i]) then
    return redis.error_reply('polygate: foreign data in the source state')
  end
end

redis.call('ZADD', K_WINDOW, now, member)
redis.call('HSET', K_WTOK, member, tokens)
redis.call('HINCRBY', K_WTOK, '=sum', tokens)
redis.call('HSET', K_OPEN, member, tokens)
redis.call('ZADD', K_PERMITS, now + lease_us, member)
redis.call('HINCRBY', K_STATE, 'rt', tokens)
redis.call('HINCRBY', K_STATE, 'ot', tokens)
redis.call('HINCRBY', K_STATE, 'ad', 1)
if probe == 1 then redis.call('HSET', K_STATE, 'pr', member) end
local window_ms = math.ceil(window_us / 1000) + 1000
redis.call('PEXPIRE', K_WINDOW, window_ms)
redis.call('PEXPIRE', K_WTOK, window_ms)
touch(now, ttl_ms)
return {1, probe, now, v}
"""

# ARGV: member, sent (1/0), tokens (-1: keep the estimate), feedback (s/f/n),
# cooldown_us (0: none), dead (1/0), failures, failure_rate, rate_window,
# rate_min_calls, window_us, key_ttl_ms, open_us, max_open_us, probes, jitter.
# Returns {settled (1/0), now, version}.
SETTLE = _PRELUDE + r"""
local member = ARGV[1]
local sent, tokens, fb = ARGV[2] == '1', tonumber(ARGV[3]), ARGV[4]
local cooldown_us, dead = tonumber(ARGV[5]), ARGV[6] == '1'
local failures, rate = tonumber(ARGV[7]), tonumber(ARGV[8])
local rate_window, rate_min = tonumber(ARGV[9]), tonumber(ARGV[10])
local window_us, ttl_ms = tonumber(ARGV[11]), tonumber(ARGV[12])
local open_us, max_open_us = tonumber(ARGV[13]), tonumber(ARGV[14])
local probes, jitter = tonumber(ARGV[15]), tonumber(ARGV[16])
local now = now_us()
purge(now, ttl_ms)

-- A cooldown (a 429's Retry-After) or a dead mark (a 401): maxima of instants, so
-- applying one late, or twice, says the same.
local function cool()
  if cooldown_us <= 0 then return false end
  -- A dead mark holds for its own cooldown and no longer: past it, a longer ordinary
  -- cooldown (a 429's Retry-After) is one to wait out, not a failure.
  local c = redis.call('HMGET', K_STATE, 'cu', 'dd', 'du', 'cw')
  local cu = math.max(tonumber(c[1]) or 0, now + cooldown_us)
  local du = dead_until(c[1], c[2], c[3], c[4])
  if dead then du = math.max(du, now + cooldown_us) end
  local dd = '0'
  if du > now then dd = '1' end
  redis.call('HSET', K_STATE, 'cu', cu, 'du', du, 'dd', dd, 'cw', cu)
  return true
end

-- The breaker: closed -> open -> half_open -> (closed | open); never skips a state.
-- Opening sets 'op', this opening's period: open_us * 2^rn (rn: failed probes in a
-- row), capped at max_open_us, times the caller's jitter on a re-opening of a backoff
-- (the memory backend's rule: the first opening, and every one without a backoff,
-- is exactly open_us).
local function open_breaker(reopens)
  local nominal = math.min(max_open_us, open_us * (2 ^ math.min(reopens, 30)))
  local j = jitter
  if reopens == 0 or max_open_us <= open_us then j = 1 end
  redis.call('HSET', K_STATE, 'br', 'o', 'oa', now, 'rn', reopens,
             'op', math.floor(nominal * j), 'pk', 0)
  redis.call('HINCRBY', K_STATE, 'pn', 1)  -- (a new period: see lapse())
end
-- What the attempt's end tells the breaker (probe: it was the half-open probe).
local function feed(probe)
  if probe then redis.call('HSET', K_STATE, 'pr', '') end
  if fb == 'n' then return end
  local failed = fb == 'f'
  local oc = redis.call('HGET', K_STATE, 'oc') or ''
  if failed then oc = oc .. '1' else oc = oc .. '0' end
  if #oc > rate_window then oc = string.sub(oc, #oc - rate_window + 1) end
  local br = redis.call('HGET', K_STATE, 'br') or 'c'
  if not failed then
    redis.call('HSET', K_STATE, 'cf', 0)
    if br == 'h' and probe then
      local ok = redis.call('HINCRBY', K_STATE, 'pk', 1)
      if ok >= probes then
        redis.call('HSET', K_STATE, 'br', 'c', 'rn', 0, 'pk', 0)
        oc = ''
      end
    end
  else
    local cf = redis.call('HINCRBY', K_STATE, 'cf', 1)
    if br == 'h' then
      if probe then open_breaker((tonumber(redis.call('HGET', K_STATE, 'rn')) or 0) + 1) end
    elseif br == 'c' then
      local _, fails = string.gsub(oc, '1', '')
      local trip = #oc >= rate_min and fails / #oc > rate
      if cf >= failures or trip then open_breaker(0) end
    end
  end
  redis.call('HSET', K_STATE, 'oc', oc)
end

local est = redis.call('HGET', K_OPEN, member)
if not est then
  -- Settled already (idempotent), or its reservation was lost with the open key
  -- (evicted), or settled by the purge when its lease ran out: either way its permit
  -- and its probe are free now, not a lease later.
  local freed = redis.call('ZREM', K_PERMITS, member) == 1
  if redis.call('HGET', K_STATE, 'pr') == member then
    redis.call('HSET', K_STATE, 'pr', '')
    freed = true
  end
  -- A lapsed one (its holder paused, or cut off from Redis, past its lease) still
  -- says, once, what the upstream answered: a 401 or a 429 it brings back is every
  -- process's to heed, and a failure the breaker's to count.  Its cost stays the
  -- estimate the purge settled.
  if foreign(K_LAPSED, 'zset') or redis.call('ZREM', K_LAPSED, member) == 0 then
    if freed then bump(ttl_ms) end
    return {0, now, version()}
  end
  cool()
  -- A lapsed probe whose breaker is still half-open with no other probe out decides
  -- it as it would have on time (a failure re-opens it): taken for any attempt, the
  -- next call would be let through as a new probe to a source known to fail.
  local st = redis.call('HMGET', K_STATE, 'br', 'pr', 'pn', 'lp')
  local head, lp, was_probe = (st[3] or '0') .. '|', st[4] or '', false
  if string.sub(lp, 1, #head) == head then  -- (an earlier period's: no probe of this one)
    local at = string.find(lp, '|' .. member .. '|', #head, true)
    if at then
      was_probe = true
      redis.call('HSET', K_STATE, 'lp', string.sub(lp, 1, at) .. string.sub(lp, at + #member + 2))
    end
  end
  feed(was_probe and st[1] == 'h' and (st[2] or '') == '')
  touch(now, ttl_ms)
  bump(ttl_ms)
  return {0, now, version()}
end
est = tonumber(est)
redis.call('HDEL', K_OPEN, member)
redis.call('HINCRBY', K_STATE, 'ot', 0 - est)
redis.call('ZREM', K_PERMITS, member)
local probe = redis.call('HGET', K_STATE, 'pr') == member

expire(now, window_us)
local held = tonumber(redis.call('HGET', K_WTOK, member))
if not sent then
  redis.call('HINCRBY', K_STATE, 'rl', est)
  if held then
    redis.call('HDEL', K_WTOK, member)
    redis.call('HINCRBY', K_WTOK, '=sum', 0 - held)
    redis.call('ZREM', K_WINDOW, member)
  end
else
  redis.call('HINCRBY', K_STATE, 'st', est)
  local cost = est
  if tokens >= 0 then cost = tokens end
  redis.call('HINCRBY', K_STATE, 'ct', cost)
  if held and cost ~= held then
    redis.call('HSET', K_WTOK, member, cost)
    redis.call('HINCRBY', K_WTOK, '=sum', cost - held)
  end
end

cool()

feed(probe)
touch(now, ttl_ms)
bump(ttl_ms)
return {1, now, version()}
"""

# ARGV: window_us, key_ttl_ms.
# Returns {now, br, cf, in_flight, requests, tokens, reserved_open, cu, du,
#          rt, st, rl, ct, ad, lx, open_until (0 unless the breaker is open)}.
SNAPSHOT = _PRELUDE + r"""
local window_us, ttl_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_us()
purge(now, ttl_ms)
expire(now, window_us)
local s = redis.call('HMGET', K_STATE, 'br', 'cf', 'ot', 'cu', 'dd', 'rt', 'st', 'rl', 'ct', 'ad', 'lx', 'du', 'oa', 'op', 'cw')
-- A count that is no whole number a reply can carry (NaN, inf, 1e30: another tool's)
-- is 0, not the smallest 64-bit integer Redis would cast it to.
local function n(v)
  local x = tonumber(v)
  if x == nil or x ~= x or x > 9007199254740991 or x < -9007199254740991 then return 0 end
  return x
end
local function at(v)  -- an instant: any size, as inst() bounds it; NaN is none
  local x = tonumber(v)
  if x == nil or x ~= x then return 0 end
  return inst(math.max(x, 0))
end
local open_until = 0
if s[1] == 'o' then open_until = at((tonumber(s[13]) or 0) + (tonumber(s[14]) or 0)) end
return {now, s[1] or 'c', n(s[2]), redis.call('ZCARD', K_PERMITS), redis.call('ZCARD', K_WINDOW),
        n(redis.call('HGET', K_WTOK, '=sum')), n(s[3]), at(s[4]), at(dead_until(s[4], s[5], s[12], s[15])),
        n(s[6]), n(s[7]), n(s[8]), n(s[9]), n(s[10]), n(s[11]), open_until}
"""

# ARGV: lease_us, key_ttl_ms, member...  Extends the leases still held; returns the
# members whose lease had already run out (their permits were returned by purge).
RENEW = _PRELUDE + r"""
local lease_us, ttl_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_us()
purge(now, ttl_ms)
local lost = {}
for i = 3, #ARGV do
  local m = ARGV[i]
  if redis.call('ZSCORE', K_PERMITS, m) then
    redis.call('ZADD', K_PERMITS, 'XX', now + lease_us, m)
  else
    lost[#lost + 1] = m
  end
end
touch(now, ttl_ms)
return lost
"""

# Hedge budget: one key per scope, a float stored with 17 significant digits so the
# bucket does exactly the memory backend's double arithmetic.  A missing key is full.
_BUDGET = r"""
local function fmt(x) return string.format('%.17g', x) end
local burst, ttl_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
-- Never above this burst: one a reload lowered, say, from the level it left.  Never
-- below 0 either, and a level that is no finite number (another tool's) is full, as a
-- missing key: one bad value would otherwise turn hedging off for good.
local level = tonumber(redis.call('GET', KEYS[1]))
if level == nil or level ~= level or level == math.huge or level == -math.huge then
  level = burst
end
level = math.max(0, math.min(burst, level))
"""

# ARGV: burst, key_ttl_ms.  Returns {taken (1/0), level}.
BUDGET_TAKE = _BUDGET + r"""
local taken = 0
if level >= WHOLE_TOKEN then  -- a whole token, give or take rounding
  level = math.max(level - 1, 0)
  taken = 1
end
redis.call('SET', KEYS[1], fmt(level), 'PX', ttl_ms)
return {taken, fmt(level)}
""".replace("WHOLE_TOKEN", repr(WHOLE_TOKEN))  # the memory backend's, to the bit

# ARGV: burst, key_ttl_ms, amount.  Returns the level.
BUDGET_REFILL = _BUDGET + r"""
level = math.min(burst, level + tonumber(ARGV[3]))
redis.call('SET', KEYS[1], fmt(level), 'PX', ttl_ms)
return fmt(level)
"""

# ARGV: burst, key_ttl_ms.  Returns the level (read only).
BUDGET_LEVEL = _BUDGET + r"""
return fmt(level)
"""

# Checks at start-up that this user may run every command the scripts call: Redis 7
# applies a user's ACL inside scripts, and a script refused a command half-way keeps
# what it wrote before it (a permit, a window entry: nobody's, until they lapse).  Each
# is tried on a scratch key under the prefix (KEYS[1]) with pcall; returns the names of
# those an ACL refused ("can't run this command"; '' when none).  Any other error (OOM,
# WRONGTYPE, a key pattern's NOPERM, said at any admission) is not this check's business.
PERMITS = r"""
local k = KEYS[1]
local refused = {}
local function try(...)
  local r = redis.pcall(...)
  if type(r) == 'table' and r.err and string.find(r.err, "can't run this command", 1, true) then
    refused[#refused + 1] = string.lower((...))
  end
end
try('TIME')
try('EXISTS', k) try('GET', k) try('TYPE', k) try('SET', k, '0', 'PX', 60000) try('INCR', k)
try('PEXPIRE', k, 60000) try('DEL', k)
try('HSET', k, 'f', '0') try('HGET', k, 'f') try('HMGET', k, 'f') try('HEXISTS', k, 'f')
try('HINCRBY', k, 'f', 1) try('HKEYS', k) try('HVALS', k) try('HLEN', k) try('HDEL', k, 'f')
redis.pcall('DEL', k)
try('ZADD', k, 0, 'm') try('ZSCORE', k, 'm') try('ZCARD', k) try('ZRANGE', k, 0, 0)
try('ZRANGEBYSCORE', k, 0, 1) try('ZREMRANGEBYSCORE', k, 2, 3) try('ZREM', k, 'm')
redis.pcall('DEL', k)
return table.concat(refused, ' ')
"""

# Checks at start-up that scripts run and TIME is readable inside them.
PROBE = r"""
local t = redis.call('TIME')
return tonumber(t[1]) * 1000000 + tonumber(t[2])
"""
