-- The history list keeps a job's newest records; `history_dropped` in the job's record counts
-- those dropped from its head, so a record's global index (its place in the whole history,
-- as `metrics.jsonl` in the run folder keeps it) is `history_dropped` + its index in the list.
if fenced(KEYS[2], ARGV[3]) then return 0 end
local length = redis.call('RPUSH', KEYS[1], ARGV[1])
local keep = tonumber(ARGV[2])
if length > keep then
  redis.call('LTRIM', KEYS[1], length - keep, -1)
  redis.call('HINCRBY', KEYS[2], 'history_dropped', length - keep)
end
redis.call('PUBLISH', KEYS[3], 'step')
return 1
