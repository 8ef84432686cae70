-- polygw breaker: record how an attempt ended (mirrors BreakerState::record).
-- KEYS: 1 breaker hash (fields as in breaker_admit.lua; dd: consecutive dead answers)
-- ARGV: 1 outcome ('success' | 'failure' | 'fast_failure' | 'neutral' | 'dead' | 'rate_limited')
--       2 probe ('1' / '0')   3 cooldown ms (bounded by the caller)   4 failure threshold
--       5 open ms   6 dead ms   7 idle ttl ms   8 the epoch the attempt was admitted under
--       9 dead answers in a row that make the source dead   10 the longest open ms
-- Success and failure count only in their epoch (SPEC 14.7); a cooldown and a dead period
-- apply whatever the epoch; only the end of the dead period revives a dead source.
-- Replicate effects, not the script (TIME is non-deterministic); the default since Redis 5.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local v = redis.call('HMGET', KEYS[1], 'cf', 'ou', 'ro', 'pu', 'du', 'cd', 'ep', 'dd')
local cf, ou, ro = tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0
local pu, du, cd = tonumber(v[4]) or 0, tonumber(v[5]) or 0, tonumber(v[6]) or 0
local ep, dd = tonumber(v[7]) or 0, tonumber(v[8]) or 0
local outcome, probe = ARGV[1], ARGV[2] == '1'
local open_ms = tonumber(ARGV[5])
local open_max = math.max(tonumber(ARGV[10]) or open_ms, open_ms)
local current = tonumber(ARGV[8]) == ep

-- min(OPEN_S * 2^reopens, max(OPEN_MAX_S, OPEN_S))
local function open_for(reopens)
  if reopens >= 40 then return open_max end
  return math.min(open_ms * (2 ^ reopens), open_max)
end

if probe and current then pu = 0 end
if outcome == 'success' then
  dd = 0
  if current then
    if ou > 0 then ep = ep + 1 end
    cf, ou, ro, pu = 0, 0, 0, 0
  end
elseif (outcome == 'failure' or outcome == 'fast_failure') and current then
  cf = cf + 1
  local half_open = ou > 0 and ou <= now
  if probe and half_open then
    -- a probe that failed fast re-opens for OPEN_S again; a slow one doubles it
    if outcome == 'fast_failure' then ro = 0 else ro = ro + 1 end
    ou = now + open_for(ro)
    ep = ep + 1
  elseif ou == 0 and cf >= tonumber(ARGV[4]) then
    ou = now + open_for(ro)
    ep = ep + 1
  end
elseif outcome == 'dead' then
  dd = dd + 1
  if dd >= math.max(tonumber(ARGV[9]) or 1, 1) then
    du = math.max(du, now + tonumber(ARGV[6]))
  end
elseif outcome == 'rate_limited' then
  dd = 0
  cd = math.max(cd, now + tonumber(ARGV[3]))
end

if cf == 0 and ou == 0 and ro == 0 and pu == 0 and du == 0 and cd == 0 and ep == 0 and dd == 0 then
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('HSET', KEYS[1], 'cf', cf, 'ou', ou, 'ro', ro, 'pu', pu, 'du', du, 'cd', cd, 'ep', ep, 'dd', dd)
if pu == 0 then redis.call('HDEL', KEYS[1], 'pt') end
redis.call('PEXPIRE', KEYS[1], math.max(ou, pu, du, cd, now) - now + tonumber(ARGV[7]))
return 1
