"""The rollout server process: one engine, episodes, rewards, advantages.

It watches `jobs:running`. For a job it (re)loads the job's model, announces itself in
`rollout:servers`, waits to be included in a weight update (the learner's version 0 is
the warm-started policy), then consumes the job's `tasks` stream in group `rollout`,
writes one `TrajectoryGroup` per task and acknowledges the task after the group is in
Redis. Weight updates pause the engine, reload in place and resume.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram, Summary
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollout.concurrent import gather_all
from rollout.engine import Engine
from rollout.episode import MALFORMED_REASONS, Episode, EpisodeRunner
from rollout.interactions.llm_user import LLMUser
from rollout.rewards.advantage import group_advantages
from rollout.rewards.conversation import episode_reward
from rollout.rewards.multiturn import score_response
from rollout.tasks import load_task
from services import jobs, protocol
from services.config import JobSpec, RolloutSettings
from services.judge_client import JudgeClient
from services.metrics import serve_metrics
from services.queues import Delivery, Keys, StreamConsumer, publish
from services.stats import TrailingRate, mean_by_key
from services.tokenization import ChatTokenizer, TokenizationMismatch

log = logging.getLogger(__name__)

TASKS = Counter("tandem_rollout_tasks_total", "Tasks finished, by outcome", ["job", "outcome"])
TOKENS = Counter("tandem_rollout_generated_tokens_total", "Tokens the policy generated", ["job"])
EPISODE_SECONDS = Histogram(
    "tandem_rollout_task_seconds", "Wall time of one task (all episodes and rewards)",
    ["job"], buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
EPISODE = Histogram(
    "tandem_rollout_episode_seconds", "One sample: its conversation (or response) and its reward", ["job"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
SYNC_SECONDS = Histogram(
    "tandem_rollout_weight_sync_seconds", "Pause, receive, reload, resume", ["job"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
INFLIGHT = Gauge("tandem_rollout_inflight_tasks", "Tasks being worked on", ["job"])
ENGINE_BUSY = Counter("tandem_rollout_engine_busy_seconds_total",
                      "Seconds the engine had at least one request generating", ["job"])
ENGINE_BUSY_RATIO = Gauge("tandem_rollout_engine_busy_ratio",
                          "Share of the last minute the engine had a request generating", ["job"])
VERSION = Gauge("tandem_rollout_weight_version", "Weight version served", ["job"])
REWARD = Histogram("tandem_rollout_reward", "Sample rewards", ["job"],
                   buckets=(-1, -0.5, 0, 0.1, 0.25, 0.5, 0.75, 0.9, 1, 1.5, 2))
# A histogram with a negative bucket exports no _sum (the client leaves it out, since such a
# sum need not grow monotonically), so the mean reward comes from this summary's _sum/_count.
REWARD_TOTAL = Summary("tandem_rollout_sample_reward", "Sample rewards, for their mean", ["job"])


REDIS_REPLY_TIMEOUT_S = 30.0
"""The longest wait for any Redis reply. Every blocking read here blocks for well under a
second, so a reply this late is lost: the wait ends in a TimeoutError, which `run` treats
as an outage (serve again), instead of a silent hang. A blocking XREADGROUP that never
returned once held a server between two jobs, its task group unable to finish."""


class BadTask(ValueError):
    """A task message whose content no retry can fix; it goes to the dead-letter stream."""


class RolloutServer:
    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings
        self.server_id = settings.server_id or f"{socket.gethostname()}-{os.getpid()}"
        self.redis = aioredis.from_url(settings.redis_url, socket_timeout=REDIS_REPLY_TIMEOUT_S)
        self.engine: Engine | None = None
        self.job_id = ""
        self.synced = asyncio.Event()
        self.synced_plan: tuple[str, int, int] | None = None
        """(learner session, epoch, version) of the last plan applied."""
        self.inflight: dict[bytes, asyncio.Task] = {}
        self.consumer: StreamConsumer | None = None
        self.judge_client = JudgeClient(settings.judge_url, token=settings.judge_token,
                                        max_connections=settings.judge_max_connections)
        self.judge_model: str | None = None
        self.reward_slots = asyncio.Semaphore(settings.max_concurrent_rewards)
        self.busy_exported_s = 0.0
        """The engine's busy seconds already counted under the current job."""
        self.busy_rate = TrailingRate(window_s=60.0)

    def health(self) -> tuple[bool, dict]:
        return True, {"server_id": self.server_id, "job": self.job_id,
                      "version": self.engine.version if self.engine else -1,
                      "inflight": len(self.inflight)}

    async def run(self) -> None:
        serve_metrics(self.settings.metrics_port, self.health)
        log.info("rollout server %s up: %s", self.server_id, self.settings.loggable())
        backoff_s = 1.0
        try:
            while True:
                started = time.monotonic()
                try:
                    async with asyncio.TaskGroup() as group:
                        group.create_task(self.heartbeat())
                        group.create_task(self.serve_jobs())
                except* (RedisConnectionError, RedisTimeoutError) as errors:
                    # Redis restarting or a network blip: keep the loaded engine, start over
                    # (the job's pending tasks wait in Redis; the learner regroups weights).
                    backoff_s = 1.0 if time.monotonic() - started > 60 else min(2 * backoff_s, 30.0)
                    log.warning("Redis unreachable (%s); serving again in %.0f s", errors.exceptions[0], backoff_s)
                    await asyncio.sleep(backoff_s)
        finally:
            await self.redis.hdel(Keys.rollout_servers, self.server_id)
            await self.judge_client.aclose()
            if self.engine:
                self.engine.shutdown()

    async def heartbeat(self) -> None:
        while True:
            info = protocol.ServerInfo(
                server_id=self.server_id, heartbeat=time.time(), job_id=self.job_id,
                version=self.synced_plan[2] if self.synced_plan else -1,
                capacity=self.settings.max_concurrent_tasks, inflight=len(self.inflight),
                engine=self.engine.model.path if self.engine else "",
            )
            await self.redis.hset(Keys.rollout_servers, self.server_id, protocol.encode(info))
            if self.consumer and self.inflight:
                await self.consumer.touch(*self.inflight)
            self.export_engine_busy()
            await asyncio.sleep(self.settings.heartbeat_s)

    def export_engine_busy(self) -> None:
        """The engine's busy seconds since the last heartbeat, and its busy share of the
        last minute, under the job being served."""
        if self.engine is None or not self.job_id:
            return
        busy_s = self.engine.busy.busy_s()
        ENGINE_BUSY.labels(self.job_id).inc(busy_s - self.busy_exported_s)
        ENGINE_BUSY_RATIO.labels(self.job_id).set(self.busy_rate.add(time.monotonic(), busy_s))
        self.busy_exported_s = busy_s

    async def serve_jobs(self) -> None:
        while True:
            running = await jobs.running_jobs(self.redis)
            if not running:
                await asyncio.sleep(0.5)
                continue
            job_id = running[0]
            try:
                spec = await jobs.job_spec(self.redis, job_id)
                runner, task_set = await self.prepare_job(job_id, spec)
            except Exception as err:  # a model that does not load, an unknown task...
                log.exception("cannot serve job %s", job_id)
                await self.redis.hset(Keys.job(job_id), "rollout_error", f"{self.server_id}: {type(err).__name__}: {err}")
                await self.wait_until_job_ends(job_id)  # the learner fails it; do not retry in a loop
                continue
            await self.serve_job(job_id, spec, runner, task_set)

    async def prepare_job(self, job_id: str, spec: JobSpec) -> tuple[EpisodeRunner, object]:
        """The engine with the job's model, its tokenizer, task set and user."""
        log.info("serving job %s (model %s)", job_id, spec.model.path)
        await self.prepare_engine(spec)
        chat = ChatTokenizer(_load_tokenizer(spec.model.path), spec.rollout.tokenization_check)
        task_set = load_task(spec.task, spec.train.seed, judge=self.judge)
        user = task_set.rule_user or LLMUser(self.judge_client, task_set.goal, spec.reward.user_model, job=job_id)
        self.judge_model = spec.reward.judge_model
        return EpisodeRunner(self.engine, chat, user, spec.rollout), task_set

    async def serve_job(self, job_id: str, spec: JobSpec, runner: EpisodeRunner, task_set) -> None:
        consumer = await StreamConsumer(
            self.redis, Keys.tasks(job_id), "rollout", self.server_id, protocol.Task,
            Keys.dead(job_id), max_deliveries=3,
        ).setup()
        self.job_id, self.synced_plan, self.consumer = job_id, None, consumer
        self.synced.clear()
        # Engine busy time counts from here, under this job (the engine may be new).
        self.busy_exported_s, self.busy_rate = self.engine.busy.busy_s(), TrailingRate(window_s=60.0)
        try:
            # Weights and tasks run until the job leaves `jobs:running`; leaving the group by
            # an exception cancels both (and a failure in either one propagates).
            async with asyncio.TaskGroup() as group:
                group.create_task(self.follow_weights(job_id, spec))
                group.create_task(self.consume_tasks(job_id, spec, consumer, runner, task_set))
                await self.wait_until_job_ends(job_id)
                raise _JobEnded
        except* _JobEnded:
            log.info("job %s ended", job_id)
        finally:
            for task in self.inflight.values():
                task.cancel()
            self.inflight.clear()
            self.job_id, self.consumer = "", None

    async def prepare_engine(self, spec: JobSpec) -> None:
        if self.engine and self.engine.model == spec.model:
            await self.engine.reload_from_disk(spec.model.path)
            return
        if self.engine:
            self.engine.shutdown()
        self.engine = await asyncio.to_thread(
            Engine.start, spec.model, self.settings.kv_cache_gib, spec.train.seed, self.settings.memory_utilization
        )

    async def wait_until_job_ends(self, job_id: str) -> None:
        while job_id in await jobs.running_jobs(self.redis):
            await asyncio.sleep(0.5)

    async def follow_weights(self, job_id: str, spec: JobSpec) -> None:
        """Apply every weight plan that names this server, as soon as it is announced."""
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(Keys.events(job_id))
        try:
            while True:
                await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
                plan_bytes = await self.redis.hget(Keys.weights(job_id), "plan")
                if plan_bytes:
                    await self.apply_plan(job_id, spec, plan_bytes)
        finally:
            await pubsub.aclose()

    async def apply_plan(self, job_id: str, spec: JobSpec, plan_bytes: bytes) -> None:
        plan = protocol.decode(plan_bytes, protocol.WeightPlan)
        key = (plan.session, plan.epoch, plan.version)
        if key == self.synced_plan or self.server_id not in plan.ranks:
            return
        started = time.perf_counter()
        try:
            result = await self.engine.update_weights(
                plan, plan_bytes, plan.ranks[self.server_id], spec.rollout.pause_mode
            )
        except Exception:  # a missed collective: wait to be included in the next epoch
            log.exception("weight update to version %d failed", plan.version)
            self.synced_plan = key
            return
        seconds = time.perf_counter() - started
        self.synced_plan = key
        SYNC_SECONDS.labels(job_id).observe(seconds)
        VERSION.labels(job_id).set(plan.version)
        ack = protocol.WeightAck(server_id=self.server_id, version=plan.version, epoch=plan.epoch,
                                 seconds=seconds)
        await self.redis.hset(Keys.weights(job_id), f"ack:{self.server_id}", protocol.encode(ack))
        log.info("weights v%d in %.3fs (%s)", plan.version, seconds, result)
        self.synced.set()

    async def consume_tasks(self, job_id: str, spec: JobSpec, consumer: StreamConsumer,
                            runner: EpisodeRunner, task_set) -> None:
        """Keep up to `max_concurrent_tasks` tasks in flight: first this consumer's own
        pending ones (a restart), then new ones, then ones idle consumers left behind."""
        await self.synced.wait()
        capacity = self.settings.max_concurrent_tasks
        backlog = await consumer.read_own_pending(capacity)
        last_reclaim = 0.0
        while True:
            free = capacity - len(self.inflight)
            if free == 0:
                await asyncio.wait(list(self.inflight.values()), return_when=asyncio.FIRST_COMPLETED)
                continue
            deliveries, backlog = backlog[:free], backlog[free:]
            if not deliveries:
                deliveries = await consumer.read(free, block_ms=200)
            if not deliveries and time.monotonic() - last_reclaim > self.settings.heartbeat_s:
                last_reclaim = time.monotonic()
                deliveries = await consumer.reclaim(int(self.settings.task_reclaim_idle_s * 1000), free)
            for delivery in deliveries:
                task = asyncio.create_task(self.run_task(job_id, spec, consumer, runner, task_set, delivery))
                self.inflight[delivery.entry_id] = task
                task.add_done_callback(lambda _, key=delivery.entry_id: self.inflight.pop(key, None))
            INFLIGHT.labels(job_id).set(len(self.inflight))

    async def run_task(self, job_id: str, spec: JobSpec, consumer: StreamConsumer,
                       runner: EpisodeRunner, task_set, delivery: Delivery) -> None:
        task = delivery.message
        started = time.perf_counter()
        try:
            if not 0 <= task.example < len(task_set):
                raise BadTask(f"example {task.example} outside the task set (size {len(task_set)})")
            group = await self.rollout_group(job_id, spec, runner, task_set, task)
            group.elapsed_s = time.perf_counter() - started
            await publish(self.redis, Keys.trajectories(job_id), group)
            await consumer.ack(delivery.entry_id)
        except asyncio.CancelledError:
            raise
        except (BadTask, TokenizationMismatch) as err:  # bad task content: no retry can fix it
            await consumer.dead_letter(delivery.entry_id, protocol.encode(task), str(err))
            TASKS.labels(job_id, "dead").inc()
            return
        except Exception:
            log.exception("task %d failed; it stays pending for a retry", task.task_id)
            TASKS.labels(job_id, "error").inc()
            return
        TASKS.labels(job_id, "ok").inc()
        EPISODE_SECONDS.labels(job_id).observe(time.perf_counter() - started)

    async def rollout_group(self, job_id: str, spec: JobSpec, runner: EpisodeRunner, task_set,
                            task: protocol.Task) -> protocol.TrajectoryGroup:
        """`group_size` responses to the task's context. Episode mode: each is a whole
        conversation, scored by R* and trained on all its assistant turns. Multiturn mode:
        each is one response m_j, scored by MR over sampled futures and trained alone."""
        context = task_set.context(task.example)

        async def one(index: int) -> protocol.Sample:
            started = time.perf_counter()
            if spec.reward.mode == "episode":
                episode = await runner.run(task.example, context)
            else:
                episode = runner.start(context)
                await runner.policy_turn(episode)
            async with self.reward_slots:
                reward, scored = await self.score(spec, runner, task_set, task.example, episode)
            TOKENS.labels(job_id).inc(episode.policy_tokens)
            REWARD.labels(job_id).observe(reward)
            REWARD_TOTAL.labels(job_id).observe(reward)
            EPISODE.labels(job_id).observe(time.perf_counter() - started)
            return protocol.Sample(
                sample_id=f"{job_id}:{task.task_id}:{index}", tokens=episode.tokens, mask=episode.mask,
                logprobs=episode.logprobs, versions=episode.versions, reward=reward, advantage=0.0,
                num_turns=episode.num_turns, metrics=sample_metrics(task_set, task.example, episode, scored),
            )

        samples = await gather_all(*(one(i) for i in range(task.group_size)))
        advantages = group_advantages([s.reward for s in samples], spec.reward.scale_advantage_by_std)
        for sample, advantage in zip(samples, advantages):
            sample.advantage = advantage
        return protocol.TrajectoryGroup(job_id=job_id, task_id=task.task_id, samples=list(samples),
                                        server_id=self.server_id, elapsed_s=0.0)

    async def score(self, spec: JobSpec, runner: EpisodeRunner, task_set, example: int,
                    episode: Episode) -> tuple[float, list[Episode]]:
        """The sample's reward and the conversations it was computed from."""
        if spec.reward.mode == "episode":
            return await episode_reward(task_set, example, episode, spec.reward, self.judge), [episode]
        return await score_response(runner, episode, task_set, example, spec.reward, self.judge)

    async def judge(self, rubric: str, messages: list[dict], reference: str | None) -> float:
        """R_llm through the judge proxy (the `Judge` callable rewards take)."""
        result = await self.judge_client.judge(rubric, messages, reference, job=self.job_id, model=self.judge_model)
        return result.score


def sample_metrics(task_set, example: int, episode: Episode, scored: list[Episode]) -> dict[str, float]:
    """Task metrics averaged over the scored conversations (the episode itself, or the
    futures behind MR), the response's own length and format (`malformed_<reason>`: 1.0 for
    the reason the format filter rejected it), and, when futures were sampled, the share
    of them a later policy turn left malformed."""
    rows = [task_set.metrics(example, c.messages) | {"conversation_tokens": float(c.policy_tokens)}
            for c in scored if c.well_formed()]
    reason = episode.malformed_reason()
    own = {"tokens": float(episode.policy_tokens), "well_formed": float(not reason)}
    own |= {f"malformed_{r}": float(reason == r) for r in MALFORMED_REASONS}
    if scored and scored[0] is not episode:
        own["futures_malformed"] = sum(not c.well_formed() for c in scored) / len(scored)
    return mean_by_key(rows) | own


class _JobEnded(Exception):
    pass


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
