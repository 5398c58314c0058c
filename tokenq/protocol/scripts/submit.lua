-- SUBMIT: queue jobs, atomically: all of them, or none when a lane is full. An id already
-- taken (the job key exists) is a duplicate and adds nothing: job ids are idempotency
-- keys, and a submit re-sent after a lost answer finds its own jobs this way. Each job's
-- own entry is recorded, so that a worker refusing some other entry that names the job (a
-- broken or forged one) leaves the queued job alone. One doorbell ring per model.
-- A job's weight is its number of outputs (n): it counts that much toward its lane's cap
-- and backlog counter, as n jobs of one would; a weight above 1 is kept in the entry
-- (field `w`) for the worker, whose acknowledgement takes it off the counter again.
-- KEYS: none
-- ARGV: namespace, job ttl, the lane caps (interactive, default, batch), then per job:
--       id, model, priority, tenant, lane, protocol version, payload, weight
-- Reply: {"ok", {1 if duplicate else 0, ...}} or {"full", lane, backlog, cap, model}
local ns, ttl = ARGV[1], ARGV[2]
local caps = {interactive = tonumber(ARGV[3]), default = tonumber(ARGV[4]),
              batch = tonumber(ARGV[5])}
local dup, fresh, adds, seen = {}, {}, {}, {}
for b = 6, #ARGV, 8 do
  local jid = ARGV[b]
  if seen[jid] or redis.call('EXISTS', ns .. ':job:' .. jid) == 1 then
    dup[#dup + 1] = 1
  else
    dup[#dup + 1] = 0
    seen[jid] = true
    fresh[#fresh + 1] = b
    local lane_key = ARGV[b + 1] .. ' ' .. ARGV[b + 4]  -- model names hold no spaces
    adds[lane_key] = (adds[lane_key] or 0) + tonumber(ARGV[b + 7])
  end
end
local backlogs = {}
for lane_key, count in pairs(adds) do
  local model, lane = string.match(lane_key, '^(%S+) (%S+)$')
  local backlog = ns .. ':backlog:' .. model .. ':' .. lane
  local have = tonumber(redis.call('GET', backlog) or '0')
  if have + count > caps[lane] then return {'full', lane, have, caps[lane], model} end
  backlogs[backlog] = count
end
local listed, models = {}, {}  -- each queue is listed once: a burst mostly fills one
for _, b in ipairs(fresh) do
  local jid, model, prio, tenant = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
  redis.call('SET', ns .. ':job:' .. jid, 'queued', 'EX', ttl)
  local queue = ns .. ':jobs:' .. model .. ':' .. prio .. ':' .. tenant
  if not listed[queue] then
    redis.call('ZADD', ns .. ':queues:' .. model, prio, prio .. ':' .. tenant)
    listed[queue], models[model] = true, true
  end
  local eid
  if tonumber(ARGV[b + 7]) > 1 then
    eid = redis.call('XADD', queue, '*', 'v', ARGV[b + 5], 'id', jid, 'data', ARGV[b + 6],
                     'w', ARGV[b + 7])
  else
    eid = redis.call('XADD', queue, '*', 'v', ARGV[b + 5], 'id', jid, 'data', ARGV[b + 6])
  end
  -- entry ids are unique only within a stream: the queue is part of the record
  redis.call('SET', ns .. ':entry:' .. jid, queue .. ' ' .. eid, 'EX', ttl)
end
for backlog, count in pairs(backlogs) do redis.call('INCRBY', backlog, count) end
for model in pairs(models) do
  redis.call('XADD', ns .. ':bell:' .. model, 'MAXLEN', '1', '*', 'b', '1')
end
return {'ok', dup}
