-- polygw client-key governance: the prelude of every key_*.lua script (prepended at build
-- time), mirroring polygw_core::key_quota::KeyQuotas. One key's keys share its hash tag
-- (one cluster slot): KEYS 1 requests (zset permit id -> admitted at, ms)   2 in flight
-- (zset "<id>|<nanos>" -> lease end: slots and their money reservations)   3 token ledger
-- (zset "<id>|r<tokens>" -> lease end + window: a reservation; "<id>|s<tokens>" ->
-- settled at + window: a settlement)   4 state (hash, below).
-- A top-up (SPEC 24.1: an extra leg's money) is a slot whose permit id starts with '+': it
-- holds money only, and "u" counts the live ones (not calls in flight).
-- State fields: "t" the ledger's tokens, "r" the nanos reserved in flight, "d"/"ds" the
-- current UTC day (days since the epoch) and the nanos settled in it, "m"/"ms" the same
-- for the month (months since January 1970), "L" the longest lease seen, "E" the deadline
-- of the window keys (1, 3), "S" that of the state and in-flight keys (2, 4), which hold
-- the periods' spend and so live until the month's end + the margin.
-- Numbers stay below 2^53 (the client clamps them): Lua numbers are doubles.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local WIN, INF, LED, ST = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local CHUNK = 500
local DAY = 86400000

-- Numbers go to Redis as integer strings (a Lua number would be printed with %.17g).
local function n(v) return string.format('%d', v) end
local now_s = n(now)

-- UTC periods (H. Hinnant's civil calendar algorithms, as in key_quota.rs).
local function day_of(ms) return math.floor(ms / DAY) end
local function month_of(ms)
  local z = day_of(ms) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  if m <= 2 then y = y + 1 end
  return (y - 1970) * 12 + m - 1
end
local function month_start(id)
  local y = 1970 + math.floor(id / 12)
  local m = id % 12 + 1
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5)
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return (era * 146097 + doe - 719468) * DAY
end
local function month_end(ms) return month_start(month_of(ms) + 1) end
local function day_end(ms) return (day_of(ms) + 1) * DAY end

-- The state, read once and written back in one HSET (only where it exists, or once the
-- script admits: a refusal must not create it without a deadline).
local names = {'t', 'r', 'd', 'ds', 'm', 'ms', 'L', 'E', 'S', 'u'}
local got = redis.call('HMGET', ST, unpack(names))
local meta, dirty, exists = {}, {}, false
for i, name in ipairs(names) do
  if got[i] then exists = true end
  meta[name] = tonumber(got[i]) or 0
end
local function set(name, v)
  if meta[name] ~= v then
    meta[name] = v
    dirty[name] = true
  end
end
local function flush()
  if not exists then return end
  local args = {}
  for name in pairs(dirty) do
    args[#args + 1] = name
    args[#args + 1] = n(meta[name])
  end
  if #args > 0 then redis.call('HSET', ST, unpack(args)) end
  dirty = {}
end

-- Moves the periods on to those of `at` (a new period starts with nothing settled).
local function roll(at)
  local d, m = day_of(at), month_of(at)
  if d > meta.d then set('d', d); set('ds', 0) end
  if m > meta.m then set('m', m); set('ms', 0) end
end

-- Settles `nanos` at time `at`, in its day and month (an earlier period than one already
-- seen — a server clock that went back — is over: nothing of it is kept).
local function charge(at, nanos)
  roll(at)
  if day_of(at) == meta.d then set('ds', meta.ds + nanos) end
  if month_of(at) == meta.m then set('ms', meta.ms + nanos) end
end

-- (id, number) of a member "<id>|<nanos>" or "<id>|<r|s><tokens>".
local function parse(m)
  local id, num = string.match(m, '^(.*)|%a?(%d+)$')
  return id, tonumber(num)
end

-- Whether a permit id is a top-up's.
local function is_top_up(id) return string.sub(id, 1, 1) == '+' end

-- Brings the key to now: leases that ended are settled at their reservation at their end,
-- in end order; the ledger and the requests pruned; the periods rolled.
local function advance(W)
  -- Past a group's deadline its keys are gone (expired: nothing in them counted any
  -- more), so are their totals. Otherwise the totals are exact: a set Redis deleted
  -- because it emptied sums to 0 already.
  if now >= meta.E then set('t', 0) end
  if now >= meta.S then set('r', 0); set('u', 0) end
  while true do
    local gone = redis.call('ZRANGEBYSCORE', INF, '-inf', now_s, 'WITHSCORES', 'LIMIT', 0, CHUNK)
    if #gone == 0 then break end
    local members = {}
    for i = 1, #gone, 2 do
      local id, nanos = parse(gone[i])
      set('r', meta.r - nanos)
      if is_top_up(id) then set('u', meta.u - 1) end
      charge(tonumber(gone[i + 1]), nanos)
      members[#members + 1] = gone[i]
    end
    redis.call('ZREM', INF, unpack(members))
    if #gone < 2 * CHUNK then break end
  end
  roll(now)
  while true do
    local gone = redis.call('ZRANGEBYSCORE', LED, '-inf', now_s, 'LIMIT', 0, CHUNK)
    if #gone == 0 then break end
    for _, m in ipairs(gone) do
      local _, tok = parse(m)
      set('t', meta.t - tok)
    end
    redis.call('ZREM', LED, unpack(gone))
    if #gone < CHUNK then break end
  end
  redis.call('ZREMRANGEBYSCORE', WIN, '-inf', n(now - W))
end

-- Deadlines: moves E to cover `until_ + W` and S to cover that and the end of the month of
-- `until_` (plus the margin, with a margin of hysteresis: most scripts move neither).
-- Returns whether E, S moved; the caller sets the keys' TTLs.
local function deadlines(until_, W, margin)
  local moved_e, moved_s = false, false
  local need_e = until_ + W + margin
  if meta.E < need_e then
    set('E', need_e + margin)
    moved_e = true
  end
  local need_s = math.max(until_ + W, month_end(until_)) + margin
  if meta.S < need_s then
    set('S', need_s + margin)
    moved_s = true
  end
  return moved_e, moved_s
end
