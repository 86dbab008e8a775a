"""The Lua scripts that change placement state atomically in Redis.

Each runs as one Redis command (EVALSHA), so two gateways placing creates at the same
moment, or a heartbeat racing a bind, see each other's effects whole: that is what
keeps a node's slot count exact without locks. They name keys beyond KEYS[] (the
fleet runs on one Redis, not a Redis Cluster; docs/cluster.md).

Placement (``PLACE``) scores each candidate with room by its free fraction, +1 when its
cache holds the template, minus its restore queue over twice its restore slots (the
creates placed there still running, or what its last heartbeat reported restoring):
a burst spreads once one node's queue outweighs its cached template.

Slot accounting (``aenv:free``): a placeable node's score is
``max_sandboxes - bound sandboxes - live reservations``. A heartbeat recomputes it
from scratch (so a gateway that died between reserving and finishing leaks a slot only
until the reservation's expiry); bind/unbind and reservations adjust it by one in
between. A node leaves ``aenv:free`` when drained, stopped or found expired.

Team quotas (docs/cluster.md "Team quotas"): a team's quota is the hash
``aenv:quota:<team>`` (what the admin set on a node); its running sandboxes the set
``aenv:team:<team>:run``, its paused ones ``aenv:team:<team>:paused`` (pauses in
flight ``aenv:team:<team>:presv``: ``TEAM_PAUSE``), its starts in flight
``aenv:team:<team>:resv`` (like a node's reservations, with an expiry), its
creates-per-second bucket ``aenv:team:<team>:bucket``.
``PLACE`` checks and reserves a create's team start in the same step as its node slot;
``TEAM_SETTLE`` turns the reservation into the sandbox (``aenv:sbxteam`` maps it to its
team), and from then on ``BIND`` keeps it in the running set while it runs (and in the
paused set while paused), ``UNBIND``, ``RELEASE`` and ``LOST`` take it out (``RELEASE``
keeps it paused): a pause, a kill, an expiry free the team's place as they free (or not)
a node's slot.
"""
from __future__ import annotations

# shared Lua helpers (prepended to every script)
_LIB = """
local P = 'aenv:'
local function event(kind, a, b)
  redis.call('XADD', P .. 'events', 'MAXLEN', '~', 10000, '*', 'type', kind, 'id', a or '', 'detail', b or '')
end
local function free_add(node, n)
  if redis.call('ZSCORE', P .. 'free', node) then redis.call('ZINCRBY', P .. 'free', n, node) end
end
local function drop_from_node(sid, node)
  if node and node ~= '' and redis.call('SREM', P .. 'node:' .. node .. ':sbx', sid) == 1 then
    free_add(node, 1)
  end
end
-- team quotas: a sandbox counted for a team (aenv:sbxteam) is in its running set while it
-- runs, in its paused set while it is paused (on a node or released to the repository)
local function team_track(sid, state)
  local t = redis.call('HGET', P .. 'sbxteam', sid)
  if t then
    local tk = P .. 'team:' .. t
    if state == 'running' then redis.call('SADD', tk .. ':run', sid)
    else redis.call('SREM', tk .. ':run', sid) end
    if state == 'paused' then redis.call('SADD', tk .. ':paused', sid)
    else redis.call('SREM', tk .. ':paused', sid) end
  end
  return t
end
-- how many of n starts team t may make now (its running quota and, for creates, its token
-- bucket); nothing written. -> k, why ('' | 'running <limit>' | 'rate <rate> <wait ms>'), tokens, stamp
local function team_room(t, n, now, create)
  local q = redis.call('HMGET', P .. 'quota:' .. t, 'runningSandboxes', 'createsPerSecond')
  local k, why = n, ''
  local limit = tonumber(q[1])
  if limit then
    local rk = P .. 'team:' .. t .. ':resv'
    redis.call('ZREMRANGEBYSCORE', rk, '-inf', now)
    local room = limit - redis.call('SCARD', P .. 'team:' .. t .. ':run') - redis.call('ZCARD', rk)
    if room < k then
      k = math.max(room, 0)
      why = 'running ' .. limit
    end
  end
  local rate = tonumber(q[2])
  local tokens, stamp = nil, nil
  if create and rate and rate > 0 and k > 0 then
    local b = redis.call('HMGET', P .. 'team:' .. t .. ':bucket', 'tokens', 'stamp')
    local cap = math.max(1, rate)
    tokens, stamp = tonumber(b[1]) or cap, tonumber(b[2]) or now
    if now > stamp then
      tokens = math.min(cap, tokens + (now - stamp) / 1000 * rate)
      stamp = now
    end
    local got = math.min(k, math.floor(tokens + 1e-9))
    if got < k then
      why = 'rate ' .. rate .. ' ' .. math.ceil((1 - (tokens - got)) / rate * 1000)
      k = got
    end
  end
  return k, why, tokens, stamp
end
-- reserve k starts of team t (members rid:1..rid:k, live until now + ttl), taking k tokens
local function team_take(t, k, rid, now, ttl, tokens, stamp)
  for i = 1, k do redis.call('ZADD', P .. 'team:' .. t .. ':resv', now + ttl, rid .. ':' .. i) end
  if tokens then
    redis.call('HSET', P .. 'team:' .. t .. ':bucket', 'tokens', tostring(tokens - k), 'stamp', tostring(stamp))
  end
end
"""

# ARGV: node, now_ms, lease_ms, max_sandboxes, field1, value1, ...  -> free slots
HEARTBEAT = _LIB + """
local id, now = ARGV[1], tonumber(ARGV[2])
local nk = P .. 'node:' .. id
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
if #fields > 0 then redis.call('HSET', nk, unpack(fields)) end
local prev = redis.call('HGET', nk, 'state')
redis.call('HSET', nk, 'state', 'up', 'heartbeat_at', now, 'max_sandboxes', ARGV[4])
redis.call('ZADD', P .. 'nodes', now + tonumber(ARGV[3]), id)
local rk = nk .. ':resv'
redis.call('ZREMRANGEBYSCORE', rk, '-inf', now)
local free = tonumber(ARGV[4]) - redis.call('SCARD', nk .. ':sbx') - redis.call('ZCARD', rk)
if redis.call('HGET', nk, 'drained') == '1' then
  redis.call('ZREM', P .. 'free', id)
else
  redis.call('ZADD', P .. 'free', free, id)
end
if prev ~= 'up' then event('node-up', id, prev or 'new') end
return free
"""

# ARGV: node  (a node that stops on purpose: expired at once, not after its lease)
STOP = _LIB + """
local id = ARGV[1]
redis.call('ZADD', P .. 'nodes', 0, id)
redis.call('ZREM', P .. 'free', id)
redis.call('HSET', P .. 'node:' .. id, 'state', 'stopped')
event('node-stopped', id)
return 1
"""

# ARGV: now_ms -> ids of nodes whose lease ran out since the last sweep
EXPIRE = _LIB + """
local now = tonumber(ARGV[1])
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. 'nodes', '-inf', now)) do
  redis.call('ZREM', P .. 'free', id)
  if redis.call('HGET', P .. 'node:' .. id, 'state') == 'up' then
    redis.call('HSET', P .. 'node:' .. id, 'state', 'expired')
    event('node-expired', id)
    out[#out + 1] = id
  end
end
return out
"""

# ARGV: now_ms, template, reservation id, reservation ttl ms, memory MiB (0: the node's sandbox size),
#       k, excluded nodes (a,b,c), team ('' = no team's quota: an adoption, or the team's start
#       reserved already)
# -> the node reserved, or nil when no node has room, or '!<why>' (team_room) when the team's
#    quota leaves no room: then nothing is reserved. The team's start is reserved with the node's
#    slot (member <rid>:1 of aenv:team:<team>:resv), in the same step.
PLACE = _LIB + """
local now, tpl, rid = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local ttl, mem, k = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local team = ARGV[8] or ''
local tokens, stamp
if team ~= '' then
  local granted, why
  granted, why, tokens, stamp = team_room(team, 1, now, true)
  if granted < 1 then return '!' .. why end
end
local excl = {}
for x in string.gmatch(ARGV[7], '[^,]+') do excl[x] = true end
local list = redis.call('ZREVRANGEBYSCORE', P .. 'free', '+inf', '1', 'LIMIT', 0, k)
if tpl ~= '' then
  for _, n in ipairs(redis.call('SRANDMEMBER', P .. 'tpl:' .. tpl, k)) do list[#list + 1] = n end
end
local seen, best, bestscore = {}, nil, nil
for _, n in ipairs(list) do
  if not seen[n] and not excl[n] then
    seen[n] = true
    local lease = tonumber(redis.call('ZSCORE', P .. 'nodes', n) or '0')
    local free = tonumber(redis.call('ZSCORE', P .. 'free', n) or '0')
    if lease < now then
      redis.call('ZREM', P .. 'free', n)
    elseif free >= 1 then
      local nk = P .. 'node:' .. n
      local h = redis.call('HMGET', nk, 'max_sandboxes', 'mem_avail_mib', 'sandbox_mem_mib', 'restore_slots',
                           'vcpus', 'restoring')
      local max = tonumber(h[1]) or 1
      local per = tonumber(h[3]) or mem
      local need = mem > 0 and mem or per
      local inflight = redis.call('ZCOUNT', nk .. ':resv', now, '+inf')
      if (tonumber(h[2]) or 0) - inflight * per >= need then
        local score = free / max
        if tpl ~= '' and redis.call('SISMEMBER', nk .. ':tpl', tpl) == 1 then score = score + 1 end
        -- its restore queue: the creates placed there and still running (live), or what it
        -- reported restoring at its last heartbeat (forks, direct creates), whichever is more;
        -- 2 * slots of them in line weigh as much as holding the template
        local slots = tonumber(h[4]) or 0
        if slots < 1 then slots = tonumber(h[5]) or 1 end
        if slots < 1 then slots = 1 end
        score = score - math.max(inflight, tonumber(h[6]) or 0) / (2 * slots)
        if bestscore == nil or score > bestscore then best, bestscore = n, score end
      end
    end
  end
end
if not best then return false end
redis.call('ZINCRBY', P .. 'free', -1, best)
redis.call('ZADD', P .. 'node:' .. best .. ':resv', now + ttl, rid)
if team ~= '' then team_take(team, 1, rid, now, ttl, tokens, stamp) end
return best
"""

# ARGV: team, n, reservation id, now_ms, ttl ms, create ('1' | '0': a resume, which takes no token)
# -> {k, why}: k of the n starts reserved (members <rid>:1..k), why not more (team_room)
TEAM_RESERVE = _LIB + """
local t, n, rid, now, ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local k, why, tokens, stamp = team_room(t, n, now, ARGV[6] == '1')
team_take(t, k, rid, now, ttl, tokens, stamp)
return {k, why}
"""

# ARGV: team, reservation member, sandbox  (the start it was for made the sandbox: counted
# for the team from now on, in its running set while its binding says running)
TEAM_SETTLE = _LIB + """
local t, sid = ARGV[1], ARGV[3]
redis.call('ZREM', P .. 'team:' .. t .. ':resv', ARGV[2])
redis.call('HSET', P .. 'sbxteam', sid, t)
team_track(sid, redis.call('HGET', P .. 'sbx:' .. sid, 'state') or 'gone')
return 1
"""

# A pause of a team's sandbox through a gateway, held to the team's pausedSandboxes quota
# across the fleet: its paused set plus its pauses in flight (aenv:team:<team>:presv, like
# the starts' reservations) must leave room; the pause is reserved in the same step. Once
# the node answered (its agent has bound the sandbox paused by then) the gateway drops the
# reservation (TEAM_PAUSED).
# ARGV: team, reservation id, now_ms, ttl_ms -> {1} reserved | {2} no quota: nothing
# reserved | {0, limit} refused
TEAM_PAUSE = _LIB + """
local t, rid, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local limit = tonumber(redis.call('HGET', P .. 'quota:' .. t, 'pausedSandboxes') or '')
if not limit then return {2} end
local rk = P .. 'team:' .. t .. ':presv'
redis.call('ZREMRANGEBYSCORE', rk, '-inf', now)
if redis.call('SCARD', P .. 'team:' .. t .. ':paused') + redis.call('ZCARD', rk) >= limit then
  return {0, limit}
end
redis.call('ZADD', rk, now + tonumber(ARGV[4]), rid)
return {1}
"""

# ARGV: team, reservation id  (the pause it was for has been answered, either way)
TEAM_PAUSED = _LIB + """
redis.call('ZREM', P .. 'team:' .. ARGV[1] .. ':presv', ARGV[2])
return 1
"""

# ARGV: team, reservation id, n  (members <rid>:1..n that were not settled: the starts failed)
TEAM_UNRESERVE = _LIB + """
for i = 1, tonumber(ARGV[3]) do redis.call('ZREM', P .. 'team:' .. ARGV[1] .. ':resv', ARGV[2] .. ':' .. i) end
return 1
"""

# ARGV: node, reservation id  (the create it was for has finished, either way)
UNRESERVE = _LIB + """
if redis.call('ZREM', P .. 'node:' .. ARGV[1] .. ':resv', ARGV[2]) == 1 then free_add(ARGV[1], 1) end
return 1
"""

# ARGV: sandbox, node, state, info json, now_ms, paused_at ('' = keep), note ('' = clear)
BIND = _LIB + """
local sid, node = ARGV[1], ARGV[2]
local sk = P .. 'sbx:' .. sid
local old = redis.call('HGET', sk, 'node')
if old ~= node then drop_from_node(sid, old) end
redis.call('SREM', P .. 'released', sid)
local prev = redis.call('HGET', sk, 'state')
redis.call('HSET', sk, 'node', node, 'state', ARGV[3], 'info', ARGV[4], 'updated', ARGV[5], 'note', ARGV[7])
if ARGV[6] ~= '' then redis.call('HSET', sk, 'paused_at', ARGV[6]) end
if redis.call('SADD', P .. 'node:' .. node .. ':sbx', sid) == 1 then free_add(node, -1) end
team_track(sid, ARGV[3])
if old ~= node or prev ~= ARGV[3] then event('sandbox-' .. ARGV[3], sid, node) end
return 1
"""

# ARGV: sandbox, node it must be on ('' = any) -> 1 removed, 0 not (bound elsewhere or unknown)
UNBIND = _LIB + """
local sid = ARGV[1]
local sk = P .. 'sbx:' .. sid
local old = redis.call('HGET', sk, 'node')
if not old or (ARGV[2] ~= '' and old ~= ARGV[2]) then return 0 end
drop_from_node(sid, old)
if team_track(sid, 'gone') then redis.call('HDEL', P .. 'sbxteam', sid) end
redis.call('SREM', P .. 'released', sid)
redis.call('DEL', sk)
event('sandbox-killed', sid, old)
return 1
"""

# ARGV: sandbox, node it must be on, now_ms  (paused in the repository, held by no node)
RELEASE = _LIB + """
local sid = ARGV[1]
local sk = P .. 'sbx:' .. sid
local old = redis.call('HGET', sk, 'node')
if not old or old ~= ARGV[2] then return 0 end
drop_from_node(sid, old)
team_track(sid, 'paused')
redis.call('HSET', sk, 'node', '', 'state', 'paused', 'updated', ARGV[3])
redis.call('SADD', P .. 'released', sid)
event('sandbox-released', sid, old)
return 1
"""

# ARGV: sandbox, note, now_ms  (no node holds it and the repository has no pause of it:
# shown lost where it is listed now, on its old node's set or among the released) -> 1, 0 unknown
LOST = _LIB + """
local sid = ARGV[1]
local sk = P .. 'sbx:' .. sid
if redis.call('EXISTS', sk) == 0 then return 0 end
local prev = redis.call('HGET', sk, 'state')
redis.call('HSET', sk, 'state', 'lost', 'note', ARGV[2], 'updated', ARGV[3])
team_track(sid, 'lost')
if prev ~= 'lost' then event('sandbox-lost', sid, redis.call('HGET', sk, 'node')) end
return 1
"""

# A volume made through a gateway is recorded here (gateway/volumes.py) once its node made
# it, in one step with the check of its team's volumeBytes quota: the team's volumes'
# byte bounds (aenv:team:<team>:vols, each aenv:vol:<id>'s ``bytes``; 0: unbounded) plus
# this one's must fit. Two gateways recording at once see each other's volumes whole.
# ARGV: team, volume id, node, name, bytes (its bound; 0: none)
# -> {1} recorded | {0, held, limit} refused (held -1: a volume of the team is unbounded)
VOLUME_ADD = _LIB + """
local t, vid, bytes = ARGV[1], ARGV[2], tonumber(ARGV[5])
local vols = P .. 'team:' .. t .. ':vols'
local limit = tonumber(redis.call('HGET', P .. 'quota:' .. t, 'volumeBytes') or '')
if limit then
  if bytes == 0 then return {0, -1, limit} end
  local held = 0
  for _, other in ipairs(redis.call('SMEMBERS', vols)) do
    local b = redis.call('HGET', P .. 'vol:' .. other, 'bytes')
    if not b then redis.call('SREM', vols, other)
    elseif tonumber(b) == 0 then return {0, -1, limit}
    else held = held + tonumber(b) end
  end
  if held + bytes > limit then return {0, held, limit} end
end
redis.call('HSET', P .. 'vol:' .. vid, 'node', ARGV[3], 'name', ARGV[4], 'team', t, 'bytes', ARGV[5])
redis.call('SADD', vols, vid)
redis.call('SET', P .. 'volname:' .. ARGV[4], vid)
return {1}
"""

# ARGV: volume id -> 1 | 0 (no such volume recorded)
VOLUME_DROP = _LIB + """
local vk = P .. 'vol:' .. ARGV[1]
local v = redis.call('HMGET', vk, 'name', 'team')
if not v[1] then return 0 end
redis.call('DEL', vk)
if redis.call('GET', P .. 'volname:' .. v[1]) == ARGV[1] then redis.call('DEL', P .. 'volname:' .. v[1]) end
if v[2] then redis.call('SREM', P .. 'team:' .. v[2] .. ':vols', ARGV[1]) end
return 1
"""

# ARGV: node, drained ('1' | '0'), now_ms
DRAIN = _LIB + """
local id = ARGV[1]
local nk = P .. 'node:' .. id
if redis.call('EXISTS', nk) == 0 then return -1 end
redis.call('HSET', nk, 'drained', ARGV[2])
if ARGV[2] == '1' then
  redis.call('ZREM', P .. 'free', id)
  event('node-drained', id)
else
  local now = tonumber(ARGV[3])
  if tonumber(redis.call('ZSCORE', P .. 'nodes', id) or '0') >= now then
    local rk = nk .. ':resv'
    redis.call('ZREMRANGEBYSCORE', rk, '-inf', now)
    local max = tonumber(redis.call('HGET', nk, 'max_sandboxes') or '0')
    redis.call('ZADD', P .. 'free', max - redis.call('SCARD', nk .. ':sbx') - redis.call('ZCARD', rk), id)
  end
  event('node-undrained', id)
end
return 1
"""
