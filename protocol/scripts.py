"""Lua scripts: the atomic steps of the queue protocol. Every key a script touches is passed in KEYS and shares
the run's hash tag, so the scripts also run on Redis Cluster."""

# KEYS: jobs stream, inflight counter, then one job_seen key per job. ARGV: seen_ttl_s, max_inflight (0 = no
# bound), reply_to, then per job: n followed by its n payloads. Jobs are taken in order; returns per job a pair
# (1, "") admitted, (0, reply_to of the first submission) duplicate, or (-1, inflight) full: that job and every later
# one in the call are left out, so the caller can wait and resubmit them in order.
SUBMIT = """
local out = {}
local max_inflight = tonumber(ARGV[2])
local cur = tonumber(redis.call('GET', KEYS[2]) or '0')
local added = 0
local a = 4
local full = false
for k = 3, #KEYS do
  local n = tonumber(ARGV[a])
  local seen = (not full) and redis.call('GET', KEYS[k])
  if full then
    out[#out + 1] = -1; out[#out + 1] = ''
  elseif seen then
    out[#out + 1] = 0; out[#out + 1] = seen
  elseif max_inflight > 0 and cur + added + n > max_inflight then
    full = true
    out[#out + 1] = -1; out[#out + 1] = tostring(cur + added)
  else
    redis.call('SET', KEYS[k], ARGV[3], 'EX', ARGV[1])
    for i = 1, n do redis.call('XADD', KEYS[1], '*', 'd', ARGV[a + i]) end
    added = added + n
    out[#out + 1] = 1; out[#out + 1] = ''
  end
  a = a + n + 1
end
if added > 0 then redis.call('INCRBY', KEYS[2], added) end
return out
"""

# KEYS: jobs stream, reply stream, dead-letter stream. ARGV: group, entry id, trajectory payload or "",
# dead-letter payload or "". Publishes and acks in one step; returns 0 (and writes nothing) when the entry was
# already acked, e.g. by another worker that reclaimed it. (Successful trajectories, the hot path, are published
# with XACK+XDEL+XADD in MULTI/EXEC instead: no Lua copy of the payload; consumers drop the rare duplicate.)
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

# KEYS: one consumed-set key per entry. ARGV: the sample index per entry. Returns 1 per entry already consumed, else 0.
SEEN = """
local out = {}
for i = 1, #KEYS do out[i] = redis.call('HEXISTS', KEYS[i], ARGV[i]) end
return out
"""
