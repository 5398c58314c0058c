-- RATE_SETTLE: a request of an API key has ended: its job leaves the key's running set,
-- and the tokens it was charged (prompt and max_tokens, estimated) are corrected to what
-- it used. Fewer come off the second they were charged to, while that second is still in
-- the window; more are charged to the present second.
-- KEYS: the key's counts (hash), its running jobs (sorted set)
-- ARGV: the second charged, the correction in tokens (negative: fewer), job id ("" none)
-- Reply: 1
local delta = tonumber(ARGV[2])
if delta < 0 then
  local field = 't:' .. ARGV[1]
  if redis.call('HEXISTS', KEYS[1], field) == 1 then
    if redis.call('HINCRBY', KEYS[1], field, delta) <= 0 then redis.call('HDEL', KEYS[1], field) end
  end
elseif delta > 0 then
  redis.call('HINCRBY', KEYS[1], 't:' .. redis.call('TIME')[1], delta)
  redis.call('EXPIRE', KEYS[1], 62)
end
if ARGV[3] ~= '' then redis.call('ZREM', KEYS[2], ARGV[3]) end
return 1
