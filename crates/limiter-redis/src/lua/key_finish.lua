-- polygw client key: finish one permit (settle and release), atomically and idempotently
-- (mirrors KeyQuotas::finish). Prefixed by key_lib.lua.
-- ARGV: 1 permit id   2 tokens   3 cost nanos   4 tokens reserved   5 nanos reserved
--       6 window ms   7 key ttl margin ms
-- The slot and its money reservation, while its lease has not ended, are replaced by the
-- cost, settled now in the current day and month; a lease that ended was settled at its
-- reservation then. The token reservation, while still in the window, becomes the
-- settled tokens for one window from now. Later finishes find nothing and change nothing.
local id = ARGV[1]
local tokens, cost = tonumber(ARGV[2]), tonumber(ARGV[3])
local W, margin = tonumber(ARGV[6]), tonumber(ARGV[7])

advance(W)

local slot = id .. '|' .. ARGV[5]
if redis.call('ZREM', INF, slot) == 1 then
  set('r', meta.r - tonumber(ARGV[5]))
  if is_top_up(id) then set('u', meta.u - 1) end
  charge(now, cost)
end
local reserved = id .. '|r' .. ARGV[4]
local e = tonumber(redis.call('ZSCORE', LED, reserved))
local moved_e, moved_s = false, false
if e and e > now then
  -- Add before removing: the ledger never empties here (Redis would delete it, and the
  -- ZADD would create it again without its deadline).
  redis.call('ZADD', LED, n(now + W), id .. '|s' .. ARGV[2])
  redis.call('ZREM', LED, reserved)
  set('t', meta.t + tokens - tonumber(ARGV[4]))
  -- The settlement leaves by now + window (a holder finishing late, its lease renewed
  -- past the deadlines it was admitted under).
  moved_e, moved_s = deadlines(now, W, margin)
end
flush()
if exists then
  if moved_e then
    redis.call('PEXPIREAT', WIN, n(meta.E))
    redis.call('PEXPIREAT', LED, n(meta.E))
  end
  if moved_s then
    redis.call('PEXPIREAT', INF, n(meta.S))
    redis.call('PEXPIREAT', ST, n(meta.S))
  end
end
return 1
