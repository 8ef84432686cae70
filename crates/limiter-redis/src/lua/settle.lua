-- polygw limiter: settle and/or release one permit, atomically and idempotently.
-- KEYS: 1 source tokens   2 source reservations   3 source settlements   4 source in-flight
--       5 scope tokens   6 scope reservations   7 scope settlements
-- ARGV: 1 permit id   2 tokens ('' = no settlement)   3 release ('1' / '0')   4 window ms
--       5 key ttl margin ms
-- The first settlement of a reservation still in the window replaces it by the settled
-- amount, counted for one window from now (SPEC 14.3); later ones change nothing, and
-- none revives a reservation that already left the window.
-- Replicate effects, not the script (TIME is non-deterministic); the default since Redis 5.
if redis.replicate_commands then redis.replicate_commands() end
local id = ARGV[1]
local W, margin = tonumber(ARGV[4]), tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function keep(key, ttl)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end

local function settle(tok, res, set, new)
  local e = tonumber(redis.call('ZSCORE', res, id))
  if not e or e + W <= now then return end
  redis.call('ZREM', res, id)
  local old = tonumber(redis.call('HGET', tok, id)) or 0
  redis.call('HSET', tok, id, new)
  redis.call('HINCRBY', tok, 'sum', new - old)
  redis.call('ZADD', set, now, id)
  keep(tok, W + margin)
  keep(set, W + margin)
end

if ARGV[2] ~= '' then
  local new = tonumber(ARGV[2])
  settle(KEYS[1], KEYS[2], KEYS[3], new)
  settle(KEYS[5], KEYS[6], KEYS[7], new)
end
if ARGV[3] == '1' then
  redis.call('ZREM', KEYS[4], id)
end
return 1
