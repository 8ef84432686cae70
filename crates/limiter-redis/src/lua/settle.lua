-- polygw limiter: settle and/or release one permit, atomically and idempotently.
-- KEYS: 1 scope ledger   2 scope totals (both: see acquire.lua)   3 source in-flight
--       4 scope requests
-- ARGV: 1 permit id   2 tokens ('' = no settlement)   3 release ('1' / '0')   4 window ms
--       5 key ttl margin ms   6 source name   7 the reservation (tokens reserved at
--       admission)
-- The first settlement of a reservation still in the window replaces it by the settled
-- amount, counted for one window from now (SPEC 14.3); later ones change nothing (the
-- reservation entry is gone), and none revives a reservation that already left the
-- window.
-- Effects, not scripts, are replicated (TIME is non-deterministic): the default since
-- Redis 5.
local id, src = ARGV[1], ARGV[6]
local W, margin = tonumber(ARGV[4]), tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local L, M = KEYS[1], KEYS[2]

local function n(v) return string.format('%d', v) end

if ARGV[2] ~= '' then
  local reserved = id .. '|r' .. ARGV[7] .. '|' .. src
  local e = tonumber(redis.call('ZSCORE', L, reserved))
  if e and e > now then
    local delta = tonumber(ARGV[2]) - tonumber(ARGV[7])
    local v = redis.call('HMGET', M, 't', 't:' .. src, 'L', 'E')
    local args = {
      't', n((tonumber(v[1]) or 0) + delta),
      't:' .. src, n((tonumber(v[2]) or 0) + delta),
    }
    -- The settlement leaves by now + window: move the scope's deadline if it falls short
    -- (a holder settling late, after its heartbeat stopped).
    local need = now + (tonumber(v[3]) or 0) + W + margin
    local deadline = tonumber(v[4]) or 0
    local extend = deadline < need
    if extend then
      deadline = need + margin
      args[#args + 1] = 'E'
      args[#args + 1] = n(deadline)
    end
    -- Add before removing: the ledger never empties here (Redis would delete it, and
    -- the ZADD would create it again without its deadline).
    redis.call('ZADD', L, n(now + W), id .. '|s' .. ARGV[2] .. '|' .. src)
    redis.call('ZREM', L, reserved)
    redis.call('HSET', M, unpack(args))
    if extend then
      redis.call('PEXPIREAT', L, n(deadline))
      redis.call('PEXPIREAT', M, n(deadline))
      redis.call('PEXPIREAT', KEYS[4], n(deadline))
    end
  end
end
if ARGV[3] == '1' then
  redis.call('ZREM', KEYS[3], id)
end
return 1
