-- start_job: a fragment (START and TAKE include it).
-- Claims the job's owner key with this worker's fencing token and reads what its reply
-- stream already holds, in one step, unless the job is finished or (a fresh duplicate
-- entry) runs elsewhere.
-- Reply: {verdict, cancelled (0/1), reply entries}; verdict is "finished", "elsewhere"
-- (another owner holds it) or "start" (the owner key is ours now).
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
