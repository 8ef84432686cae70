-- polygw breaker: may the source be tried now? (mirrors BreakerState::admit)
-- KEYS: 1 breaker hash (cf consecutive failures, ou open until, ro reopens, pu probe
--       until, du dead until, cd cooldown until; ms, 0 = none; ep epoch; pt the token of
--       the admission that holds the probe)   2 the drain flag (exists: drained)
-- ARGV: 1 probe lease ms   2 idle ttl ms   3 token of this admission
-- Returns {1, probe 0/1, epoch} when allowed, {0, reason, hint ms} when refused
-- (reasons: 1 circuit open, 2 dead, 3 cooldown, 4 drained). Granting the probe starts an
-- epoch.
-- Replicate effects, not the script (TIME is non-deterministic); the default since Redis 5.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, 4, 0} end
local v = redis.call('HMGET', KEYS[1], 'ou', 'pu', 'du', 'cd', 'ep')
local ou, pu = tonumber(v[1]) or 0, tonumber(v[2]) or 0
local du, cd, ep = tonumber(v[3]) or 0, tonumber(v[4]) or 0, tonumber(v[5]) or 0
if du > now then return {0, 2, du - now} end
if cd > now then return {0, 3, cd - now} end
if ou == 0 then return {1, 0, ep} end
if ou > now then return {0, 1, ou - now} end
-- Half-open: one probe at a time.
if pu > now then return {0, 1, pu - now} end
pu = now + math.max(tonumber(ARGV[1]), 1)
ep = ep + 1
redis.call('HSET', KEYS[1], 'pu', pu, 'ep', ep, 'pt', ARGV[3])
local keep = math.max(ou, pu, du, cd) - now + tonumber(ARGV[2])
if redis.call('PTTL', KEYS[1]) < keep then redis.call('PEXPIRE', KEYS[1], keep) end
return {1, 1, ep}
