-- fenced(KEYS[job], ARGV[token]): true when a write carries a token ('' is a write outside any
-- lease: the API, tests) that is no longer the job's (services.job_lease).
local function fenced(job, token)
  return token ~= '' and redis.call('HGET', job, 'fence') ~= token
end
