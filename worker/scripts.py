"""The worker's multi-key Redis operations, as Lua scripts: each runs atomically and can be
sent again after a lost reply without doing anything twice.

Why scripts and not MULTI/EXEC: a transaction whose reply is lost (a cut connection, a
Redis stall past the socket timeout) cannot be told apart from one that never ran, and
redis-py reports a disconnect under WATCH as a WatchError. Each script below guards itself
(by the owner key, by the entry still being pending for this consumer, by the sequence
ids of the reply stream), so the worker simply sends it again until it gets an answer.

The loop (worker/loop.py) calls these where it needs them; this module only builds the
arguments and holds the scripts.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import hiredis
import redis
from redis.commands.core import Script

from tokenq.protocol import DONE, ERROR, RESTART, TOKEN, Event, Keys, pack

# Start a job: claim the owner key (fencing) and read what the reply stream already holds,
# in one step, unless the job is finished or (a fresh duplicate entry) runs elsewhere.
# Returns {verdict, cancelled, reply entries}; verdict is "finished" | "elsewhere" (another
# owner holds it) | "start" (owner key taken). START runs it for entries a worker reclaimed
# or read back; TAKE runs it itself for the fresh entries it hands out.
START_JOB = """
local function start_job(job, owner, cancel, reply, token, ttl, fresh)
  local status = redis.call('GET', job)
  local holder = redis.call('GET', owner)
  local cancelled = redis.call('EXISTS', cancel)
  if status == 'done' or status == 'error' then
    return {'finished', cancelled, {}}
  elseif holder and holder ~= token and fresh then
    return {'elsewhere', cancelled, {}}
  end
  redis.call('SET', owner, token, 'EX', ttl)
  return {'start', cancelled, redis.call('XRANGE', reply, '-', '+')}
end
"""

#   KEYS: per job: job key, owner key, cancel key, reply key
#   ARGV: token, owner ttl (s), then per job: "1" if this entry is a first delivery
#   ->    per job: start_job's answer
START = (
    START_JOB
    + """
local token, ttl = ARGV[1], ARGV[2]
local out = {}
for i = 0, #KEYS / 4 - 1 do
  local k = 4 * i
  out[i+1] = start_job(KEYS[k+1], KEYS[k+2], KEYS[k+3], KEYS[k+4], token, ttl, ARGV[3+i] == '1')
end
return out
"""
)

# Write reply events and settle job stream entries. Called once per engine step with every
# job's share, so its arguments are compact: each item is one header argument followed by
# its events (each one argument: a letter for the type, then the msgpack data), and the
# job's keys are built here from the namespace (tokenq needs one Redis, not a cluster).
#   KEYS: the dead-letter stream
#   ARGV: token, consumer, group, running ttl, reply ttl, dead-letter maxlen, namespace,
#         then per item: "mode job stream entry backlog first status release #events #dead"
#         ("-" for none), the events, the dead letter's field/value pairs. Acknowledging
#         an entry (XACK, XDEL) also takes it off its lane's backlog counter.
#   ->    a string of two characters per item: outcome (o ok, l lost, g gone, k kept) and
#         whether the job's cancel key is set (0/1)
# mode "run": a job this worker runs. Fenced by the owner key; events go to their sequence
#   ids and only those above the stream's last id are written, so a re-sent call adds
#   nothing. status "running" marks the job started; "done"/"error" is its end: the entry
#   is acknowledged (XACK, XDEL) with the final event. outcome ok, or lost when another
#   worker took the job over.
# mode "settle": an entry that ends without running (rejected, duplicate, cancelled before
#   it started). Guarded by the entry still being pending for this consumer (else gone:
#   settled already, or reclaimed by another worker, or its queue dropped with its group
#   once a first send emptied it). Its event is written only if the job
#   has not ended, runs nowhere and, while queued, this is its own entry (the one SUBMIT
#   recorded; else kept): one terminal event per job, always. With
#   release "1" the entry is one this worker took the job for (the owner key is ours and
#   ends with it); without, a job whose owner key is ours runs here from another entry.
# mode "orphan": an entry that Redis already dropped from the pending list (XAUTOCLAIM
#   reports trimmed entries that way): only its dead letter is written.
PUBLISH = """
local token, consumer, group = ARGV[1], ARGV[2], ARGV[3]
local running_ttl, reply_ttl, dead_maxlen, ns = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
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

local function ack(stream, entry, backlog)
  redis.pcall('XACK', stream, group, entry)  -- NOGROUP: a dropped queue, nothing to ack
  if redis.call('XDEL', stream, entry) == 1 and backlog ~= '-' then
    if tonumber(redis.call('GET', backlog) or '0') > 0 then redis.call('DECR', backlog) end
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

local out = {}
local a = 8
while a <= #ARGV do
  local mode, jid, stream, entry, backlog, first, status, release, nev, ndead = string.match(
    ARGV[a], '^(%S+) (%S+) (%S+) (%S+) (%S+) (%d+) (%S+) (%d) (%d+) (%d+)$')
  first, nev, ndead = tonumber(first), tonumber(nev), tonumber(ndead)
  if status == '-' then status = '' end
  local ev = a + 1
  local dl = ev + nev
  a = dl + ndead
  local outcome, cancelled = 'o', 0
  local owner, reply = ns .. ':owner:' .. jid, ns .. ':reply:' .. jid
  local job, cancel = ns .. ':job:' .. jid, ns .. ':cancel:' .. jid
  local holder = false
  if jid ~= '-' then
    holder = redis.call('GET', owner)
    cancelled = redis.call('EXISTS', cancel)
  end
  if mode == 'run' then
    if holder == token then
      append(reply, first, ev, nev)
      if status == 'running' then
        redis.call('SET', job, 'running', 'XX', 'KEEPTTL')
        redis.call('EXPIRE', reply, running_ttl)
      elseif status ~= '' then
        redis.call('EXPIRE', reply, reply_ttl)
        finish(job, status)
        redis.call('DEL', owner, cancel, ns .. ':entry:' .. jid)
        ack(stream, entry, backlog)
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
        redis.call('EXPIRE', reply, reply_ttl)
        if status ~= '' then finish(job, status) end
        redis.call('DEL', cancel, ns .. ':entry:' .. jid)
      end
    end
    if release == '1' and holder == token then redis.call('DEL', owner) end
    add_dead(dl, ndead)
    ack(stream, entry, backlog)
  end
  out[#out + 1] = outcome .. cancelled
end
return table.concat(out)
"""

# Keep entries this consumer still holds: reset their idle time (heartbeat) or set it past
# the claim time (hand back), without bumping delivery counts. An entry another worker has
# claimed meanwhile is left alone (a plain XCLAIM would steal it back) and reported.
#   ARGV: group, consumer, idle ms, then stream/entry id pairs
#   ->    the entry ids that are no longer this consumer's
KEEP = """
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
"""

# The queues of the models a worker serves: every "<priority>:<tenant>" member of each
# model's sorted set, lowest priority value first, then protocol 1's stream (whose entries
# are answered with a clear error). Shared by the scripts below.
QUEUES = """
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
"""

# Take entries for the engine's free slots, in the order docs/protocol.md promises: a lane
# whose oldest undelivered job has waited past its lane's max wait first (oldest first),
# then by priority (interactive, default, batch; lower values first); among queues of one
# priority (one per tenant), one entry per tenant in turn from a rotating start, so no
# tenant's backlog holds up another's. Each take uses a slot of every lane. Queues left
# empty are dropped from their model's set (a submit adds them back, atomically).
# Each entry whose id field is a valid job id is started here too (start_job, as START:
# one round trip less before a job reaches the engine), unless SUBMIT recorded another
# entry for its job: one that borrows a queued job's id is left to the worker, which
# refuses it without touching that job, or starts it with START if it is a valid job.
#   ARGV: namespace, group, consumer, now (ms), free slots per lane (3), max wait per lane
#         in ms (3; 0: never ages), round-robin offset, fencing token, owner ttl (s), then
#         the model names served
# It also says what the worker may believe until a doorbell rings: which lanes it drained
# (their queues hold nothing more to deliver), and the last ring of each model's doorbell,
# whose submits this take has seen.
#   ->    {{stream, entry id, fields, start_job's answer or false} per entry taken,
#          '1' or '0' per lane (drained), the last ring's id per model ('' for none)}
TAKE = (
    QUEUES
    + START_JOB
    + """
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
"""
)

# Take over the entries of workers that stopped heartbeating: XAUTOCLAIM on every queue
# of the served models (this counts a delivery: their worker is presumed dead).
#   ARGV: namespace, group, consumer, min idle ms, most entries, then the model names
#   ->    {stream, entry id, fields or false (trimmed while pending)} per entry claimed
RECLAIM = (
    QUEUES
    + """
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
"""
)

# This consumer's own pending entries on every queue: after a Redis failure, read without
# counting a delivery (XPENDING + XRANGE: an entry whose delivery answer was lost is found);
# at start-up, read with XREADGROUP from 0, which counts one (the process that held them
# died).
#   ARGV: namespace, group, consumer, "replay" or "look", then the model names
#   ->    {stream, entry id, deliveries, fields or false (trimmed)} per entry
OWN = (
    QUEUES
    + """
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
"""
)


@dataclass
class StartResult:
    verdict: str  # "finished", "elsewhere" or "start"
    cancelled: bool
    reply: list[tuple[bytes, dict[bytes, bytes]]]


@dataclass
class Item:
    """One job's or entry's share of a PUBLISH call."""

    mode: str  # "run", "settle" or "orphan"
    stream: bytes  # the queue the entry came from
    entry_id: bytes
    job_id: str | None
    first_seq: int = 0  # "run": the sequence id of events[0]
    status: str = ""  # "", "running", "done", "error"
    events: list[bytes] = field(default_factory=list)  # event_arg() of each
    dead: dict[str, Any] | None = None  # a dead-letter entry to add
    release: bool = False  # "settle": this worker took the job's owner key for this entry
    backlog: str | None = None  # the lane's backlog counter, decremented on acknowledgement


OUTCOMES = {b"o": "ok", b"l": "lost", b"g": "gone", b"k": "kept"}
TYPE_LETTERS = {TOKEN: b"t", DONE: b"d", ERROR: b"e", RESTART: b"r"}


def event_arg(event: Event) -> bytes:
    """An event as one PUBLISH argument: its type's letter, then its msgpack data."""
    return TYPE_LETTERS[event.type] + pack(event.to_data())


@dataclass
class Taken:
    """An entry a script handed this worker."""

    stream: bytes
    entry_id: bytes
    fields: dict[bytes, bytes] | None  # None: trimmed from the stream while pending
    count: int = 1  # deliveries, this one included
    started: StartResult | None = None  # TAKE started its job already (as START would)


@dataclass
class TakeResult:
    """What TAKE handed this worker, and what it saw of the queues while doing so."""

    taken: list[Taken]
    drained: tuple[bool, bool, bool]  # per lane: its queues hold nothing more to deliver
    rings: dict[str, bytes]  # per model served: its doorbell's last ring, if it has one


class Scripts:
    """The worker's scripts bound to one connection, namespace and consumer."""

    def __init__(self, conn: redis.Redis, keys: Keys, group: str, consumer: str) -> None:
        self.keys = keys
        self.group = group
        self.consumer = consumer
        self._redis = conn
        self._start = conn.register_script(START)
        self._publish = conn.register_script(PUBLISH)
        self._keep = conn.register_script(KEEP)
        self._take = conn.register_script(TAKE)
        self._reclaim = conn.register_script(RECLAIM)
        self._own = conn.register_script(OWN)

    def start(
        self, token: bytes, owner_ttl_s: int, jobs: Sequence[tuple[str, bool]]
    ) -> list[StartResult]:
        """`jobs`: (job id, first delivery?)."""
        k = self.keys
        keys = [
            key
            for jid, _ in jobs
            for key in (k.job(jid), k.owner(jid), k.cancel(jid), k.reply(jid))
        ]
        args = [token, owner_ttl_s, *("1" if fresh else "0" for _, fresh in jobs)]
        return [_started(row) for row in self._start(keys=keys, args=args)]

    def take(
        self,
        names: Sequence[str],
        slots: Sequence[int],
        max_wait_ms: Sequence[int],
        turn: int,
        token: bytes,
        owner_ttl_s: int,
    ) -> TakeResult:
        """Entries for the free slots of each lane (interactive, default, batch), each with
        its job started as `start` would (unless its id field is not a job id); see TAKE."""
        args: list[Any] = [self.keys.namespace, self.group, self.consumer]
        args += [int(time.time() * 1000), *slots, *max_wait_ms, turn, token, owner_ttl_s]
        rows, drained, rings = self._take(args=[*args, *names])
        taken = [
            Taken(stream, eid, _pairs(fields), started=_started(start) if start else None)
            for stream, eid, fields, start in rows
        ]
        lanes = (drained[0:1] == b"1", drained[1:2] == b"1", drained[2:3] == b"1")
        return TakeResult(taken, lanes, {n: r for n, r in zip(names, rings, strict=True) if r})

    def reclaim(self, names: Sequence[str], idle_ms: int, most: int) -> list[Taken]:
        args = [self.keys.namespace, self.group, self.consumer, idle_ms, most, *names]
        return [
            Taken(stream, eid, _pairs(fields) if fields else None, int(count))
            for stream, eid, fields, count in self._reclaim(args=args)
        ]

    def own(self, names: Sequence[str], replay: bool) -> list[Taken]:
        args = [self.keys.namespace, self.group, self.consumer, "replay" if replay else "look"]
        rows = self._own(args=[*args, *names])
        return [
            Taken(stream, eid, _pairs(fields) if fields else None, int(count))
            for stream, eid, count, fields in rows
        ]

    def publish(
        self,
        token: bytes,
        items: Sequence[Item],
        running_ttl_s: int,
        reply_ttl_s: int,
        dead_maxlen: int,
    ) -> list[tuple[str, bool]]:
        """(outcome, cancel requested) per item; see PUBLISH."""
        args: list[Any] = [token, self.consumer, self.group, running_ttl_s, reply_ttl_s]
        args += [dead_maxlen, self.keys.namespace]
        for it in items:
            dead = [x for pair in it.dead.items() for x in pair] if it.dead else []
            head = _head(it.mode, it.job_id, it.stream, it.entry_id, it.backlog)
            args.append(
                f"{head} {it.first_seq} {it.status or '-'} {int(it.release)} "
                f"{len(it.events)} {len(dead)}"
            )
            args += it.events
            args += dead
        answer = self._evalsha(self._publish, [self.keys.dead], args)
        return [
            (OUTCOMES[answer[i : i + 1]], answer[i + 1 : i + 2] == b"1")
            for i in range(0, len(answer), 2)
        ]

    def _evalsha(self, script: Script, keys: list[Any], args: list[Any]) -> Any:
        """`script(keys, args)` on a connection of the client's pool, packed by hiredis in
        one call: redis-py's command path (its packer walks every argument in Python, then
        retries, events, observability) added about 100 us of CPU to a PUBLISH of 64 jobs,
        which the publisher sends every step. The pool hands out a live connection (it
        reconnects one Redis closed while it idled); a flushed script cache gets the
        script loaded again; any other failure raises as redis-py's would, for the
        caller's backoff to re-send (without redis-py's own retries). The connection is
        dropped unless a whole reply was read, so that a late reply never answers the
        next command."""
        pool = self._redis.connection_pool
        conn = pool.get_connection()
        try:
            try:
                return _evalsha_on(conn, script.sha, keys, args)
            except redis.exceptions.NoScriptError:  # a flushed script cache, another server
                script.sha = self._redis.script_load(script.script)
                return _evalsha_on(conn, script.sha, keys, args)
        except redis.ResponseError:
            raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def keep(self, entries: Sequence[tuple[bytes, bytes]], idle_ms: int = 0) -> set[bytes]:
        """Heartbeat (idle 0) or hand back (idle = claim time) this consumer's entries,
        given as (stream, entry id); returns the ids it no longer holds."""
        if not entries:
            return set()
        args: list[Any] = [self.group, self.consumer, idle_ms]
        for stream, eid in entries:
            args += [stream, eid]
        return set(self._keep(args=args))


def _evalsha_on(conn: Any, sha: str, keys: list[Any], args: list[Any]) -> Any:
    conn.send_packed_command([hiredis.pack_command(("EVALSHA", sha, len(keys), *keys, *args))])
    return conn.read_response()


@functools.lru_cache(maxsize=4096)
def _head(
    mode: str, job_id: str | None, stream: bytes, entry_id: bytes, backlog: str | None
) -> str:
    """The part of an item's PUBLISH header that stays the same for as long as its job
    runs: formatted once, not for each of the job's publishes (one a step)."""
    return f"{mode} {job_id or '-'} {stream.decode()} {entry_id.decode()} {backlog or '-'}"


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _started(row: list[Any]) -> StartResult:
    """start_job's answer."""
    verdict, cancelled, reply = row
    return StartResult(
        verdict.decode(), bool(cancelled), [(eid, _pairs(fields)) for eid, fields in reply]
    )
