-- KEYS: health. A probe that could not go (no budget) lets the next call take it.
if redis.call('HGET', KEYS[1], 'state') == 'half_open' then
  redis.call('HSET', KEYS[1], 'probe_until', string.format('%.6f', now_s()))
end
