-- ADMIT_SUBMIT: RATE_ADMIT for one request, then, if it was let through, SUBMIT its job:
-- a gateway's request with per-key limits costs one round trip, as one without does.
-- KEYS: RATE_ADMIT's
-- ARGV: RATE_ADMIT's 8, then SUBMIT's
-- Reply: {RATE_ADMIT's answer, SUBMIT's answer}, or {RATE_ADMIT's refusal} (nothing
--        queued). A SUBMIT refusal (a full lane) leaves RATE_ADMIT's counts: the
--        gateway settles them.
local function admit(KEYS, ARGV)
-- include: rate_admit.lua
end
local function submit(ARGV)
-- include: submit.lua
end
local admitted = admit(KEYS, {unpack(ARGV, 1, 8)})
if admitted[1] ~= 'ok' then return {admitted} end
return {admitted, submit({unpack(ARGV, 9)})}
