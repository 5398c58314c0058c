-- PUBLISH: write reply events and settle job stream entries; the publisher sends every
-- job's share of a step in one call. Arguments are compact: each item is one header
-- argument, then its events (a type letter followed by the msgpack data), then its dead
-- letter; the job's keys are built here from the namespace (one Redis, not a cluster).
-- KEYS: the dead-letter stream
-- ARGV: fencing token, consumer, group, running ttl, reply ttl, dead-letter maxlen,
--       namespace, webhook state ttl, then per item: "mode job stream entry backlog first
--       status release #events #dead #hooks [weight]" ("-" for none; the weight, the
--       entry's `w` field, only when above 1), the events, the dead letter's field/value
--       pairs, then per webhook event "seq stream" and its msgpack payload
-- Reply: two characters per item: its outcome (o ok, l lost, g gone, k kept, r run again)
--        and whether the job's cancel key is set (0/1)
-- Modes:
-- "run": a job this worker runs, fenced by the owner key. Events go to their sequence ids
--   and only those above the stream's top are written, so a re-sent call adds nothing.
--   Status "running" marks the job started; "done"/"error" ends it and acknowledges the
--   entry (XACK, XDEL, and its lane's backlog counter, less the entry's weight, never
--   below 0) with the final event. Outcome ok, or lost when another worker took the job
--   over.
-- "check": as "run", on a Redis Cluster, where a failover can lose what a primary had not
--   yet replicated: the stream must hold every event below `first`, else nothing is written
--   and the outcome is r (run again: the worker hands the entry back, and a re-run
--   continues from the events the stream still holds).
-- "settle": an entry that ends without running (rejected, a duplicate, cancelled before
--   it started), guarded by the entry still being pending for this consumer (else gone:
--   settled already, reclaimed elsewhere, or its queue dropped with its group). Its event
--   is written only if the job has not ended, runs nowhere and, while queued, this is its
--   own entry (the one SUBMIT recorded; else kept): one terminal event per job, always.
--   Release "1": this worker took the job's owner key for this entry, and frees it.
-- "orphan": an entry Redis already dropped from the pending list (XAUTOCLAIM reports
--   trimmed entries so): only its dead letter is written.
-- Webhook events go to their stream (the queue's `hooks` stream, docs/protocol.md) only
-- with the events they follow: with a fenced "run" write, and a job's completed event only
-- with its terminal event. Each carries its seq and the seq of the job's previous webhook
-- event (`prev`, -1 for none: dispatchers deliver in that order); one whose seq is not
-- above the job's last (a re-sent call, a re-run) is not written again.
local token, consumer, group = ARGV[1], ARGV[2], ARGV[3]
local running_ttl, reply_ttl, dead_maxlen, ns = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local hook_ttl = ARGV[8]
local dead = KEYS[1]
local TYPES = {t = 'token', d = 'done', e = 'error', r = 'restart'}

-- The sequence number of the reply stream's last event (0: empty). Workers write ids
-- 0-1, 0-2, ...; a stream holding other ids (or a key of another type) is foreign, and
-- gets auto ids without the duplicate guard rather than an error that would stop the job.
local function last_seq(reply)
  local top = redis.pcall('XREVRANGE', reply, '+', '-', 'COUNT', 1)
  if top.err or #top == 0 then return 0 end
  local ms, seq = string.match(top[1][1], '^(%d+)-(%d+)$')
  if ms ~= '0' then return -1 end
  return tonumber(seq)
end

-- One event (its type's letter, then its data) at `id`; false if the stream refused that
-- id (at or below its top: a re-sent call) or the key is no stream. Any other refusal (out
-- of memory) ends the call with that error: Redis refuses a write for memory only while
-- the call has written nothing yet, so it is tried again whole (a refused event taken for
-- a duplicate would be lost, and its entry acknowledged all the same).
local function add(reply, id, ev)
  local t, d = TYPES[string.sub(ev, 1, 1)], string.sub(ev, 2)
  local done = redis.pcall('XADD', reply, id, 'type', t, 'data', d)
  if not done.err then return true end
  if string.find(done.err, 'equal or smaller', 1, true) or string.find(done.err, '^WRONGTYPE') then
    return false
  end
  return error(done)
end

-- Events go to ids 0-first, 0-first+1, ...; the usual call finds the stream ending just
-- below `first`, and its first XADD shows that without a read (Redis refuses an id at or
-- below the stream's top); only a refused one (a re-sent call, a foreign stream) reads the
-- top to decide which events are still missing.
local function append(reply, first, a, n)
  if n == 0 then return end
  local k0, last = 1, first - 1
  if not add(reply, '0-' .. first, ARGV[a]) then
    k0, last = 0, last_seq(reply)
  end
  for k = k0, n - 1 do
    if last < 0 then
      add(reply, '*', ARGV[a + k])
    elseif first + k > last then
      add(reply, '0-' .. (first + k), ARGV[a + k])
    end
  end
end

-- Whether the entry is pending for this consumer. A queue dropped meanwhile (TAKE deletes
-- an emptied queue with its group, which the first send of a re-sent call may have
-- emptied) holds nothing pending: NOGROUP answers no, never an error.
local function mine(stream, entry)
  local rows = redis.pcall('XPENDING', stream, group, entry, entry, 1, consumer)
  return not rows.err and #rows == 1
end

-- The entry's weight (its job's n outputs, as SUBMIT counted it) comes off the backlog.
local function ack(stream, entry, backlog, weight)
  redis.pcall('XACK', stream, group, entry)  -- NOGROUP: a dropped queue, nothing to ack
  if redis.call('XDEL', stream, entry) == 1 and backlog ~= '-' then
    local have = tonumber(redis.call('GET', backlog) or '0')
    if have > 0 then redis.call('DECRBY', backlog, math.min(have, weight)) end
  end
end

-- The job's end: its job key says so for as long as the key lives. A job without one (a
-- producer that skipped SUBMIT, or a key expired) gets it, for as long as its reply lives,
-- so that a later entry with its id finds the job ended and adds no second terminal event.
local function finish(job, status)
  if not redis.call('SET', job, status, 'XX', 'KEEPTTL') then
    redis.call('SET', job, status, 'EX', reply_ttl)
  end
end

local function add_dead(first, n)
  if n > 0 then
    redis.call('XADD', dead, 'MAXLEN', '~', dead_maxlen, '*', unpack(ARGV, first, first + n - 1))
  end
end

-- A job's webhook events, in order, each once; `n` of them from ARGV[h].
local function add_hooks(jid, h, n)
  if n == 0 then return end
  local state = ns .. ':hook:' .. jid
  local last = tonumber(redis.call('HGET', state, 'last') or '-1')
  for k = 0, n - 1 do
    local seq, hooks = string.match(ARGV[h + 2 * k], '^(%d+) (%S+)$')
    if tonumber(seq) > last then
      redis.call('XADD', hooks, '*', 'job', jid, 'seq', seq, 'prev', last, 'data', ARGV[h + 2 * k + 1])
      last = tonumber(seq)
      redis.call('HSET', state, 'last', seq)
    end
  end
  redis.call('EXPIRE', state, hook_ttl)
end

local out = {}
local a = 9
while a <= #ARGV do
  local mode, jid, stream, entry, backlog, first, status, release, nev, ndead, nhooks, weight =
    string.match(ARGV[a],
      '^(%S+) (%S+) (%S+) (%S+) (%S+) (%d+) (%S+) (%d) (%d+) (%d+) (%d+) ?(%d*)$')
  first, nev, ndead, nhooks = tonumber(first), tonumber(nev), tonumber(ndead), tonumber(nhooks)
  weight = tonumber(weight) or 1
  if status == '-' then status = '' end
  local ev = a + 1
  local dl = ev + nev
  local hk = dl + ndead
  a = hk + 2 * nhooks
  local outcome, cancelled = 'o', 0
  local owner, reply = ns .. ':owner:' .. jid, ns .. ':reply:' .. jid
  local job, cancel = ns .. ':job:' .. jid, ns .. ':cancel:' .. jid
  local holder = false
  if jid ~= '-' then
    holder = redis.call('GET', owner)
    cancelled = redis.call('EXISTS', cancel)
  end
  local top = mode == 'check' and first > 1 and holder == token and last_seq(reply)
  if top and top >= 0 and top < first - 1 then
    outcome = 'r'  -- events this worker wrote are gone (a failover): run again from the rest
  elseif mode == 'run' or mode == 'check' then
    if holder == token then
      append(reply, first, ev, nev)
      add_hooks(jid, hk, nhooks)
      if status == 'running' then
        redis.call('SET', job, 'running', 'XX', 'KEEPTTL')
        redis.call('EXPIRE', reply, running_ttl)
      elseif status ~= '' then
        redis.call('EXPIRE', reply, reply_ttl)
        finish(job, status)
        redis.call('DEL', owner, cancel, ns .. ':entry:' .. jid)
        ack(stream, entry, backlog, weight)
        add_dead(dl, ndead)
      end
    elseif holder or status == '' or status == 'running' or last_seq(reply) < first + nev - 1 then
      -- (a foreign stream reads as -1: lost, which only stops this worker writing to it)
      outcome = 'l'
    end
    -- else: the owner key is gone and every event is there: this call's first send
    -- landed (it ended the job) and its reply was lost.
  elseif mode == 'orphan' then
    add_dead(dl, ndead)
  elseif not mine(stream, entry) then
    outcome = 'g'
  else
    if nev > 0 and jid ~= '-' then
      local state = redis.call('GET', job)
      local elsewhere = holder and (holder ~= token or release ~= '1')
      -- a job still queued whose own entry is another: this entry only borrows its id
      local own = redis.call('GET', ns .. ':entry:' .. jid)
      local borrowed = not holder and own and own ~= stream .. ' ' .. entry
      if state == 'done' or state == 'error' or elsewhere or borrowed then
        outcome = 'k'
      else
        append(reply, last_seq(reply) + 1, ev, nev)
        add_hooks(jid, hk, nhooks)
        redis.call('EXPIRE', reply, reply_ttl)
        if status ~= '' then finish(job, status) end
        redis.call('DEL', cancel, ns .. ':entry:' .. jid)
      end
    end
    if release == '1' and holder == token then redis.call('DEL', owner) end
    add_dead(dl, ndead)
    ack(stream, entry, backlog, weight)
  end
  out[#out + 1] = outcome .. cancelled
end
return table.concat(out)
