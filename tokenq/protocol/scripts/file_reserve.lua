-- FILE_RESERVE: room for a new file in its owner's storage quota, and its metadata, at
-- once: files that expired (their metadata gone) leave the owner's index first, then the
-- sizes of the rest are summed; if the new one fits it is listed and its metadata written
-- (expiring with the file), so that uploads racing each other are counted against each
-- other. Its content is written after this, by the caller.
-- KEYS: the owner's files (sorted set by creation), their sizes (hash), the new file's
--       metadata hash
-- ARGV: the metadata key prefix ("<ns>:file:"), file id, its size, the quota in bytes
--       (0: none), created at, expires at (unix s; 0: never), then the metadata as
--       field, value pairs
-- Reply: {1, bytes stored before it} or {0, bytes stored}
local prefix, fid, size, quota = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local used = 0
local sizes = redis.call('HGETALL', KEYS[2])
for i = 1, #sizes, 2 do
  if redis.call('EXISTS', prefix .. sizes[i]) == 1 then
    used = used + tonumber(sizes[i + 1])
  else
    redis.call('HDEL', KEYS[2], sizes[i])
    redis.call('ZREM', KEYS[1], sizes[i])
  end
end
if quota > 0 and used + size > quota then return {0, used} end
redis.call('ZADD', KEYS[1], ARGV[5], fid)
redis.call('HSET', KEYS[2], fid, size)
local meta = {}
for i = 7, #ARGV do meta[#meta + 1] = ARGV[i] end
redis.call('HSET', KEYS[3], unpack(meta))
if tonumber(ARGV[6]) > 0 then redis.call('EXPIREAT', KEYS[3], ARGV[6]) end
return {1, used}
