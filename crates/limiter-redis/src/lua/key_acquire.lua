-- polygw client key: one admission, atomically (mirrors KeyQuotas::acquire). Prefixed by
-- key_lib.lua (KEYS, state, periods).
-- ARGV: 1 permit id   2 rpm   3 tpm   4 max concurrency   5 day budget nanos ('' = none)
--       6 month budget nanos ('' = none)   7 tokens to reserve   8 nanos to reserve
--       9 lease ms   10 window ms   11 key ttl margin ms
--       12 '1' for a top-up (a permit id starting with '+': money only, see key_lib.lua)
-- Returns {1, now} when admitted, {0, reason, hint ms or -1} when refused (reasons:
-- 1 concurrency, 2 rpm, 3 tpm, 4 day budget, 5 month budget). Checks in that order, the
-- month's budget before the day's (the reason named is the one that clears last).
local id = ARGV[1]
local rpm, tpm, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local budget_day, budget_month = tonumber(ARGV[5]), tonumber(ARGV[6])
local est, nanos = tonumber(ARGV[7]), tonumber(ARGV[8])
local lease, W, margin = math.max(tonumber(ARGV[9]), 1), tonumber(ARGV[10]), tonumber(ARGV[11])
local top_up = ARGV[12] == '1'
if top_up then rpm, tpm, conc, est = 0, 0, 0, 0 end

advance(W)

local function refuse(code, hint)
  flush()
  return {0, code, hint}
end

local inflight = redis.call('ZCARD', INF)
if conc > 0 and inflight - meta.u >= conc then
  local first = redis.call('ZRANGE', INF, 0, 0, 'WITHSCORES')
  return refuse(1, tonumber(first[2]) - now)
end
local requests = redis.call('ZCARD', WIN)
if rpm > 0 and requests >= rpm then
  -- ms until (requests - rpm + 1) requests have left the window
  local e = redis.call('ZRANGE', WIN, requests - rpm, requests - rpm, 'WITHSCORES')
  return refuse(2, math.max(tonumber(e[2]) + W - now, 1))
end
if tpm > 0 and meta.t + est > tpm then
  -- ms until tokens + est <= tpm if nothing is settled or renewed meanwhile (-1: never)
  local hint = -1
  if est <= tpm then
    local remaining, start = meta.t, 0
    while hint < 0 do
      local page = redis.call('ZRANGEBYSCORE', LED, '(' .. now_s, '+inf', 'WITHSCORES', 'LIMIT', start, CHUNK)
      if #page == 0 then break end
      for i = 1, #page, 2 do
        local _, tok = parse(page[i])
        remaining = remaining - tok
        if remaining + est <= tpm then
          hint = math.max(tonumber(page[i + 1]) - now, 1)
          break
        end
      end
      start = start + CHUNK
    end
  end
  return refuse(3, hint)
end
local budgets = {{5, budget_month, meta.ms, month_end(now)}, {4, budget_day, meta.ds, day_end(now)}}
for _, b in ipairs(budgets) do
  local code, limit, settled, ends = b[1], b[2], b[3], b[4]
  if limit and settled + meta.r + nanos > limit then
    -- -1: above the budget itself (never passes); 1000 (key_quota::IN_FLIGHT_RETRY_MS):
    -- held only by calls in flight; else spent for the period: its end.
    local hint = -1
    if nanos <= limit then
      if settled + nanos <= limit then hint = 1000 else hint = math.max(ends - now, 1) end
    end
    return refuse(code, hint)
  end
end

-- Admit: the request in the window, the tokens in the ledger until the lease end (+ the
-- window), the slot with its money until the lease end.
if not top_up then
  redis.call('ZADD', WIN, now_s, id)
  redis.call('ZADD', LED, n(now + lease + W), id .. '|r' .. ARGV[7])
  set('t', meta.t + est)
else
  set('u', meta.u + 1)
end
redis.call('ZADD', INF, n(now + lease), id .. '|' .. ARGV[8])
set('r', meta.r + nanos)
if lease > meta.L then set('L', lease) end
local moved_e, moved_s = deadlines(now + meta.L, W, margin)
local created = not exists
exists = true
flush()
-- TTLs where a deadline moved or a key was created (a set emptied by Redis comes back
-- without one; the ledger's emptiness is not counted, so it is always set).
if moved_e or requests == 0 then redis.call('PEXPIREAT', WIN, n(meta.E)) end
if not top_up or moved_e then redis.call('PEXPIREAT', LED, n(meta.E)) end
if moved_s or inflight == 0 then redis.call('PEXPIREAT', INF, n(meta.S)) end
if moved_s or created then redis.call('PEXPIREAT', ST, n(meta.S)) end
return {1, now}
