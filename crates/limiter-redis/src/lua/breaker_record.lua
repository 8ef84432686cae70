-- polygw breaker: record how an attempt ended (mirrors BreakerState::record).
-- KEYS: 1 breaker hash (fields as in breaker_admit.lua)
-- ARGV: 1 outcome ('success' | 'failure' | 'neutral' | 'dead' | 'rate_limited')
--       2 probe ('1' / '0')   3 cooldown ms   4 failure threshold   5 open ms
--       6 dead ms   7 idle ttl ms
-- Replicate effects, not the script (TIME is non-deterministic); the default since Redis 5.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local v = redis.call('HMGET', KEYS[1], 'cf', 'ou', 'ro', 'pu', 'du', 'cd')
local cf, ou, ro = tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0
local pu, du, cd = tonumber(v[4]) or 0, tonumber(v[5]) or 0, tonumber(v[6]) or 0
local outcome, probe = ARGV[1], ARGV[2] == '1'
local open_ms = tonumber(ARGV[5])

-- OPEN_S * min(2^reopens, 10)
local function open_for(reopens)
  if reopens >= 4 then return open_ms * 10 end
  return open_ms * math.min(2 ^ reopens, 10)
end

if probe then pu = 0 end
if outcome == 'success' then
  cf, ou, ro, pu, du = 0, 0, 0, 0, 0
elseif outcome == 'failure' then
  cf = cf + 1
  local half_open = ou > 0 and ou <= now
  if probe and half_open then
    ro = ro + 1
    ou = now + open_for(ro)
  elseif ou == 0 and cf >= tonumber(ARGV[4]) then
    ou = now + open_for(ro)
  end
elseif outcome == 'dead' then
  du = now + tonumber(ARGV[6])
elseif outcome == 'rate_limited' then
  cd = math.max(cd, now + tonumber(ARGV[3]))
end

if cf == 0 and ou == 0 and ro == 0 and pu == 0 and du == 0 and cd == 0 then
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('HSET', KEYS[1], 'cf', cf, 'ou', ou, 'ro', ro, 'pu', pu, 'du', du, 'cd', cd)
redis.call('PEXPIRE', KEYS[1], math.max(ou, pu, du, cd, now) - now + tonumber(ARGV[7]))
return 1
