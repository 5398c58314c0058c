-- LOCK_RENEW: extend a lock only while it holds our token.
-- KEYS: the lock
-- ARGV: our token, its new ttl (ms)
-- Reply: 1 if renewed, 0 if the lock is another's or gone
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
