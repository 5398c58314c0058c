-- HOOK_DONE: a dispatcher is done with a webhook event (delivered, or given up): its entry
-- is acknowledged and deleted, and its job's `done` raised to its seq, in one call, so the
-- job's next event is free to go exactly when this one has left the stream.
-- KEYS: the webhook event stream, the job's webhook state (ns:hook:<id>)
-- ARGV: group, entry id, seq, state ttl
-- Reply: 1 if the entry was still there
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
local gone = redis.call('XDEL', KEYS[1], ARGV[2])
local done = tonumber(redis.call('HGET', KEYS[2], 'done') or '-1')
if tonumber(ARGV[3]) > done then
  redis.call('HSET', KEYS[2], 'done', ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return gone
