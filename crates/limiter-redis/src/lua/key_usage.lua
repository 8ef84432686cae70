-- polygw client key: its figures now (mirrors KeyQuotas::usage). Prefixed by key_lib.lua.
-- ARGV: 1 window ms
-- Returns {now, in flight, requests, tokens, reserved nanos, day nanos, month nanos}
-- (spend = settled in the period + reserved). Leases that ended are settled first (as
-- every key script does), so the figures are those an admission would see.
advance(tonumber(ARGV[1]))
flush()
return {now, redis.call('ZCARD', INF) - meta.u, redis.call('ZCARD', WIN), meta.t, meta.r, meta.ds + meta.r, meta.ms + meta.r}
