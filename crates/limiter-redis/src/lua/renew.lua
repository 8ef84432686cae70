-- polygw heartbeat: renews the live leases of one scope (SPEC 14.4), atomically.
-- KEYS: 1 scope ledger   2 scope totals (both: see acquire.lua)   3 scope requests; then
--       3 keys per source group g (from 3 + 3(g-1) + 1): in-flight, requests, breaker hash
-- ARGV: 1 window ms   2 key ttl margin ms   3 number of groups G; then G source names;
--       then 5 per lease: kind ('p' permit | 'b' probe), source group, permit id or probe
--       epoch, lease ms, reservation (tokens; permits only)
-- A lease is extended to now + lease only while it has not ended: a slot, reservation or
-- probe whose lease ended (its holder was silent for a whole lease) is never revived.
-- Returns the positions (1-based, in lease order) of the leases found ended or gone.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local W, margin, G = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local L, M = KEYS[1], KEYS[2]
local ended = {}
local renewed = {}

local function n(v) return string.format('%d', v) end

-- Extends member m of zset z to score until_ + offset if its lease (score - offset) has
-- not ended; true if it was live.
local function extend(z, m, until_, offset)
  local e = tonumber(redis.call('ZSCORE', z, m))
  if not e or e - offset <= now then return false end
  if until_ + offset > e then redis.call('ZADD', z, 'XX', n(until_ + offset), m) end
  return true
end

local first = 4 + G
for i = first, #ARGV, 5 do
  local pos = (i - first) / 5 + 1
  local kind, g, id = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local lease = tonumber(ARGV[i + 3])
  local base = 3 + 3 * (g - 1)
  local until_ = now + lease
  if kind == 'p' then
    local src = ARGV[3 + g]
    local live = extend(KEYS[base + 1], id, until_, 0)
    if extend(L, id .. '|r' .. ARGV[i + 4] .. '|' .. src, until_, W) then live = true end
    if live then renewed[g] = math.max(renewed[g] or 0, lease) else ended[#ended + 1] = pos end
  else
    local v = redis.call('HMGET', KEYS[base + 3], 'ep', 'pu')
    local ep, pu = tonumber(v[1]) or 0, tonumber(v[2]) or 0
    if ep == tonumber(id) and pu > now then
      if until_ > pu then redis.call('HSET', KEYS[base + 3], 'pu', until_) end
      local keep = lease + margin
      if redis.call('PTTL', KEYS[base + 3]) < keep then redis.call('PEXPIRE', KEYS[base + 3], keep) end
    else
      ended[#ended + 1] = pos
    end
  end
end

-- Deadlines (see acquire.lua): what was renewed now leaves by now + lease + window. The
-- totals hash is only written where it exists (it holds the deadlines it stands for).
if next(renewed) ~= nil and redis.call('EXISTS', M) == 1 then
  local fields = {'L', 'E'}
  local groups = {}
  for g in pairs(renewed) do
    groups[#groups + 1] = g
    fields[#fields + 1] = 'e:' .. ARGV[3 + g]
  end
  local v = redis.call('HMGET', M, unpack(fields))
  local longest = tonumber(v[1]) or 0
  local writes = {}
  local function deadline(have, lease)
    local need = now + math.max(longest, lease) + W + margin
    if (tonumber(have) or 0) < need then return need + margin end
    return nil
  end
  local top = 0
  for _, g in ipairs(groups) do top = math.max(top, renewed[g]) end
  local d = deadline(v[2], top)
  if d then
    writes[#writes + 1] = 'E'
    writes[#writes + 1] = n(d)
    redis.call('PEXPIREAT', L, n(d))
    redis.call('PEXPIREAT', M, n(d))
    redis.call('PEXPIREAT', KEYS[3], n(d))
  end
  for k, g in ipairs(groups) do
    local base = 3 + 3 * (g - 1)
    local dg = deadline(v[2 + k], renewed[g])
    if dg then
      writes[#writes + 1] = 'e:' .. ARGV[3 + g]
      writes[#writes + 1] = n(dg)
      redis.call('PEXPIREAT', KEYS[base + 1], n(dg))
      redis.call('PEXPIREAT', KEYS[base + 2], n(dg))
    end
  end
  if #writes > 0 then redis.call('HSET', M, unpack(writes)) end
end
return ended
