-- KEYS: bill and holds pairs. ARGV: the member, its usd and tokens. Gives back a hold that has
-- not expired (one that has was given back by the script that dropped it).
for k = 1, #KEYS / 2 do
  if redis.call('ZREM', KEYS[2 * k], ARGV[1]) == 1 then
    redis.call('HINCRBYFLOAT', KEYS[2 * k - 1], 'held_usd', -tonumber(ARGV[2]))
    redis.call('HINCRBY', KEYS[2 * k - 1], 'held_tokens', -tonumber(ARGV[3]))
  end
end
return 1
