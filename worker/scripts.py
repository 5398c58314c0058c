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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from tokenq.producer.protocol import DONE, ERROR, RESTART, TOKEN, Event, Keys, pack

# Start jobs: claim the owner key (fencing) and read what the reply stream already holds,
# in one step, unless the job is finished or (a fresh duplicate entry) runs elsewhere.
#   KEYS: per job: job key, owner key, cancel key, reply key
#   ARGV: token, owner ttl (s), then per job: "1" if this entry is a first delivery
#   ->    per job: {verdict, cancelled, reply entries}; verdict is
#         "finished" | "elsewhere" (another owner holds it) | "start" (owner key taken)
START = """
local token, ttl = ARGV[1], ARGV[2]
local out = {}
for i = 0, #KEYS / 4 - 1 do
  local job, owner, cancel, reply = KEYS[4*i+1], KEYS[4*i+2], KEYS[4*i+3], KEYS[4*i+4]
  local status = redis.call('GET', job)
  local holder = redis.call('GET', owner)
  local cancelled = redis.call('EXISTS', cancel)
  if status == 'done' or status == 'error' then
    out[i+1] = {'finished', cancelled, {}}
  elseif holder and holder ~= token and ARGV[3+i] == '1' then
    out[i+1] = {'elsewhere', cancelled, {}}
  else
    redis.call('SET', owner, token, 'EX', ttl)
    out[i+1] = {'start', cancelled, redis.call('XRANGE', reply, '-', '+')}
  end
end
return out
"""

# Write reply events and settle job stream entries. Called once per engine step with every
# job's share, so its arguments are compact: each item is one header argument followed by
# its events (each one argument: a letter for the type, then the msgpack data), and the
# job's keys are built here from the namespace (tokenq needs one Redis, not a cluster).
#   KEYS: the job stream, the dead-letter stream
#   ARGV: token, consumer, group, running ttl, reply ttl, dead-letter maxlen, namespace,
#         then per item: "mode job entry first status release #events #dead" ("-" for
#         none), the events, the dead letter's field/value pairs
#   ->    a string of two characters per item: outcome (o ok, l lost, g gone, k kept) and
#         whether the job's cancel key is set (0/1)
# mode "run": a job this worker runs. Fenced by the owner key; events go to their sequence
#   ids and only those above the stream's last id are written, so a re-sent call adds
#   nothing. status "running" marks the job started; "done"/"error" is its end: the entry
#   is acknowledged (XACK, XDEL) with the final event. outcome ok, or lost when another
#   worker took the job over.
# mode "settle": an entry that ends without running (rejected, duplicate, cancelled before
#   it started). Guarded by the entry still being pending for this consumer (else gone:
#   settled already, or reclaimed by another worker). Its event is written only if the job
#   has not ended and runs nowhere (else kept): one terminal event per job, always. With
#   release "1" the entry is one this worker took the job for (the owner key is ours and
#   ends with it); without, a job whose owner key is ours runs here from another entry.
# mode "orphan": an entry that Redis already dropped from the pending list (XAUTOCLAIM
#   reports trimmed entries that way): only its dead letter is written.
PUBLISH = """
local token, consumer, group = ARGV[1], ARGV[2], ARGV[3]
local running_ttl, reply_ttl, dead_maxlen, ns = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local stream, dead = KEYS[1], KEYS[2]
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

local function append(reply, first, a, n)
  local last = last_seq(reply)
  for k = 0, n - 1 do
    local ev = ARGV[a + k]
    local t, d = TYPES[string.sub(ev, 1, 1)], string.sub(ev, 2)
    if last < 0 then
      redis.pcall('XADD', reply, '*', 'type', t, 'data', d)
    elseif first + k > last then
      redis.pcall('XADD', reply, '0-' .. (first + k), 'type', t, 'data', d)
    end
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
  local mode, jid, entry, first, status, release, nev, ndead = string.match(ARGV[a],
    '^(%S+) (%S+) (%S+) (%d+) (%S+) (%d) (%d+) (%d+)$')
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
        redis.call('SET', job, status, 'XX', 'KEEPTTL')
        redis.call('DEL', owner, cancel)
        redis.call('XACK', stream, group, entry)
        redis.call('XDEL', stream, entry)
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
  elseif #redis.call('XPENDING', stream, group, entry, entry, 1, consumer) == 0 then
    outcome = 'g'
  else
    if nev > 0 and jid ~= '-' then
      local state = redis.call('GET', job)
      local elsewhere = holder and (holder ~= token or release ~= '1')
      if state == 'done' or state == 'error' or elsewhere then
        outcome = 'k'
      else
        append(reply, last_seq(reply) + 1, ev, nev)
        redis.call('EXPIRE', reply, reply_ttl)
        if status ~= '' then redis.call('SET', job, status, 'XX', 'KEEPTTL') end
        redis.call('DEL', cancel)
      end
    end
    if release == '1' and holder == token then redis.call('DEL', owner) end
    add_dead(dl, ndead)
    redis.call('XACK', stream, group, entry)
    redis.call('XDEL', stream, entry)
  end
  out[#out + 1] = outcome .. cancelled
end
return table.concat(out)
"""

# Keep entries this consumer still holds: reset their idle time (heartbeat) or set it past
# the claim time (hand back), without bumping delivery counts. An entry another worker has
# claimed meanwhile is left alone (a plain XCLAIM would steal it back) and reported.
#   KEYS[1] the job stream; ARGV: group, consumer, idle ms, entry ids
#   ->    the entry ids that are no longer this consumer's
KEEP = """
local stream, group, consumer, idle = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local gone = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  if #redis.call('XPENDING', stream, group, id, id, 1, consumer) == 1 then
    redis.call('XCLAIM', stream, group, consumer, 0, id, 'IDLE', idle, 'JUSTID')
  else
    gone[#gone + 1] = id
  end
end
return gone
"""


@dataclass
class StartResult:
    verdict: str  # "finished", "elsewhere" or "start"
    cancelled: bool
    reply: list[tuple[bytes, dict[bytes, bytes]]]


@dataclass
class Item:
    """One job's or entry's share of a PUBLISH call."""

    mode: str  # "run", "settle" or "orphan"
    entry_id: bytes
    job_id: str | None
    first_seq: int = 0  # "run": the sequence id of events[0]
    status: str = ""  # "", "running", "done", "error"
    events: list[bytes] = field(default_factory=list)  # event_arg() of each
    dead: dict[str, Any] | None = None  # a dead-letter entry to add
    release: bool = False  # "settle": this worker took the job's owner key for this entry


OUTCOMES = {b"o": "ok", b"l": "lost", b"g": "gone", b"k": "kept"}
TYPE_LETTERS = {TOKEN: b"t", DONE: b"d", ERROR: b"e", RESTART: b"r"}


def event_arg(event: Event) -> bytes:
    """An event as one PUBLISH argument: its type's letter, then its msgpack data."""
    return TYPE_LETTERS[event.type] + pack(event.to_data())


class Scripts:
    """The three scripts bound to one connection and namespace."""

    def __init__(self, conn: redis.Redis, keys: Keys, group: str, consumer: str) -> None:
        self.keys = keys
        self.group = group
        self.consumer = consumer
        self._start = conn.register_script(START)
        self._publish = conn.register_script(PUBLISH)
        self._keep = conn.register_script(KEEP)

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
        rows = self._start(keys=keys, args=args)
        return [
            StartResult(
                verdict.decode(),
                bool(cancelled),
                [(eid, _pairs(fields)) for eid, fields in reply],
            )
            for verdict, cancelled, reply in rows
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
            dead = [x for pair in (it.dead or {}).items() for x in pair]
            header = (
                f"{it.mode} {it.job_id or '-'} {it.entry_id.decode()} {it.first_seq} "
                f"{it.status or '-'} {int(it.release)} {len(it.events)} {len(dead)}"
            )
            args.append(header)
            args += it.events
            args += dead
        answer = self._publish(keys=[self.keys.jobs, self.keys.dead], args=args)
        return [
            (OUTCOMES[answer[i : i + 1]], answer[i + 1 : i + 2] == b"1")
            for i in range(0, len(answer), 2)
        ]

    def keep(self, entry_ids: Sequence[bytes], idle_ms: int = 0) -> set[bytes]:
        """Heartbeat (idle 0) or hand back (idle = claim time) this consumer's entries;
        returns those it no longer holds."""
        if not entry_ids:
            return set()
        args = [self.group, self.consumer, idle_ms, *entry_ids]
        return set(self._keep(keys=[self.keys.jobs], args=args))


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))
