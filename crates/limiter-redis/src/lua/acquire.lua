-- polygw limiter: one acquire, atomically (mirrors polygw_core::window::WindowLimiter).
-- KEYS: 1 source requests (zset id -> admitted at, ms)   2 source tokens (hash id -> tokens,
--       'sum' -> total)   3 source reservations (zset id -> lease end)   4 source
--       settlements (zset id -> settled at)   5 source in-flight (zset id -> lease end)
--       6 scope requests   7 scope tokens   8 scope reservations   9 scope settlements
-- ARGV: 1 permit id   2 rpm   3 tpm   4 max concurrency   5 scope rpm   6 scope tpm
--       7 reservation   8 lease ms   9 window ms   10 key ttl margin ms
-- Returns {1, now} when admitted, {0, reason, hint ms or -1} when refused
-- (reasons: 1 concurrency, 2 rpm, 3 tpm, 4 scope rpm, 5 scope tpm).
-- Tokens (SPEC 14.3): a reservation counts until its lease end + the window (the
-- heartbeat renews the lease while the call runs); a settlement counts for one window
-- from the time it was settled.
-- Replicate effects, not the script (TIME is non-deterministic); the default since Redis 5.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = ARGV[1]
local rpm, tpm, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local scope_rpm, scope_tpm = tonumber(ARGV[5]), tonumber(ARGV[6])
local est, lease = tonumber(ARGV[7]), math.max(tonumber(ARGV[8]), 1)
local W, margin = tonumber(ARGV[9]), tonumber(ARGV[10])
local CHUNK = 500

-- Drops the token entries that left the window (score <= now - W in either zset).
local function prune_tokens(tok, res, set)
  local removed = 0
  for _, z in ipairs({res, set}) do
    while true do
      local old = redis.call('ZRANGEBYSCORE', z, '-inf', now - W, 'LIMIT', 0, CHUNK)
      if #old == 0 then break end
      local vals = redis.call('HMGET', tok, unpack(old))
      for i = 1, #old do removed = removed + (tonumber(vals[i]) or 0) end
      redis.call('HDEL', tok, unpack(old))
      redis.call('ZREM', z, unpack(old))
      if #old < CHUNK then break end
    end
  end
  if removed ~= 0 then redis.call('HINCRBY', tok, 'sum', -removed) end
end

local function total(tok)
  return tonumber(redis.call('HGET', tok, 'sum')) or 0
end

-- ms until (count - limit + 1) requests have left the window.
local function rpm_hint(win, count, limit)
  local e = redis.call('ZRANGE', win, count - limit, count - limit, 'WITHSCORES')
  return math.max(tonumber(e[2]) + W - now, 1)
end

-- A cursor over one token zset in expiry order (score + W), a page at a time.
local function cursor(tok, z)
  local c = {start = 0, page = {}, vals = {}, i = 1}
  function c.peek()
    if c.i > #c.page then
      local p = redis.call('ZRANGE', z, c.start, c.start + CHUNK - 1, 'WITHSCORES')
      c.start = c.start + CHUNK
      c.page, c.vals, c.i = {}, {}, 1
      if #p == 0 then return nil end
      local ids = {}
      for k = 1, #p, 2 do
        ids[#ids + 1] = p[k]
        c.page[#c.page + 1] = tonumber(p[k + 1]) + W
      end
      c.vals = redis.call('HMGET', tok, unpack(ids))
    end
    return c.page[c.i]
  end
  function c.take()
    local v = tonumber(c.vals[c.i]) or 0
    c.i = c.i + 1
    return v
  end
  return c
end

-- ms until tokens + est <= limit if nothing is settled or renewed meanwhile, or -1 if
-- that can never happen.
local function tpm_hint(tok, res, set, used, limit)
  if est > limit then return -1 end
  local remaining = used
  local a, b = cursor(tok, res), cursor(tok, set)
  while true do
    local ea, eb = a.peek(), b.peek()
    local expiry
    if ea and (not eb or ea <= eb) then
      expiry = ea
      remaining = remaining - a.take()
    elseif eb then
      expiry = eb
      remaining = remaining - b.take()
    else
      return -1
    end
    if remaining + est <= limit then return math.max(expiry - now, 1) end
  end
end

local function keep(key, ttl)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end

-- Source: in flight, requests, tokens.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - W)
prune_tokens(KEYS[2], KEYS[3], KEYS[4])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
if conc > 0 and redis.call('ZCARD', KEYS[5]) >= conc then
  local first = redis.call('ZRANGE', KEYS[5], 0, 0, 'WITHSCORES')
  return {0, 1, tonumber(first[2]) - now}
end
local requests = redis.call('ZCARD', KEYS[1])
if rpm > 0 and requests >= rpm then
  return {0, 2, rpm_hint(KEYS[1], requests, rpm)}
end
local used = total(KEYS[2])
if tpm > 0 and used + est > tpm then
  return {0, 3, tpm_hint(KEYS[2], KEYS[3], KEYS[4], used, tpm)}
end

-- Scope: requests, tokens.
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now - W)
prune_tokens(KEYS[7], KEYS[8], KEYS[9])
local scope_requests = redis.call('ZCARD', KEYS[6])
if scope_rpm > 0 and scope_requests >= scope_rpm then
  return {0, 4, rpm_hint(KEYS[6], scope_requests, scope_rpm)}
end
local scope_used = total(KEYS[7])
if scope_tpm > 0 and scope_used + est > scope_tpm then
  return {0, 5, tpm_hint(KEYS[7], KEYS[8], KEYS[9], scope_used, scope_tpm)}
end

-- Admit: the request in both windows, the reservation in both ledgers until its lease
-- end, an in-flight lease.
for _, k in ipairs({{KEYS[1], KEYS[2], KEYS[3]}, {KEYS[6], KEYS[7], KEYS[8]}}) do
  redis.call('ZADD', k[1], now, id)
  redis.call('HSET', k[2], id, est)
  redis.call('HINCRBY', k[2], 'sum', est)
  redis.call('ZADD', k[3], now + lease, id)
  keep(k[1], W + margin)
  keep(k[2], lease + W + margin)
  keep(k[3], lease + W + margin)
end
redis.call('ZADD', KEYS[5], now + lease, id)
keep(KEYS[5], lease + margin)
return {1, now}
