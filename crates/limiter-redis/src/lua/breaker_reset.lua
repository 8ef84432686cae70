-- polygw breaker: an operator's reset (mirrors BreakerState::reset): the breaker closes
-- at once, in a new epoch (outcomes of attempts admitted before it count no more); the
-- drain flag is another key and stays.
-- KEYS: 1 breaker hash (see breaker_admit.lua)
-- ARGV: 1 idle ttl ms
redis.call('HSET', KEYS[1], 'cf', 0, 'ou', 0, 'ro', 0, 'pu', 0, 'du', 0, 'cd', 0, 'dd', 0, 'pt', '')
redis.call('HINCRBY', KEYS[1], 'ep', 1)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return 1
