-- OWN: this consumer's own pending entries on every queue. "look" (after a Redis failure)
-- reads them with XPENDING + XRANGE, counting no delivery, so an entry whose delivery
-- answer was lost is found; "replay" (at start-up) reads them with XREADGROUP from 0,
-- which counts one (the process that held them died).
-- KEYS: none
-- ARGV: namespace, group, consumer, "replay" or "look", then the model names
-- Reply: {stream, entry id, deliveries, fields or false (trimmed)} per entry
-- include: queues.lua
local ns, group, consumer, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local names = {}
for i = 5, #ARGV do names[#names + 1] = ARGV[i] end
local out = {}
for _, q in ipairs(queues(ns, names)) do
  local rows = redis.pcall('XPENDING', q.key, group, '-', '+', 10000, consumer)
  if not rows.err and #rows > 0 then
    local counts = {}
    for _, row in ipairs(rows) do counts[row[1]] = row[4] end
    if mode == 'replay' then
      local got = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 10000,
                             'STREAMS', q.key, '0')
      for _, entry in ipairs(entries_of(got)) do
        out[#out + 1] = {q.key, entry[1], counts[entry[1]] + 1, entry[2] or false}
      end
    else
      for _, row in ipairs(rows) do
        local found = redis.call('XRANGE', q.key, row[1], row[1])
        out[#out + 1] = {q.key, row[1], row[4], found[1] and found[1][2] or false}
      end
    end
  end
end
return out
