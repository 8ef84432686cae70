-- polygw limiter: settle and/or release one permit, atomically and idempotently.
-- KEYS: 1 source window   2 source tokens   3 source in-flight   4 scope tokens
-- ARGV: 1 permit id   2 tokens ('' = no settlement)   3 release ('1' / '0')   4 window ms
-- The first settlement of a permit replaces its reservation in the source's and the
-- scope's windows; later ones, and any after the entry left the window, change nothing.
-- Replicate effects, not the script (TIME is non-deterministic); the default since Redis 5.
if redis.replicate_commands then redis.replicate_commands() end
local id = ARGV[1]
if ARGV[2] ~= '' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local at = tonumber(redis.call('ZSCORE', KEYS[1], id))
  if at and at + tonumber(ARGV[4]) > now
      and redis.call('HSETNX', KEYS[2], 's:' .. id, 1) == 1 then
    local new = tonumber(ARGV[2])
    local old = tonumber(redis.call('HGET', KEYS[2], id)) or 0
    redis.call('HSET', KEYS[2], id, new)
    redis.call('HINCRBY', KEYS[2], 'sum', new - old)
    local scope_old = tonumber(redis.call('HGET', KEYS[4], id))
    if scope_old then
      redis.call('HSET', KEYS[4], id, new)
      redis.call('HINCRBY', KEYS[4], 'sum', new - scope_old)
    end
  end
end
if ARGV[3] == '1' then
  redis.call('ZREM', KEYS[3], id)
end
return 1
