-- now_s(): seconds on the Redis server's clock, which every replica's scripts share.
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
