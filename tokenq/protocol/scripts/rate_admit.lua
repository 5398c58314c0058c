-- RATE_ADMIT: one request of an API key against the key's budgets, the same for every
-- gateway: requests and tokens over the last minute (counts per second in one hash, the
-- last 61 seconds summed, so that no span of 60 seconds ever holds more than a limit),
-- jobs running at once (a sorted set of job ids, scored by when their claim lapses), and
-- the job an Idempotency-Key was first sent for. Nothing is counted unless all pass. A
-- job that exists already (a retry attaching to it) costs a request, no tokens, no slot.
-- KEYS: the key's counts (hash: "r:<second>" requests, "t:<second>" tokens), its running
--       jobs (sorted set), the digest of the job's request (string), the job key (on a
--       Redis Cluster, where the job key lies in another slot: absent)
-- ARGV: requests a minute, tokens a minute, jobs at once (0: no limit), the request's
--       tokens, job id, seconds a running claim lasts, the request's digest ("" for
--       none: no Idempotency-Key), how long the digest is kept (s); without the job key,
--       1 if the job exists (as its caller read it just before), else 0
-- Reply: {"ok", second charged, requests, tokens (in the window, this one's included),
--         ms until the counted requests and the counted tokens have all left it, 1 if
--         the job existed}
--        {"reused"}: the Idempotency-Key was first sent with another request
--        {"limited", "requests" | "tokens" | "concurrent" | "too_large", ms to wait,
--         requests, tokens, ms until they have left the window (2)}
local rpm, tpm, cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, jid, hold, digest = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]), ARGV[7]
if digest ~= '' then
  local seen = redis.call('GET', KEYS[3])
  if seen and seen ~= digest then return {'reused'} end
end
local existed
if KEYS[4] then existed = redis.call('EXISTS', KEYS[4]) == 1 else existed = ARGV[9] == '1' end
if existed then cost = 0 end
local clock = redis.call('TIME')
local sec = tonumber(clock[1])
local now_ms = sec * 1000 + math.floor(tonumber(clock[2]) / 1000)
local window = {r = {}, t = {}}
local total = {r = 0, t = 0}
local newest = {r = -1, t = -1}
local stale = {}
local flat = redis.call('HGETALL', KEYS[1])
for i = 1, #flat, 2 do
  local kind, at = string.sub(flat[i], 1, 1), tonumber(string.sub(flat[i], 3))
  local n = tonumber(flat[i + 1])
  if at < sec - 60 then
    stale[#stale + 1] = flat[i]
  else
    window[kind][#window[kind] + 1] = {at, n}
    total[kind] = total[kind] + n
    if at > newest[kind] then newest[kind] = at end
  end
end
if #stale > 0 then redis.call('HDEL', KEYS[1], unpack(stale)) end
-- A second's counts leave the window 61 s after that second began.
local function leaves(at) return math.max(0, (at + 61) * 1000 - now_ms) end
local function wait(kind, need, limit)
  table.sort(window[kind], function(a, b) return a[1] < b[1] end)
  local left = total[kind]
  for _, bucket in ipairs(window[kind]) do
    left = left - bucket[2]
    if left + need <= limit then return leaves(bucket[1]) end
  end
  return 0
end
local function refused(what, ms)
  local r = newest.r >= 0 and leaves(newest.r) or 0
  local t = newest.t >= 0 and leaves(newest.t) or 0
  return {'limited', what, ms, total.r, total.t, r, t}
end
if tpm > 0 and cost > tpm then return refused('too_large', 0) end
if rpm > 0 and total.r + 1 > rpm then return refused('requests', wait('r', 1, rpm)) end
if tpm > 0 and total.t + cost > tpm then return refused('tokens', wait('t', cost, tpm)) end
local claim = not existed and cap > 0
if claim then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
  if not redis.call('ZSCORE', KEYS[2], jid) and redis.call('ZCARD', KEYS[2]) >= cap then
    return refused('concurrent', 1000)
  end
end
if rpm > 0 then
  redis.call('HINCRBY', KEYS[1], 'r:' .. sec, 1)
  total.r, newest.r = total.r + 1, sec
end
if tpm > 0 and cost > 0 then
  redis.call('HINCRBY', KEYS[1], 't:' .. sec, cost)
  total.t, newest.t = total.t + cost, sec
end
if rpm > 0 or tpm > 0 then redis.call('EXPIRE', KEYS[1], 62) end
if claim then
  redis.call('ZADD', KEYS[2], now_ms + hold * 1000, jid)
  if redis.call('PTTL', KEYS[2]) < hold * 1000 then redis.call('PEXPIRE', KEYS[2], hold * 1000) end
end
if digest ~= '' then redis.call('SET', KEYS[3], digest, 'EX', ARGV[8]) end
local r = newest.r >= 0 and leaves(newest.r) or 0
local t = newest.t >= 0 and leaves(newest.t) or 0
return {'ok', sec, total.r, total.t, r, t, existed and 1 or 0}
