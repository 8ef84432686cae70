-- polygw limiter: one acquire, atomically (mirrors polygw_core::window::WindowLimiter).
-- KEYS: 1 source window (zset id -> admitted at, ms)   2 source tokens (hash id -> tokens,
--       'sum' -> total, 's:'..id -> settled mark)   3 source in-flight (zset id -> lease end)
--       4 scope window   5 scope tokens
-- ARGV: 1 permit id   2 rpm   3 tpm   4 max concurrency   5 scope rpm   6 scope tpm
--       7 reservation   8 lease ms   9 window ms   10 key ttl margin ms
-- Returns {1, now} when admitted, {0, reason, hint ms or -1} when refused
-- (reasons: 1 concurrency, 2 rpm, 3 tpm, 4 scope rpm, 5 scope tpm).
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

-- Drops the entries that left the window (admitted at <= now - W) and their tokens.
local function prune(win, tok, marks)
  local removed = 0
  while true do
    local old = redis.call('ZRANGEBYSCORE', win, '-inf', now - W, 'LIMIT', 0, CHUNK)
    if #old == 0 then break end
    local vals = redis.call('HMGET', tok, unpack(old))
    local fields = {}
    for i, m in ipairs(old) do
      removed = removed + (tonumber(vals[i]) or 0)
      fields[#fields + 1] = m
      if marks then fields[#fields + 1] = 's:' .. m end
    end
    redis.call('HDEL', tok, unpack(fields))
    redis.call('ZREM', win, unpack(old))
    if #old < CHUNK then break end
  end
  if removed ~= 0 then redis.call('HINCRBY', tok, 'sum', -removed) end
end

local function total(tok)
  return tonumber(redis.call('HGET', tok, 'sum')) or 0
end

-- ms until (count - limit + 1) requests have left the window.
local function rpm_hint(win, count, limit)
  local e = redis.call('ZRANGE', win, count - limit, count - limit, 'WITHSCORES')
  return tonumber(e[2]) + W - now
end

-- ms until tokens + est <= limit, or -1 if that can never happen.
local function tpm_hint(win, tok, used, limit)
  if est > limit then return -1 end
  local remaining = used
  local start = 0
  while true do
    local page = redis.call('ZRANGE', win, start, start + CHUNK - 1, 'WITHSCORES')
    if #page == 0 then return -1 end
    local ids = {}
    for i = 1, #page, 2 do ids[#ids + 1] = page[i] end
    local vals = redis.call('HMGET', tok, unpack(ids))
    for i = 1, #ids do
      remaining = remaining - (tonumber(vals[i]) or 0)
      if remaining + est <= limit then
        return tonumber(page[2 * i]) + W - now
      end
    end
    start = start + CHUNK
  end
end

-- Source: in flight, requests, tokens.
prune(KEYS[1], KEYS[2], true)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if conc > 0 and redis.call('ZCARD', KEYS[3]) >= conc then
  local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  return {0, 1, tonumber(first[2]) - now}
end
local requests = redis.call('ZCARD', KEYS[1])
if rpm > 0 and requests >= rpm then
  return {0, 2, rpm_hint(KEYS[1], requests, rpm)}
end
local used = total(KEYS[2])
if tpm > 0 and used + est > tpm then
  return {0, 3, tpm_hint(KEYS[1], KEYS[2], used, tpm)}
end

-- Scope: requests, tokens.
prune(KEYS[4], KEYS[5], false)
local scope_requests = redis.call('ZCARD', KEYS[4])
if scope_rpm > 0 and scope_requests >= scope_rpm then
  return {0, 4, rpm_hint(KEYS[4], scope_requests, scope_rpm)}
end
local scope_used = total(KEYS[5])
if scope_tpm > 0 and scope_used + est > scope_tpm then
  return {0, 5, tpm_hint(KEYS[4], KEYS[5], scope_used, scope_tpm)}
end

-- Admit: record the reservation in both windows and take an in-flight lease.
for _, k in ipairs({{KEYS[1], KEYS[2]}, {KEYS[4], KEYS[5]}}) do
  redis.call('ZADD', k[1], now, id)
  redis.call('HSET', k[2], id, est)
  redis.call('HINCRBY', k[2], 'sum', est)
  redis.call('PEXPIRE', k[1], W + margin)
  redis.call('PEXPIRE', k[2], W + margin)
end
redis.call('ZADD', KEYS[3], now + lease, id)
if redis.call('PTTL', KEYS[3]) < lease + margin then
  redis.call('PEXPIRE', KEYS[3], lease + margin)
end
return {1, now}
