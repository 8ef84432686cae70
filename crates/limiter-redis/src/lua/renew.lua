-- polygw heartbeat: renews the live leases of one scope (SPEC 14.4), atomically.
-- KEYS: 1 scope reservations   2 scope tokens; then 4 keys per source group g (from
--       2 + 4(g-1) + 1): in-flight, reservations, tokens, breaker hash
-- ARGV: 1 window ms   2 key ttl margin ms; then 4 per lease: kind ('p' permit | 'b'
--       probe), source group, permit id or probe epoch, lease ms
-- A lease is extended to now + lease only while it has not ended: a slot, reservation or
-- probe whose lease ended (its holder was silent for a whole lease) is never revived.
-- Returns the positions (1-based, in ARGV order) of the leases found ended or gone.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local W, margin = tonumber(ARGV[1]), tonumber(ARGV[2])
local ended = {}

local function keep(key, ttl)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end

-- Extends member id of zset z (a lease end) if it has not ended; true if it was live.
local function extend(z, id, until_)
  local e = tonumber(redis.call('ZSCORE', z, id))
  if not e or e <= now then return false end
  if until_ > e then redis.call('ZADD', z, 'XX', until_, id) end
  return true
end

for i = 3, #ARGV, 4 do
  local pos = (i - 3) / 4 + 1
  local kind, g, id, lease = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], tonumber(ARGV[i + 3])
  local base = 2 + 4 * (g - 1)
  local until_ = now + lease
  if kind == 'p' then
    local live = false
    if extend(KEYS[base + 1], id, until_) then
      live = true
      keep(KEYS[base + 1], lease + margin)
    end
    if extend(KEYS[base + 2], id, until_) then
      live = true
      keep(KEYS[base + 2], lease + W + margin)
      keep(KEYS[base + 3], lease + W + margin)
    end
    if extend(KEYS[1], id, until_) then
      keep(KEYS[1], lease + W + margin)
      keep(KEYS[2], lease + W + margin)
    end
    if not live then ended[#ended + 1] = pos end
  else
    local v = redis.call('HMGET', KEYS[base + 4], 'ep', 'pu')
    local ep, pu = tonumber(v[1]) or 0, tonumber(v[2]) or 0
    if ep == tonumber(id) and pu > now then
      if until_ > pu then redis.call('HSET', KEYS[base + 4], 'pu', until_) end
      keep(KEYS[base + 4], lease + margin)
    else
      ended[#ended + 1] = pos
    end
  end
end
return ended
