"""The Lua scripts behind :class:`scheduler.state.ClusterState`'s atomic changes.

Every state change that two gateways could race on is one script, so they never double-start
or double-stop an instance nor take a namespace past its quota. Each script's comment gives
its KEYS, its ARGV and its reply; keys are named in :mod:`scheduler.state`.
"""

# Set one field of a record hash (written durably: scheduler.durable). KEYS: the hash. ARGV:
# field, value. HSET's reply.
SET_FIELD = """
return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
"""

# Delete fields of a record hash (durably). KEYS: the hash. ARGV: the fields. HDEL's reply.
DELETE_FIELDS = """
return redis.call('HDEL', KEYS[1], unpack(ARGV))
"""

# Delete a function: its record and its minScale go together. KEYS: the function hash, the
# minScale hash. ARGV: id. Returns 1 when the function was deployed, else 0.
DELETE_FUNCTION = """
redis.call('HDEL', KEYS[2], ARGV[1])
return redis.call('HDEL', KEYS[1], ARGV[1])
"""

# Store a function within its namespace's quotas. KEYS: the function hash, the minScale hash
# (function id -> its minScale, for the namespace's always-on sum). ARGV: id, record (''
# stores nothing), cap of functions, the namespace's id prefix ('' for the default namespace,
# whose ids have no '/'), the function's minScale, the namespace's cap of their sum. Returns
# {0, 0} when there is room (and the record was stored), {1, count} when the namespace holds
# its cap of functions, {2, sum} when its other functions' minScale leave too little.
# A function stored before the minScale hash existed has no entry there: its record is decoded
# once (cjson) and the entry added, so an upgrade cannot leave minScale uncounted. Scanning
# every id happens on deploys only: rare next to invocations, and one script keeps concurrent
# deploys under both caps. A redeploy is not a new function (only its minScale counts).
PUT_FUNCTION = """
local prefix = ARGV[4]
local function mine(id)
  if prefix == '' then return not string.find(id, '/', 1, true) end
  return string.sub(id, 1, #prefix) == prefix
end
local function min_scale(id)
  local held = redis.call('HGET', KEYS[2], id)
  if held then return tonumber(held) end
  local ok, record = pcall(cjson.decode, redis.call('HGET', KEYS[1], id))
  local n = 0
  if ok and type(record) == 'table' and type(record.spec) == 'table' and type(record.spec.spec) == 'table'
      and type(record.spec.spec.scaling) == 'table' then
    n = tonumber(record.spec.spec.scaling.minScale) or 0
  end
  redis.call('HSET', KEYS[2], id, n)
  return n
end
local count, warm = 0, 0
for _, id in ipairs(redis.call('HKEYS', KEYS[1])) do
  if mine(id) then
    count = count + 1
    if id ~= ARGV[1] then warm = warm + min_scale(id) end
  end
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 and count >= tonumber(ARGV[3]) then return {1, count} end
if tonumber(ARGV[5]) > 0 and warm + tonumber(ARGV[5]) > tonumber(ARGV[6]) then return {2, warm} end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[5])
end
return {0, 0}
"""

# Start an instance if fewer than ARGV[1] are live. KEYS: fn set, seq counter.
# ARGV: desired, function, device, now, prefix, record TTL in ms (0: none; set in the same
# script, so no crash between the two leaves a record that never expires), its in-flight count
# (1: the caller's request took its first slot). The new id or false.
SCALE_UP = """
local live = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local s = redis.call('HGET', ARGV[5] .. 'instance:' .. id, 'state')
  if s == 'starting' or s == 'ready' then live = live + 1 end
end
if live >= tonumber(ARGV[1]) then return false end
local id = tostring(redis.call('INCR', KEYS[2]))
redis.call('HSET', ARGV[5] .. 'instance:' .. id, 'v', '1', 'function', ARGV[2], 'state', 'starting',
  'device', ARGV[3], 'url', '', 'in_flight', ARGV[7], 'deadline', '0', 'created', ARGV[4])
if tonumber(ARGV[6]) > 0 then redis.call('PEXPIRE', ARGV[5] .. 'instance:' .. id, ARGV[6]) end
redis.call('SADD', KEYS[1], id)
return id
"""

# Refresh an expiring record's TTL. KEYS: instance hash, fn set. ARGV: TTL in ms, instance id,
# then the record's fields: written again (and the id re-added) when the record is gone, e.g.
# it expired while Redis was unreachable from a pod that still serves. 1 refreshed, 0 rewritten.
REFRESH = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  return 1
end
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
return 0
"""

# Drop an id from its function's set once its record is gone (expired). KEYS: instance hash,
# fn set. ARGV: id. Ids are never reused (INCR), so a missing record never comes back.
PRUNE = """
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SREM', KEYS[2], ARGV[1]) end
return 0
"""

# Move KEYS[1] from state ARGV[1] to ARGV[2]; extra ARGV pairs are fields to set. 1 or 0.
TRANSITION = """
if redis.call('HGET', KEYS[1], 'state') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2])
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

# Route a request: the ready instance with the fewest in flight below ARGV[2]. KEYS: fn set.
# ARGV: prefix, concurrency, 'pack' or 'spread'. Returns {id, url, token} ('' for no token),
# or on a miss {'', ready, starting, in flight}: the live instances the caller would read next
# to decide a scale-up (a round trip less on a cold start's path).
ACQUIRE = """
local best, best_n, best_url, best_token = nil, nil, nil, nil
local ready, starting, in_flight = 0, 0, 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = ARGV[1] .. 'instance:' .. id
  local f = redis.call('HMGET', key, 'state', 'in_flight', 'url', 'token')
  local n = tonumber(f[2])  -- nil: an expired record (a pod's) whose id is not pruned yet
  if f[1] == 'ready' and n and n < tonumber(ARGV[2]) and (best_n == nil
      or (ARGV[3] == 'pack' and n > best_n) or (ARGV[3] ~= 'pack' and n < best_n)) then
    best, best_n, best_url, best_token = id, n, f[3], f[4] or ''
  end
  if f[1] == 'ready' then ready = ready + 1 end
  if f[1] == 'starting' then starting = starting + 1 end
  if (f[1] == 'ready' or f[1] == 'starting') and n then in_flight = in_flight + n end
end
if best == nil then return {'', ready, starting, in_flight} end
redis.call('HINCRBY', ARGV[1] .. 'instance:' .. best, 'in_flight', 1)
return {best, best_url, best_token}
"""

# Route a request to a starting instance that this gateway is activating (it holds the request
# until its activation ends). KEYS: instance hash. ARGV: concurrency. 1 claimed, 0 full, -1 not
# starting (ready: routed as usual; gone: its start failed).
CLAIM_STARTING = """
local f = redis.call('HMGET', KEYS[1], 'state', 'in_flight')
if f[1] ~= 'starting' then return -1 end
if tonumber(f[2]) >= tonumber(ARGV[1]) then return 0 end
redis.call('HINCRBY', KEYS[1], 'in_flight', 1)
return 1
"""

# A request finished on KEYS[1]; ARGV: keep-alive deadline to set when it goes idle.
# An instance already forgotten stays forgotten (HINCRBY would recreate its hash).
RELEASE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local n = redis.call('HINCRBY', KEYS[1], 'in_flight', -1)
if n <= 0 then
  redis.call('HSET', KEYS[1], 'in_flight', '0', 'deadline', ARGV[1])
  return 0
end
return n
"""

# Keep-alive expiry: ready, idle instances past their deadline become draining, as long as
# at least ARGV[3] (minScale) live ones remain. KEYS: fn set. ARGV: prefix, now, min_scale,
# then the devices whose instances the caller may drain (none listed: any device).
EXPIRE = """
local allowed = {}
for i = 4, #ARGV do allowed[ARGV[i]] = true end
local live, idle = 0, {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local f = redis.call('HMGET', ARGV[1] .. 'instance:' .. id, 'state', 'in_flight', 'deadline', 'device')
  if f[1] == 'starting' or f[1] == 'ready' then live = live + 1 end
  if f[1] == 'ready' and tonumber(f[2]) == 0 and tonumber(f[3]) <= tonumber(ARGV[2])
     and (#ARGV < 4 or allowed[f[4]]) then
    table.insert(idle, id)
  end
end
local out = {}
for _, id in ipairs(idle) do
  if live <= tonumber(ARGV[3]) then break end
  redis.call('HSET', ARGV[1] .. 'instance:' .. id, 'state', 'draining')
  live = live - 1
  table.insert(out, id)
end
return out
"""
