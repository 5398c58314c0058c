-- BATCH_TRANSITION: move a batch (tokenq.server.batch_api) to a new status if it is in one
-- of the given ones, stamping the time; a move to an end writes its webhook event (batch.
-- completed, ...) in the same call, when any endpoint is registered.
-- KEYS: the batch hash, the batch webhook event stream, the webhook endpoints hash (on a
--       Redis Cluster, where it lies in another slot: absent, and the caller passes the
--       payload only when an endpoint exists)
-- ARGV: new status, timestamp field ("" for none), now, the event's payload ("" for none),
--       then the statuses it may leave
-- Reply: 1 if moved, 0 if not (its status was another)
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
for i = 5, #ARGV do
  if ARGV[i] == status then
    redis.call('HSET', KEYS[1], 'status', ARGV[1])
    if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], ARGV[2], ARGV[3]) end
    if ARGV[4] ~= '' and (not KEYS[3] or redis.call('EXISTS', KEYS[3]) == 1) then
      local id = string.match(KEYS[1], '([^:]+)$')
      redis.call('XADD', KEYS[2], '*', 'job', id, 'seq', '0', 'prev', '-1', 'data', ARGV[4])
    end
    return 1
  end
end
return 0
