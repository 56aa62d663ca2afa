"""Lua scripts: the atomic steps of the queue protocol. Every key a script touches is passed in KEYS and shares
the run's hash tag, so the scripts also run on Redis Cluster."""

# KEYS: the reply stream's in-flight counter, then per job its job_seen key and its class's job stream (all on one
# partition). ARGV: seen_ttl_s, max_inflight of the reply stream (0 = no bound), reply_to, all_or_nothing ("1": admit
# every job of the call or none), then per job: its class, its class's bound on this partition (0 = none, -1 = no
# such class), n, and its n payloads. The caller reads the bounds from the run's classes hash (run-wide, so outside
# a partition's slot: a script can't read it on Redis Cluster).
# A class's in-flight count is its stream's length: workers XDEL every entry they ack, so the stream holds exactly
# the samples queued or running (no counter to drift). Jobs are taken in order; returns per job a pair
# (1, "") admitted, (0, reply_to of the first submission) duplicate, (-1, "reply" | "class") full: that job and
# every later one in the call are left out (later ones: (-1, "")), so the caller can wait and resubmit them in
# order, or (-2, class) an unknown class, which stops the call the same way. With all_or_nothing, a call that
# leaves any job out writes nothing: the jobs that would have been admitted answer (-3, "").
SUBMIT = """
local max_inflight = tonumber(ARGV[2])
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local lens, marked = {}, {}
local status, info, firsts, counts = {}, {}, {}, {}
local added = 0
local a = 5
local stopped = false
local jobs = (#KEYS - 1) / 2
for j = 1, jobs do
  local seen_key, stream = KEYS[2 * j], KEYS[1 + 2 * j]
  local cls, bound, n = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  firsts[j], counts[j] = a + 3, n
  a = a + 3 + n
  if stopped then
    status[j], info[j] = -1, ''
  else
    local seen = marked[seen_key] or redis.call('GET', seen_key)
    if seen then
      status[j], info[j] = 0, seen
    else
      if lens[stream] == nil then lens[stream] = redis.call('XLEN', stream) end
      if bound < 0 then
        stopped = true
        status[j], info[j] = -2, cls
      elseif max_inflight > 0 and cur + added + n > max_inflight then
        stopped = true
        status[j], info[j] = -1, 'reply'
      elseif bound > 0 and lens[stream] + n > bound then
        stopped = true
        status[j], info[j] = -1, 'class'
      else
        status[j], info[j] = 1, ''
        marked[seen_key] = ARGV[3]
        lens[stream] = lens[stream] + n
        added = added + n
      end
    end
  end
end
local out = {}
local write = not (stopped and ARGV[4] == '1')
for j = 1, jobs do
  if status[j] == 1 then
    if write then
      redis.call('SET', KEYS[2 * j], ARGV[3], 'EX', ARGV[1])
      local stream = KEYS[1 + 2 * j]
      for i = firsts[j], firsts[j] + counts[j] - 1 do redis.call('XADD', stream, '*', 'd', ARGV[i]) end
    else
      status[j] = -3
    end
  end
  out[#out + 1] = status[j]; out[#out + 1] = info[j]
end
if write and added > 0 then redis.call('INCRBY', KEYS[1], added) end
return out
"""

# KEYS: blob keys (RunKeys.blob, one partition), then the same number of their refs keys (RunKeys.blob_refs). ARGV:
# ttl_s, then each blob's payload. Stores each payload under its key with the TTL, unless the key already lives at
# least that long (a blob is content-addressed: the same key always holds the same bytes, so only its lifetime can
# change, and never shortens), and marks it needed by "*" in its refs set for as long: the jobs of producers and the
# trajectories of workers are not tracked job by job, so an ingress job that references the same blob and finishes
# never deletes it (INGRESS_SUBMIT). A producer runs it before the SUBMIT call whose jobs reference the blobs
# (`Job.data_ref`); a blob whose jobs were then refused expires on its own.
STORE_BLOBS = """
local ttl = tonumber(ARGV[1])
local n = #KEYS / 2
for i = 1, n do
  if redis.call('TTL', KEYS[i]) < ttl then redis.call('SET', KEYS[i], ARGV[i + 1], 'EX', ttl) end
  redis.call('SADD', KEYS[n + i], '*')
  if redis.call('TTL', KEYS[n + i]) < ttl then redis.call('EXPIRE', KEYS[n + i], ttl) end
end
return n
"""

# -- the ingress's byte quota and its blobs (a Lua prelude of FINISH, START_SAMPLE and CANCEL_JOB) -------------------
# An ingress job is charged to its tenant and holds its data's blob (RunKeys.blob_refs) from its admission until its
# last sample is done for good: published or dead-lettered (FINISH), or cancelled before it started (CANCEL_JOB, or
# START_SAMPLE for a started sample met again after the cancel). Each sample is counted once (`f<i>` in the control
# hash, `d` counting up to `n`), in the same atomic step as the ack or the cancel that ends it; so a blob is deleted
# only once no job that references it has a sample queued or running. The charge (`charge` = "<bytes>:<call>") is
# kept per admitting call: the tenant's bytes hash (RunKeys.tenant_bytes) holds `total` and what each call's jobs
# still hold, its charges zset (RunKeys.tenant_charges) each call by when its retention ends. A job written before
# this (no `charge`), or past its retention (no control hash), counts nothing: its call is forgotten once its
# retention is over (INGRESS_SUBMIT) and its blob expires with its TTL.
# rk: {charges key, bytes key, refs key or nil, blob key or nil}; ctl: the job's control hash key, its identity.
SAMPLE_DONE = """
local function job_done(ctl, charge, rk)
  local bytes, call = string.match(charge, '^(%d+):(.+)$')
  if bytes and redis.call('HEXISTS', rk[2], call) == 1 then
    if redis.call('HINCRBY', rk[2], call, -tonumber(bytes)) <= 0 then
      redis.call('HDEL', rk[2], call)
      redis.call('ZREM', rk[1], call)
    end
    if redis.call('HINCRBY', rk[2], 'total', -tonumber(bytes)) < 0 then redis.call('HSET', rk[2], 'total', 0) end
  end
  local ref = redis.call('HGET', ctl, 'ref')
  if ref and rk[4] and string.sub(rk[3], -#ref) == ref and string.sub(rk[4], -#ref) == ref
      and redis.call('SREM', rk[3], ctl) == 1 then
    if redis.call('SCARD', rk[3]) == 0 then redis.call('DEL', rk[4]) end
  end
end
local function sample_done(ctl, idx, rk)
  local charge = redis.call('HGET', ctl, 'charge')
  if not charge then return end
  if redis.call('HSETNX', ctl, 'f' .. idx, 1) == 0 then return end
  if redis.call('HINCRBY', ctl, 'd', 1) == tonumber(redis.call('HGET', ctl, 'n')) then job_done(ctl, charge, rk) end
end
"""

# KEYS: the entry's job stream (its class's), reply stream, dead-letter stream, and (optional) the run's dropped-
# results hash; for an ingress job (cancellable), then its control hash, its tenant's charges and bytes keys, and
# (when its data is a blob) the blob's refs and blob keys. ARGV: group, entry id, trajectory payload or "",
# dead-letter payload or "", "1" when the reply stream is a private one that must already exist (optional unless more
# follow), and for an ingress job its sample index: its sample is done (SAMPLE_DONE). Publishes and acks in one step;
# returns 0 (and writes nothing) when the entry was already acked, e.g. by another worker that reclaimed it, else 1,
# or 2 when the private reply stream is gone (expired or deleted: its caller left): the trajectory is not published (a
# stream nobody reads is not recreated) and counted under `reply_gone` in the dropped hash. (Successful trajectories,
# the hot path, are published with XACK+XDEL+XADD in MULTI/EXEC instead: no Lua copy of the payload; consumers drop
# the rare duplicate.)
FINISH = (
    SAMPLE_DONE
    + """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
if KEYS[7] then sample_done(KEYS[5], ARGV[6], {KEYS[6], KEYS[7], KEYS[8], KEYS[9]}) end
local out = 1
if ARGV[3] ~= '' then
  if ARGV[5] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then
    out = 2
    if KEYS[4] then redis.call('HINCRBY', KEYS[4], 'reply_gone', 1) end
  else
    redis.call('XADD', KEYS[2], '*', 'd', ARGV[3])
  end
end
if ARGV[4] ~= '' then redis.call('XADD', KEYS[3], '*', 'd', ARGV[4]) end
return out
"""
)

# KEYS: the entry's job stream, the reply stream. ARGV: group, entry id, trajectory payload, "1" when the reply stream
# is a private one that must already exist. The hot path's publish as one script, for Redis Cluster (no MULTI there
# in redis-py): acks and deletes the entry and publishes, as the MULTI/EXEC version does; returns 1, or 0 when the
# private reply stream is gone (the entry is acked, the trajectory dropped: the stream is not recreated).
PUBLISH = """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
redis.call('XADD', KEYS[2], '*', 'd', ARGV[3])
return 1
"""

# KEYS: the entry's job stream. ARGV: group, entry id, new job payload. Acks the entry and queues the job again (at
# the tail of the same stream, so its class's in-flight count, the stream's length, does not change). Returns the new
# entry's id (its time is when the job was handed back), or 0 when the entry was not pending (its outcome was written).
REQUEUE = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
return redis.call('XADD', KEYS[1], '*', 'd', ARGV[3])
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
  if left < 0 then redis.call('SET', KEYS[2], 0, 'KEEPTTL') end
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

# KEYS: a private reply stream, its in-flight counter. ARGV: ttl_s (0 = none). Creates the stream (empty) when it
# does not exist, so workers may publish to it (they never create a private reply stream: one that expired stays
# gone), and gives both keys the TTL (the counter is created at 0 when missing). Its caller runs it again every
# ttl/3 while alive, so a reply stream whose caller died expires. Returns 1 if the stream was created.
KEEP_REPLY_STREAM = """
local created = 0
if redis.call('EXISTS', KEYS[1]) == 0 then
  local id = redis.call('XADD', KEYS[1], '*', 'd', '')
  redis.call('XDEL', KEYS[1], id)
  created = 1
end
local ttl = tonumber(ARGV[1])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('SET', KEYS[2], 0, 'NX', 'EX', ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
end
return created
"""

# KEYS: the run's workers sorted set, its worker-info hash. ARGV: cutoff (unix seconds), sweep ("1": also forget
# info entries that have no heartbeat at all, e.g. left by an older version; O(workers), so run at start only).
# Forgets workers whose last heartbeat is older than the cutoff: their zset member and their info. Returns how many
# were forgotten.
FORGET_WORKERS = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])
for i = 1, #gone do
  redis.call('ZREM', KEYS[1], gone[i])
  redis.call('HDEL', KEYS[2], gone[i])
end
local n = #gone
if ARGV[2] == '1' then
  for _, name in ipairs(redis.call('HKEYS', KEYS[2])) do
    if not redis.call('ZSCORE', KEYS[1], name) then
      redis.call('HDEL', KEYS[2], name)
      n = n + 1
    end
  end
end
return n
"""

# KEYS: one consumed-set key per entry. ARGV: the sample index per entry. Returns 1 per entry already consumed, else 0.
SEEN = """
local out = {}
for i = 1, #KEYS do out[i] = redis.call('HEXISTS', KEYS[i], ARGV[i]) end
return out
"""

# -- cancellable jobs (the ingress) --------------------------------------------------------------------------------

# KEYS: the job streams the batch uses, then its blob keys (RunKeys.blob: data the jobs reference by digest), then
# their refs keys (RunKeys.blob_refs, in the same order), then the tenant's queued-sample counter
# (RunKeys.tenant_queued), its charges and its bytes (RunKeys.tenant_charges, tenant_bytes), then per job its
# control hash (RunKeys.job_control) and its results stream (RunKeys.job_results), all on one partition. ARGV:
# number of job streams, number of blobs, max_queued (0 = no bound), retention_s, the tenant's sample quota on this
# partition (0 = none), its byte quota there (0 = none), now (unix seconds), this call's id (unique), then per stream
# its class and its class's bound (`max_inflight` on this partition, 0 = none, -1 = no such class: the caller reads
# the run-wide classes hash), then per blob its payload, then per job: the index (1-based) of its stream plus 65536
# times that of its blob (0 = none), n, and its n payloads.
# A job's charge is what it takes in Redis: n entries (each as long as its first, plus 4 bytes for a longer sample
# index) and its blob. All or nothing: a job whose control hash exists is a duplicate (nothing queued for it); when
# the new samples would push the tenant past its quota the reply is {-3, 0, its queued samples, the quota}; past its
# byte quota (calls whose retention is over forgotten first: their jobs expired unfinished) {-4, 0, its bytes, the
# quota}; past max_queued or its class's bound on a stream (as SUBMIT: a stream's length is what is queued or
# running, workers delete what they ack) {-1, stream index, its length, the bound}; an unknown class: {-2, stream
# index}; nothing is queued then. Otherwise the blobs are stored (expiring after retention_s, never shortening a
# longer TTL), each new job is added to its blob's refs and charged to its tenant under this call (until SAMPLE_DONE
# ends it), the tenant's counters grow, each new job gets its control hash (n, charge, ref) and an empty results
# stream (group "ingress", so it exists to carry a TTL), both expiring after retention_s, and its n entries; the
# reply is {1, then per job 1 (admitted) or 0 (duplicate)}.
INGRESS_SUBMIT = """
local nstreams, nblobs = tonumber(ARGV[1]), tonumber(ARGV[2])
local max_queued, ttl, quota = tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local max_bytes, now, call = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
local quota_key = KEYS[nstreams + 2 * nblobs + 1]
local charges_key, bytes_key = KEYS[nstreams + 2 * nblobs + 2], KEYS[nstreams + 2 * nblobs + 3]
local base = nstreams + 2 * nblobs + 3
local njobs = (#KEYS - base) / 2
local blob_at = 8 + 2 * nstreams
local out = {1}
local adding, charges = {}, {}
for s = 1, nstreams do adding[s] = 0 end
local total, total_bytes = 0, 0
local first = 9 + 2 * nstreams + nblobs
local a = first
for j = 1, njobs do
  local code, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  if redis.call('EXISTS', KEYS[base + 2 * j - 1]) == 1 then
    out[j + 1] = 0
  else
    out[j + 1] = 1
    local s, blob = code % 65536, math.floor(code / 65536)
    adding[s] = adding[s] + n
    total = total + n
    local charge = n * (#ARGV[a + 2] + 4)
    if blob > 0 then charge = charge + #ARGV[blob_at + blob] end
    charges[j] = charge
    total_bytes = total_bytes + charge
  end
  a = a + n + 2
end
if total == 0 then return out end
if quota > 0 then
  local queued = tonumber(redis.call('GET', quota_key) or '0')
  if queued + total > quota then return {-3, 0, queued, quota} end
end
for _, old in ipairs(redis.call('ZRANGEBYSCORE', charges_key, '-inf', now, 'LIMIT', 0, 64)) do
  local left = tonumber(redis.call('HGET', bytes_key, old) or '0')
  redis.call('HDEL', bytes_key, old)
  redis.call('ZREM', charges_key, old)
  if redis.call('HINCRBY', bytes_key, 'total', -left) < 0 then redis.call('HSET', bytes_key, 'total', 0) end
end
if max_bytes > 0 then
  local held = tonumber(redis.call('HGET', bytes_key, 'total') or '0')
  if held + total_bytes > max_bytes then return {-4, 0, held, max_bytes} end
end
for s = 1, nstreams do
  if adding[s] > 0 then
    local b = tonumber(ARGV[8 + 2 * s])
    if b < 0 then return {-2, s} end
    local bound = max_queued
    if b > 0 and (bound == 0 or b < bound) then bound = b end
    if bound > 0 then
      local queued = redis.call('XLEN', KEYS[s])
      if queued + adding[s] > bound then return {-1, s, queued, bound} end
    end
  end
end
for b = 1, nblobs do
  local key = KEYS[nstreams + b]
  if redis.call('TTL', key) < tonumber(ttl) then redis.call('SET', key, ARGV[blob_at + b], 'EX', ttl) end
end
redis.call('INCRBY', quota_key, total)
redis.call('HINCRBY', bytes_key, 'total', total_bytes)
redis.call('HSET', bytes_key, call, total_bytes)
redis.call('ZADD', charges_key, now + tonumber(ttl), call)
a = first
for j = 1, njobs do
  local code, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  if out[j + 1] == 1 then
    local s, blob = code % 65536, math.floor(code / 65536)
    local ctl, res = KEYS[base + 2 * j - 1], KEYS[base + 2 * j]
    if blob > 0 then
      local key = KEYS[nstreams + blob]
      redis.call('HSET', ctl, 'n', n, 'charge', charges[j] .. ':' .. call, 'ref', string.sub(key, -64))
      redis.call('SADD', KEYS[nstreams + nblobs + blob], ctl)
    else
      redis.call('HSET', ctl, 'n', n, 'charge', charges[j] .. ':' .. call)
    end
    redis.call('EXPIRE', ctl, ttl)
    redis.call('DEL', res)
    redis.call('XGROUP', 'CREATE', res, 'ingress', '$', 'MKSTREAM')
    redis.call('EXPIRE', res, ttl)
    for i = 1, n do redis.call('XADD', KEYS[s], '*', 'd', ARGV[a + 1 + i]) end
  end
  a = a + n + 2
end
for b = 1, nblobs do
  local refs = KEYS[nstreams + nblobs + b]
  if redis.call('TTL', refs) < tonumber(ttl) then redis.call('EXPIRE', refs, ttl) end
end
return out
"""

# KEYS: control hash, job stream, reply stream, and (a tenant's job) the tenant's queued-sample counter, then its
# charges and bytes keys and (data in a blob) the blob's refs and blob keys. ARGV: group, entry id, sample index, a
# "cancelled" trajectory payload. A sample acked here after the cancel missed it (it had started) is done
# (SAMPLE_DONE). Run by a worker before it runs a sample of a cancellable
# job. Returns 1 (go: sample marked started) or 0 (don't run it: the entry is acked and deleted; when the job was
# cancelled, its "cancelled" result is published unless the cancel already did; when the control hash has expired,
# nobody can read the result: nothing is published). A sample leaves the tenant's count once: when it first starts,
# or when it is skipped without having started or been cancelled (CANCEL_JOB takes off the ones it cancels).
START_SAMPLE = (
    SAMPLE_DONE
    + """
local function release()
  if KEYS[4] and redis.call('DECR', KEYS[4]) < 0 then redis.call('SET', KEYS[4], 0) end
end
local started = 's' .. ARGV[3]
local exists = redis.call('EXISTS', KEYS[1]) == 1
local cancelled = exists and redis.call('HEXISTS', KEYS[1], 'cancelled') == 1
if exists and not cancelled then
  if redis.call('HSETNX', KEYS[1], started, 1) == 1 then release() end
  return 1
end
if redis.call('XACK', KEYS[2], ARGV[1], ARGV[2]) == 1 then
  redis.call('XDEL', KEYS[2], ARGV[2])
  if not exists then
    release()
  elseif redis.call('HSETNX', KEYS[1], 'c' .. ARGV[3], 1) == 1 then
    redis.call('XADD', KEYS[3], '*', 'd', ARGV[4])
    if redis.call('HEXISTS', KEYS[1], started) == 0 then release() end
    if KEYS[6] then sample_done(KEYS[1], ARGV[3], {KEYS[5], KEYS[6], KEYS[7], KEYS[8]}) end
  end
end
return 0
"""
)

# KEYS: control hash, results stream, and (a tenant's job) the tenant's queued-sample counter, then its charges and
# bytes keys and (data in a blob) the blob's refs and blob keys. ARGV: one "cancelled" trajectory payload per sample
# index 0..n-1. Each sample it cancels is done (SAMPLE_DONE): once no started one is left running, the job's charge
# and its hold on its blob end here. Marks the job cancelled and publishes the result of every sample that
# has not started (and has no result of this kind yet), so waiters see all n samples accounted for at once, and
# gives those samples back to the tenant's count; a worker that later takes such a sample acks it without running
# it (START_SAMPLE). Returns {-1} when the job is unknown (or expired), else {1 if it was cancelled before, 0 if
# not, then the indices of the samples that had started}.
CANCEL_JOB = (
    SAMPLE_DONE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
local rk = KEYS[5] and {KEYS[4], KEYS[5], KEYS[6], KEYS[7]}
local before = redis.call('HSETNX', KEYS[1], 'cancelled', 1) == 0 and 1 or 0
local out = {before}
local released = 0
for i = 1, #ARGV do
  local idx = tostring(i - 1)
  if redis.call('HEXISTS', KEYS[1], 's' .. idx) == 1 then
    out[#out + 1] = i - 1
  elseif redis.call('HSETNX', KEYS[1], 'c' .. idx, 1) == 1 then
    redis.call('XADD', KEYS[2], '*', 'd', ARGV[i])
    released = released + 1
    if rk then sample_done(KEYS[1], idx, rk) end
  end
end
if KEYS[3] and released > 0 and redis.call('DECRBY', KEYS[3], released) < 0 then redis.call('SET', KEYS[3], 0) end
return out
"""
)
