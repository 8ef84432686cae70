-- polygw breaker: frees the half-open probe granted to one admission whose answer was
-- lost (its future was dropped while the script ran), identified by that admission's
-- token; a no-op if it got no probe or the probe is over.
-- KEYS: 1 breaker hash   ARGV: 1 token
if redis.call('HGET', KEYS[1], 'pt') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'pu', 0)
  redis.call('HDEL', KEYS[1], 'pt')
end
return 1
