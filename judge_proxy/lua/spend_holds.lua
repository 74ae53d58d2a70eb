-- A hold is a member `<id>:<usd>:<tokens>` of its bill's holds zset, scored by when it
-- expires (Redis's clock), and its amounts are in the bill's `held_usd` and `held_tokens`.
-- Every script that reads the holds first drops the expired ones and takes their amounts
-- out of the sums: a proxy killed with calls in flight leaves nothing held for longer than
-- a hold's time to live.
local function drop_expired(bill, holds, now)
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', holds, '-inf', now)) do
    local _, _, usd, tokens = string.find(member, '^[^:]+:([^:]+):([^:]+)$')
    redis.call('HINCRBYFLOAT', bill, 'held_usd', -tonumber(usd))
    redis.call('HINCRBY', bill, 'held_tokens', -tonumber(tokens))
  end
  redis.call('ZREMRANGEBYSCORE', holds, '-inf', now)
end
