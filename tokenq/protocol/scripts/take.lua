-- TAKE: take entries for the engine's free slots, in the order docs/protocol.md promises:
-- a lane whose oldest undelivered job has waited past its lane's max wait first (oldest
-- first), then by priority (lower values first); among the queues of one priority (one
-- per tenant), one entry per tenant in turn from a rotating start. Each take uses a slot
-- of every lane. Queues left empty are dropped from their model's set (SUBMIT adds them
-- back, atomically). Each entry whose id field is a valid job id is started here as START
-- would (one round trip less), unless SUBMIT recorded another entry for its job.
-- KEYS: none
-- ARGV: namespace, group, consumer, now (ms), free slots per lane (3), max wait per lane
--       in ms (3; 0: never ages), round-robin offset, fencing token, owner ttl (s), then
--       the model names served
-- Reply: {{stream, entry id, fields, start_job's answer or false} per entry taken,
--         "1"/"0" per lane (its queues hold nothing more to deliver), the last doorbell
--         ring's id per model ("" for none)}: what the worker may believe until a
--         doorbell rings again
-- include: queues.lua
-- include: start_job.lua
local ns, group, consumer, now = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local caps = {tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])}
local max_wait = {tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])}
local rr, token, ttl = tonumber(ARGV[11]), ARGV[12], ARGV[13]
local names = {}
for i = 14, #ARGV do names[#names + 1] = ARGV[i] end

local function read(q, count)
  local got = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count,
                          'STREAMS', q.key, '>')
  if got and got.err then  -- a new queue: its group starts at its first entry
    local made = redis.pcall('XGROUP', 'CREATE', q.key, group, '0', 'MKSTREAM')
    if made.err and not string.find(made.err, '^BUSYGROUP') then return error(made) end
    got = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count,
                     'STREAMS', q.key, '>')
  end
  return entries_of(got)
end

-- When the oldest entry not yet delivered was added (ms), or nil.
local function head(q)
  local info = redis.pcall('XINFO', 'GROUPS', q.key)
  local from = '-'
  if not info.err then
    for _, g in ipairs(info) do
      for i = 1, #g, 2 do
        if g[i] == 'name' and g[i + 1] == group then
          for j = 1, #g, 2 do
            if g[j] == 'last-delivered-id' then from = '(' .. g[j + 1] end
          end
        end
      end
    end
  end
  local first = redis.pcall('XRANGE', q.key, from, '+', 'COUNT', 1)
  if first.err or #first == 0 then return nil end
  return tonumber(string.match(first[1][1], '^(%d+)'))
end

local all = queues(ns, names)
local live, aged = {}, {}
for _, q in ipairs(all) do
  if redis.call('XLEN', q.key) == 0 then
    if q.set then
      redis.call('ZREM', q.set, q.member)
      redis.call('DEL', q.key)
    end
  else
    q.lane = lane(q.prio)
    local wait = max_wait[q.lane]
    local since = wait > 0 and head(q) or nil
    if since and now - since > wait then
      q.age = now - since
      aged[#aged + 1] = q
    else
      live[#live + 1] = q
    end
  end
end
table.sort(aged, function(x, y) return x.age > y.age end)

-- Levels: each aged queue alone, then the live queues grouped by priority.
local levels = {}
for _, q in ipairs(aged) do levels[#levels + 1] = {q} end
for _, q in ipairs(live) do
  local last = levels[#levels]
  if last and #aged < #levels and last[1].prio == q.prio then
    last[#last + 1] = q
  else
    levels[#levels + 1] = {q}
  end
end

local out = {}
local function take(q, n)
  local got = read(q, n)
  for _, entry in ipairs(got) do
    out[#out + 1] = {q.key, entry[1], entry[2]}
    for l = 1, 3 do caps[l] = math.max(0, caps[l] - 1) end
  end
  q.short = #got < n  -- the last read found no more
  if #got > 0 then q.last = got[#got][1] end
  return #got
end

for _, level in ipairs(levels) do
  if #level == 1 then
    local q = level[1]
    if caps[q.lane] > 0 then take(q, caps[q.lane]) end
  else
    local open = {}
    for i = 1, #level do open[i] = level[((i - 1 + rr) % #level) + 1] end
    while #open > 0 do
      local next_round = {}
      for _, q in ipairs(open) do
        if caps[q.lane] > 0 and take(q, 1) > 0 then next_round[#next_round + 1] = q end
      end
      open = next_round
    end
  end
end

-- The id of a stream's newest entry, or nil.
local function newest(key)
  local top = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
  return top[1] and top[1][1]
end

-- A queue is drained when its last read came up short, or ended at its newest entry.
local drained = {1, 1, 1}
for _, qs in ipairs({live, aged}) do
  for _, q in ipairs(qs) do
    if not (q.short or (q.last and newest(q.key) == q.last)) then drained[q.lane] = 0 end
  end
end
local rings = {}
for i, model in ipairs(names) do rings[i] = newest(ns .. ':bell:' .. model) or '' end

-- The job id as the worker reads it (tokenq.protocol.JOB_ID_RE), or nil.
local function job_id(fields)
  for i = 1, #fields, 2 do
    if fields[i] == 'id' then
      local jid = fields[i + 1]
      if #jid <= 128 and string.match(jid, '^[%w_][%w_.:%-]*$') then return jid end
      return nil
    end
  end
  return nil
end

for _, row in ipairs(out) do
  local jid = job_id(row[3])
  row[4] = false
  if jid then
    local k = ns .. ':'
    local own = redis.call('GET', k .. 'entry:' .. jid)
    if not own or own == row[1] .. ' ' .. row[2] then
      row[4] = start_job(k .. 'job:' .. jid, k .. 'owner:' .. jid, k .. 'cancel:' .. jid,
                         k .. 'reply:' .. jid, token, ttl, true)
    end
  end
end
return {out, table.concat(drained), rings}
