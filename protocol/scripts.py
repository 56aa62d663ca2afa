"""Lua scripts: the atomic steps of the queue protocol. Every key a script touches is passed in KEYS and shares
the run's hash tag, so the scripts also run on Redis Cluster."""

# KEYS: jobs stream, job_seen key, inflight counter. ARGV: seen_ttl_s, max_inflight (0 = no bound), n, reply_to,
# then n job payloads. Returns {1, ""} admitted, {0, reply_to of the first submission} duplicate,
# {-1, current inflight} full (nothing written).
SUBMIT = """
local seen = redis.call('GET', KEYS[2])
if seen then return {0, seen} end
local n = tonumber(ARGV[3])
local max_inflight = tonumber(ARGV[2])
if max_inflight > 0 then
  local cur = tonumber(redis.call('GET', KEYS[3]) or '0')
  if cur + n > max_inflight then return {-1, tostring(cur)} end
end
redis.call('SET', KEYS[2], ARGV[4], 'EX', ARGV[1])
for i = 1, n do redis.call('XADD', KEYS[1], '*', 'd', ARGV[4 + i]) end
redis.call('INCRBY', KEYS[3], n)
return {1, ''}
"""

# KEYS: jobs stream, reply stream, dead-letter stream. ARGV: group, entry id, trajectory payload or "",
# dead-letter payload or "". Publishes and acks in one step; returns 0 (and writes nothing) when the entry was
# already acked, e.g. by another worker that reclaimed it.
FINISH = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
if ARGV[3] ~= '' then redis.call('XADD', KEYS[2], '*', 'd', ARGV[3]) end
if ARGV[4] ~= '' then redis.call('XADD', KEYS[3], '*', 'd', ARGV[4]) end
return 1
"""

# KEYS: jobs stream. ARGV: group, entry id, new job payload. Acks the entry and queues the job again.
REQUEUE = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[1], '*', 'd', ARGV[3])
return 1
"""

# KEYS: reply stream, inflight counter, then one consumed-set key per entry. ARGV: group, dedup ttl_s,
# release_inflight (1 for the stream's primary consumer group), then (entry id, sample index) per entry.
# Acks and marks samples consumed; returns how many were new.
COMMIT = """
local fresh = 0
local n = (#ARGV - 3) / 2
for i = 1, n do
  local id = ARGV[2 + 2 * i]
  local idx = ARGV[3 + 2 * i]
  redis.call('XACK', KEYS[1], ARGV[1], id)
  local key = KEYS[2 + i]
  if redis.call('HSETNX', key, idx, 1) == 1 then
    fresh = fresh + 1
    redis.call('EXPIRE', key, ARGV[2])
  end
end
if fresh > 0 and ARGV[3] == '1' then
  local left = redis.call('DECRBY', KEYS[2], fresh)
  if left < 0 then redis.call('SET', KEYS[2], 0) end
end
return fresh
"""

# KEYS: a stream. Trims entries that every consumer group has acked (below the oldest pending entry and not past
# any group's last-delivered id). Returns the number trimmed. A stream with no group is left alone.
TRIM_ACKED = """
local function less(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok or #groups == 0 then return 0 end
local bound = nil
for _, g in ipairs(groups) do
  local info = {}
  for j = 1, #g, 2 do info[g[j]] = g[j + 1] end
  local b = info['last-delivered-id']
  if tonumber(info['pending']) > 0 then
    local p = redis.call('XPENDING', KEYS[1], info['name'])
    if less(p[2], b) then b = p[2] end
  end
  if bound == nil or less(b, bound) then bound = b end
end
if bound == '0-0' then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', bound)
"""
