-- RECLAIM: take over the entries of workers that stopped heartbeating: XAUTOCLAIM on
-- every queue of the served models (a delivery is counted: their worker is presumed dead).
-- KEYS: none
-- ARGV: namespace, group, consumer, min idle ms, most entries, then the model names
-- Reply: {stream, entry id, fields or false (trimmed while pending), deliveries} per entry
-- include: queues.lua
local ns, group, consumer, idle, left = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local names = {}
for i = 6, #ARGV do names[#names + 1] = ARGV[i] end
local out = {}
for _, q in ipairs(queues(ns, names)) do
  if left <= 0 then break end
  local got = redis.pcall('XAUTOCLAIM', q.key, group, consumer, idle, '0-0', 'COUNT', left)
  if not got.err then
    for _, entry in ipairs(got[2]) do
      local row = redis.call('XPENDING', q.key, group, entry[1], entry[1], 1)
      out[#out + 1] = {q.key, entry[1], entry[2], row[1] and row[1][4] or 1}
      left = left - 1
    end
    for _, id in ipairs(got[3] or {}) do out[#out + 1] = {q.key, id, false, 0} end
  end
end
return out
