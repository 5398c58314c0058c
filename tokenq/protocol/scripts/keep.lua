-- KEEP: keep the entries this consumer still holds: reset their idle time (heartbeat) or
-- set it past the claim time (hand back), without counting a delivery. An entry another
-- worker claimed meanwhile is left alone (a plain XCLAIM would steal it back) and reported.
-- KEYS: none
-- ARGV: group, consumer, idle ms, then stream/entry id pairs
-- Reply: the entry ids that are no longer this consumer's
local group, consumer, idle = ARGV[1], ARGV[2], ARGV[3]
local gone = {}
for i = 4, #ARGV, 2 do
  local stream, id = ARGV[i], ARGV[i + 1]
  local mine = redis.pcall('XPENDING', stream, group, id, id, 1, consumer)
  if not mine.err and #mine == 1 then
    redis.call('XCLAIM', stream, group, consumer, 0, id, 'IDLE', idle, 'JUSTID')
  else
    gone[#gone + 1] = id
  end
end
return gone
