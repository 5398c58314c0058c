-- LOCK_RELEASE: delete a lock only while it holds our token.
-- KEYS: the lock
-- ARGV: our token
-- Reply: 1 if released, 0 if the lock is another's or gone
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
