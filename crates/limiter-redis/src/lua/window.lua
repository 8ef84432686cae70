-- polygw limiter: (requests, tokens) in one rolling window now; read-only.
-- KEYS: 1 window (zset)   2 tokens (hash)   ARGV: 1 window ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. (now - tonumber(ARGV[1])), '+inf')
local sum = 0
for i = 1, #ids, 500 do
  local vals = redis.call('HMGET', KEYS[2], unpack(ids, i, math.min(i + 499, #ids)))
  for _, v in ipairs(vals) do sum = sum + (tonumber(v) or 0) end
end
return {#ids, sum}
