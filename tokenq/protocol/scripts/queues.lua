-- queues: a fragment (TAKE, RECLAIM and OWN include it).
-- queues(ns, names): the queues of the models a worker serves: every "<priority>:<tenant>"
-- member of each model's sorted set, lowest priority value first, then protocol 1's
-- stream (whose entries are answered with a clear error).
-- lane(prio): 1, 2 or 3 for interactive, default, batch.
-- entries_of(got): the entries of a one-stream XREADGROUP reply, in Redis's shape or
-- fakeredis's (the demo).
local function queues(ns, names)
  local out = {}
  for _, model in ipairs(names) do
    local members = redis.call('ZRANGE', ns .. ':queues:' .. model, 0, -1, 'WITHSCORES')
    for i = 1, #members, 2 do
      out[#out + 1] = {key = ns .. ':jobs:' .. model .. ':' .. members[i],
                       member = members[i], set = ns .. ':queues:' .. model,
                       prio = tonumber(members[i + 1])}
    end
  end
  table.sort(out, function(x, y) return x.prio < y.prio end)
  if redis.call('EXISTS', ns .. ':jobs') == 1 then
    out[#out + 1] = {key = ns .. ':jobs', prio = 0}
  end
  return out
end

local function lane(prio)
  if prio < 0 then return 1 elseif prio == 0 then return 2 else return 3 end
end

-- The entries of a one-stream XREADGROUP reply: {{key, entries}}, or nil when there are
-- none; fakeredis (the demo) answers {key, entries}, or an empty table.
local function entries_of(got)
  if not got or #got == 0 then return {} end
  if type(got[1]) == 'string' then return got[2] or {} end
  return got[1][2] or {}
end
