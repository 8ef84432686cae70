-- polygw limiter: settle and/or release one permit, atomically and idempotently.
-- KEYS: 1 scope ledger (see acquire.lua)   2 source in-flight   3 source requests
--       4 scope requests
-- ARGV: 1 permit id   2 tokens ('' = no settlement)   3 release ('1' / '0')   4 window ms
--       5 key ttl margin ms   6 source name   7 the reservation (tokens reserved at
--       admission)
-- The first settlement of a reservation still in the window replaces it by the settled
-- amount, counted for one window from now (SPEC 14.3); later ones change nothing (the
-- reservation entry is gone), and none revives a reservation that already left the
-- window.
-- Needs Redis 6.2 or later (ZMSCORE); effects, not scripts, are replicated (the default
-- since Redis 5).
local id, src = ARGV[1], ARGV[6]
local W, margin = tonumber(ARGV[4]), tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local L = KEYS[1]

local function n(v) return string.format('%d', v) end
local function val(s) return -1 - (tonumber(s) or -1) end

if ARGV[2] ~= '' then
  local reserved = id .. '|r' .. ARGV[7] .. '|' .. src
  local v = redis.call('ZMSCORE', L, reserved, '#', '#s' .. src, '#L', '#E')
  local e = tonumber(v[1])
  if e and e > now then
    local delta = tonumber(ARGV[2]) - tonumber(ARGV[7])
    local args = {
      n(now + W), id .. '|s' .. ARGV[2] .. '|' .. src,
      n(-1 - (val(v[2]) + delta)), '#',
      n(-1 - (val(v[3]) + delta)), '#s' .. src,
    }
    -- The settlement leaves by now + window: move the scope's deadline if it falls short
    -- (a holder settling late, after its heartbeat stopped).
    local need = now + val(v[4]) + W + margin
    local deadline = val(v[5])
    local extend = deadline < need
    if extend then
      deadline = need + margin
      args[#args + 1] = n(-1 - deadline)
      args[#args + 1] = '#E'
    end
    redis.call('ZREM', L, reserved)
    redis.call('ZADD', L, unpack(args))
    if extend then
      redis.call('PEXPIREAT', L, n(deadline))
      redis.call('PEXPIREAT', KEYS[4], n(deadline))
    end
  end
end
if ARGV[3] == '1' then
  redis.call('ZREM', KEYS[2], id)
end
return 1
