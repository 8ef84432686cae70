-- polygw limiter: (requests, tokens) in one rolling window now; read-only.
-- KEYS: 1 requests (zset)   2 scope ledger (zset, see acquire.lua)
-- ARGV: 1 window ms   2 source name, or '' for the whole scope
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local requests = redis.call('ZCOUNT', KEYS[1], '(' .. string.format('%d', now - tonumber(ARGV[1])), '+inf')
local who = ARGV[2]
local sum, start, CHUNK = 0, 0, 1000
while true do
  local page = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. string.format('%d', now), '+inf', 'LIMIT', start, CHUNK)
  for _, m in ipairs(page) do
    local tok, w = string.match(m, '^[^|]*|%a(%d+)|(.*)$')
    if who == '' or w == who then sum = sum + tonumber(tok) end
  end
  if #page < CHUNK then break end
  start = start + CHUNK
end
return {requests, sum}
