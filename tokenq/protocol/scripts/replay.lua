-- REPLAY: put a dead letter's job back on its queue (tokenq.ops.dlq): refuse if the dead
-- letter is gone or the job key holds anything but "error"; refuse, changing nothing, if
-- the lane is full (counting the job's weight, its n outputs); else clear the job's keys so
-- it starts over, SUBMIT it, and delete the dead letter.
-- KEYS: the dead-letter stream, then the job's job, reply, owner and cancel keys
-- ARGV: the dead letter's id, then SUBMIT's arguments for this one job
-- Reply: SUBMIT's answer, or {"gone"}, or {"state", <job key value>}
local dead, job = KEYS[1], KEYS[2]
if #redis.call('XRANGE', dead, ARGV[1], ARGV[1]) == 0 then return {'gone'} end
local state = redis.call('GET', job)
if state and state ~= 'error' then return {'state', state} end
local args = {unpack(ARGV, 2)}
local ns, model, lane, weight = args[1], args[7], args[10], tonumber(args[13])
local caps = {interactive = tonumber(args[3]), default = tonumber(args[4]),
              batch = tonumber(args[5])}
local have = tonumber(redis.call('GET', ns .. ':backlog:' .. model .. ':' .. lane) or '0')
if have + weight > caps[lane] then return {'full', lane, have, caps[lane], model} end
redis.call('DEL', job, KEYS[3], KEYS[4], KEYS[5])
-- SUBMIT, verbatim, reading its arguments from the table passed in.
local function submit(ARGV)
-- include: submit.lua
end
local answer = submit(args)
redis.call('XDEL', dead, ARGV[1])
return answer
