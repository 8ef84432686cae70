-- polygw limiter: (requests, tokens) in one rolling window now; read-only.
-- KEYS: 1 requests (zset)   2 tokens (hash)   3 reservations (zset)   4 settlements (zset)
-- ARGV: 1 window ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local after = '(' .. (now - tonumber(ARGV[1]))
local requests = redis.call('ZCOUNT', KEYS[1], after, '+inf')
local sum = 0
for _, z in ipairs({KEYS[3], KEYS[4]}) do
  local ids = redis.call('ZRANGEBYSCORE', z, after, '+inf')
  for i = 1, #ids, 500 do
    local vals = redis.call('HMGET', KEYS[2], unpack(ids, i, math.min(i + 499, #ids)))
    for _, v in ipairs(vals) do sum = sum + (tonumber(v) or 0) end
  end
end
return {requests, sum}
