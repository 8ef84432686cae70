-- polygw limiter: in-flight leases of a source that have not ended; read-only.
-- KEYS: 1 source in-flight (zset id -> lease end)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
