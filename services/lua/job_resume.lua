-- A resume moves an ended job back to its tenant's queue in one script, so two resumes, or a
-- resume and a learner's claim, cannot both act on it. The end set every key of the job to
-- expire (retention): they are kept again. The end's fields go, and its crash count (whoever
-- resumes it has seen why it ended); `resumed_from` and `resumed_error` keep what it ended
-- as, and `resumes` counts the resumes, which is how the learner's claim tells a resumed
-- PENDING job from a new one.
-- KEYS: the tenant's queue, the job's changed channel, its checkpoints, its spend hash, then
-- every key of the job (its record first). ARGV: now, the id, the queue's limit, and a new
-- spec (JSON; '' keeps the spec). A FAILED or CANCELLED job resumes, and one a spend cap
-- ended (SUCCEEDED, its reason `spend cap reached ...`): its refusal is cleared, so its calls
-- go on until a cap (raised in the new spec, or the tenant's next month) binds again.
local record = KEYS[5]
local current = redis.call('HGET', record, 'status')
local error = redis.call('HGET', record, 'error') or ''
local capped = current == 'SUCCEEDED' and string.sub(error, 1, #ARGV[5]) == ARGV[5]
if current ~= 'FAILED' and current ~= 'CANCELLED' and not capped then return current or false end
if redis.call('LLEN', KEYS[3]) == 0 then return 'NO_CHECKPOINT' end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 'QUEUE_FULL' end
redis.call('HDEL', record, 'finished', 'error', 'cancel_requested', 'paused_reason', 'paused_since')
redis.call('HDEL', record, 'restarts_at_step')
redis.call('HSET', record, 'status', 'PENDING', 'resumed_from', current, 'resumed_error', error)
if ARGV[4] ~= '' then redis.call('HSET', record, 'spec', ARGV[4]) end
redis.call('HDEL', KEYS[4], 'refused', 'refused_by')
redis.call('HINCRBY', record, 'resumes', 1)
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
for i = 5, #KEYS do redis.call('PERSIST', KEYS[i]) end
redis.call('PUBLISH', KEYS[2], 'PENDING')
return 'RESUMED'
