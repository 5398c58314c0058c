-- BATCH_TRANSITION: move a batch (tokenq.server.batch_api) to a new status if it is in one
-- of the given ones, stamping the time.
-- KEYS: the batch hash
-- ARGV: new status, timestamp field ("" for none), now, then the statuses it may leave
-- Reply: 1 if moved, 0 if not (its status was another)
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
for i = 4, #ARGV do
  if ARGV[i] == status then
    redis.call('HSET', KEYS[1], 'status', ARGV[1])
    if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], ARGV[2], ARGV[3]) end
    return 1
  end
end
return 0
