-- polygw client key: the heartbeat of one key's live leases (SPEC 14.4), atomically
-- (mirrors KeyQuotas::renew). Prefixed by key_lib.lua.
-- ARGV: 1 window ms   2 key ttl margin ms; then 4 per lease: permit id, nanos reserved,
--       tokens reserved, lease ms
-- A lease is extended to now + lease only while it has not ended (never revived); its
-- token reservation with it. Returns the positions (1-based) of the leases found ended.
local W, margin = tonumber(ARGV[1]), tonumber(ARGV[2])
local ended = {}
local top = 0
for i = 3, #ARGV, 4 do
  local id, lease = ARGV[i], tonumber(ARGV[i + 3])
  local until_ = now + lease
  local slot = id .. '|' .. ARGV[i + 1]
  local e = tonumber(redis.call('ZSCORE', INF, slot))
  if e and e > now then
    if until_ > e then redis.call('ZADD', INF, 'XX', n(until_), slot) end
    local res = id .. '|r' .. ARGV[i + 2]
    local r = tonumber(redis.call('ZSCORE', LED, res))
    if r and r - W > now and until_ + W > r then redis.call('ZADD', LED, 'XX', n(until_ + W), res) end
    top = math.max(top, until_)
  else
    ended[#ended + 1] = (i - 3) / 4 + 1
  end
end
if top > 0 and exists then
  local moved_e, moved_s = deadlines(top, W, margin)
  flush()
  if moved_e then
    redis.call('PEXPIREAT', WIN, n(meta.E))
    redis.call('PEXPIREAT', LED, n(meta.E))
  end
  if moved_s then
    redis.call('PEXPIREAT', INF, n(meta.S))
    redis.call('PEXPIREAT', ST, n(meta.S))
  end
end
return ended
