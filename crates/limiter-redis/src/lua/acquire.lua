-- polygw limiter: one acquire, atomically (mirrors polygw_core::window::WindowLimiter).
-- KEYS: 1 source requests (zset id -> admitted at, ms)   2 source in-flight (zset id ->
--       lease end)   3 scope requests (zset id -> admitted at)   4 scope ledger (zset,
--       below)   5 scope totals (hash, below)
-- ARGV: 1 permit id   2 rpm   3 tpm   4 max concurrency   5 scope rpm   6 scope tpm
--       7 reservation   8 lease ms   9 window ms   10 key ttl margin ms   11 source name
-- Returns {1, now} when admitted, {0, reason, hint ms or -1} when refused
-- (reasons: 1 concurrency, 2 rpm, 3 tpm, 4 scope rpm, 5 scope tpm).
--
-- The ledger is one sorted set per scope holding every token entry of the scope and of
-- each of its sources (the scope's tokens are the sum of its sources'):
--   "<id>|r<tokens>|<source>"  a reservation, score = lease end + window: it counts until
--                               settled, or until its lease (renewed by the heartbeat)
--                               has ended and one more window has passed (SPEC 14.3);
--   "<id>|s<tokens>|<source>"  a settlement, score = settled at + window.
-- The totals hash keeps what the scripts would otherwise recount: "t" the scope's tokens,
-- "t:<source>" a source's, "n" the ledger's entries, "L" the longest lease seen, "E" the
-- expiry deadline (ms) of the scope's keys, "e:<source>" that of a source's keys, "P" /
-- "p:<source>" when the request and in-flight sets are pruned next.
-- Keys get a deadline (PEXPIREAT) that covers everything they hold plus the margin, and
-- is moved a margin further only when it falls short, so most scripts set no TTL; a set
-- created again after it emptied gets its group's deadline. Requests and leases are
-- counted live (ZCOUNT) and the sets pruned once a second.
-- Effects, not scripts, are replicated (TIME is non-deterministic): the default since
-- Redis 5.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, src = ARGV[1], ARGV[11]
local rpm, tpm, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local scope_rpm, scope_tpm = tonumber(ARGV[5]), tonumber(ARGV[6])
local est, lease = tonumber(ARGV[7]), math.max(tonumber(ARGV[8]), 1)
local W, margin = tonumber(ARGV[9]), tonumber(ARGV[10])
local L, M = KEYS[4], KEYS[5]
local CHUNK = 500
local PRUNE_EVERY = 1000

-- Numbers go to Redis as integer strings (a Lua number would be printed with %.17g).
local function n(v) return string.format('%d', v) end
local now_s, live_s = n(now), '(' .. n(now - W)

-- The totals this script reads, and those it changes (written back in one HSET).
local names = {'t', 't:' .. src, 'n', 'L', 'E', 'e:' .. src, 'P', 'p:' .. src}
local got = redis.call('HMGET', M, unpack(names))
local meta, dirty, exists = {}, {}, false
for i, name in ipairs(names) do
  if got[i] then exists = true end
  meta[name] = tonumber(got[i]) or 0
end
local function get(name) return meta[name] end
local function set(name, v)
  meta[name] = v
  dirty[name] = true
end

-- (source, tokens) of an entry.
local function parse(m)
  local tok, who = string.match(m, '^[^|]*|%a(%d+)|(.*)$')
  return who, tonumber(tok)
end

-- Drops the entries that left the window (score <= now), taking their tokens off the
-- scope's and their source's totals (another source's through HINCRBY).
local others = {}
while true do
  local gone = redis.call('ZRANGEBYSCORE', L, '-inf', now_s, 'LIMIT', 0, CHUNK)
  if #gone == 0 then break end
  for _, m in ipairs(gone) do
    local who, tok = parse(m)
    set('t', get('t') - tok)
    if who == src then
      set('t:' .. src, get('t:' .. src) - tok)
    else
      others[who] = (others[who] or 0) + tok
    end
  end
  set('n', get('n') - #gone)
  redis.call('ZREM', L, unpack(gone))
  if #gone < CHUNK then break end
end
for who, tok in pairs(others) do redis.call('HINCRBY', M, 't:' .. who, -tok) end

-- Writes the changed totals. Before an admission only where the hash exists: a refused
-- first acquire must not create it without a deadline.
local function flush()
  if not exists then return end
  local args = {}
  for name in pairs(dirty) do
    args[#args + 1] = name
    args[#args + 1] = n(meta[name])
  end
  if #args > 0 then redis.call('HSET', M, unpack(args)) end
end

-- ms until (count - limit + 1) requests have left the window.
-- (Entries older than the window may still be there: they are pruned once a second.)
local function rpm_hint(win, count, limit)
  local e = redis.call('ZRANGEBYSCORE', win, live_s, '+inf', 'WITHSCORES', 'LIMIT', count - limit, 1)
  return math.max(tonumber(e[2]) + W - now, 1)
end

-- ms until tokens + est <= limit if nothing is settled or renewed meanwhile, or -1 if
-- that can never happen: the entries (of source `who`, or all) in expiry order.
local function tpm_hint(who, used, limit)
  if est > limit then return -1 end
  local remaining, start = used, 0
  while true do
    local page = redis.call('ZRANGEBYSCORE', L, '(' .. now_s, '+inf', 'WITHSCORES', 'LIMIT', start, CHUNK)
    if #page == 0 then return -1 end
    for i = 1, #page, 2 do
      local w, tok = parse(page[i])
      if who == nil or w == who then
        remaining = remaining - tok
        if remaining + est <= limit then return math.max(tonumber(page[i + 1]) - now, 1) end
      end
    end
    start = start + CHUNK
  end
end

if now >= get('p:' .. src) then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_s)
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', n(now - W))
  set('p:' .. src, now + PRUNE_EVERY)
end

-- Source: in flight, requests, tokens.
local inflight = redis.call('ZCOUNT', KEYS[2], '(' .. now_s, '+inf')
if conc > 0 and inflight >= conc then
  flush()
  local first = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now_s, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  return {0, 1, tonumber(first[2]) - now}
end
local requests = redis.call('ZCOUNT', KEYS[1], live_s, '+inf')
if rpm > 0 and requests >= rpm then
  flush()
  return {0, 2, rpm_hint(KEYS[1], requests, rpm)}
end
local used = get('t:' .. src)
if tpm > 0 and used + est > tpm then
  flush()
  return {0, 3, tpm_hint(src, used, tpm)}
end

-- Scope: requests, tokens.
if now >= get('P') then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', n(now - W))
  set('P', now + PRUNE_EVERY)
end
local scope_requests = redis.call('ZCOUNT', KEYS[3], live_s, '+inf')
if scope_rpm > 0 and scope_requests >= scope_rpm then
  flush()
  return {0, 4, rpm_hint(KEYS[3], scope_requests, scope_rpm)}
end
local scope_used = get('t')
if scope_tpm > 0 and scope_used + est > scope_tpm then
  flush()
  return {0, 5, tpm_hint(nil, scope_used, scope_tpm)}
end

-- Admit: the request in both windows, the reservation in the ledger until its lease end
-- (+ the window), an in-flight lease.
local ledger_was_empty = get('n') <= 0
redis.call('ZADD', KEYS[1], now_s, id)
redis.call('ZADD', KEYS[3], now_s, id)
redis.call('ZADD', KEYS[2], n(now + lease), id)
redis.call('ZADD', L, n(now + lease + W), id .. '|r' .. ARGV[7] .. '|' .. src)
set('t', scope_used + est)
set('t:' .. src, used + est)
set('n', get('n') + 1)
if lease > get('L') then set('L', lease) end
-- Deadlines: everything a key holds leaves by now + longest lease + window.
local need = now + get('L') + W + margin
local scope_deadline, src_deadline = get('E'), get('e:' .. src)
local extend_scope, extend_src = scope_deadline < need, src_deadline < need
if extend_scope then
  scope_deadline = need + margin
  set('E', scope_deadline)
end
if extend_src then
  src_deadline = need + margin
  set('e:' .. src, src_deadline)
end
exists = true
flush()
if extend_scope then redis.call('PEXPIREAT', M, n(scope_deadline)) end
if extend_scope or ledger_was_empty then redis.call('PEXPIREAT', L, n(scope_deadline)) end
if extend_scope or scope_requests == 0 then redis.call('PEXPIREAT', KEYS[3], n(scope_deadline)) end
if extend_src or requests == 0 then redis.call('PEXPIREAT', KEYS[1], n(src_deadline)) end
if extend_src or inflight == 0 then redis.call('PEXPIREAT', KEYS[2], n(src_deadline)) end
return {1, now}
