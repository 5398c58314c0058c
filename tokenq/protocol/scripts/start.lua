-- START: start the jobs of entries a worker reclaimed or read back (TAKE starts the fresh
-- ones itself).
-- KEYS: per job: job key, owner key, cancel key, reply key
-- ARGV: fencing token, owner ttl (s), then per job: "1" if this entry is a first delivery
-- Reply: per job, start_job's answer
-- include: start_job.lua
local token, ttl = ARGV[1], ARGV[2]
local out = {}
for i = 0, #KEYS / 4 - 1 do
  local k = 4 * i
  out[i+1] = start_job(KEYS[k+1], KEYS[k+2], KEYS[k+3], KEYS[k+4], token, ttl, ARGV[3+i] == '1')
end
return out
