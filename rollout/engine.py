"""One vLLM `AsyncLLM`: token ids in, token ids + behaviour logprobs + versions out.

Generation is interruptible. A weight update pauses the engine; in `abort` mode in-flight
requests come back with their partial tokens and are resubmitted (prompt + partial) once
the new weights are in, so every token is tagged with the version that actually produced
it and no KV cache from old weights is reused. In `keep` mode requests freeze and continue
on their stale KV cache; each streamed chunk is tagged with the version current when it
arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from services import protocol
from services.config import ModelSpec
from services.stats import BusyClock

log = logging.getLogger(__name__)
EXTENSION = "rollout.weight_receiver.WeightReceiverExtension"


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    """`stop` (end-of-turn token) or `length` (hit max_tokens: truncated)."""


def parameter_count(folder: str) -> int:
    """Parameters in the safetensors files of `folder`, read from their headers alone."""
    import json
    import struct

    count = 0
    for file in Path(folder).glob("*.safetensors"):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count += math.prod(entry["shape"])
    return count


def gpu_total_bytes() -> int:
    """Memory of the first visible GPU, asked of NVML through vLLM (creates no CUDA context
    in this process, which vLLM's workers would then have to be spawned around)."""
    from vllm.platforms import current_platform

    return current_platform.get_device_total_memory(0)


def receive_share(model: ModelSpec, on_gpu: bool) -> float:
    """The share of the GPU's memory the weight receiver's buffers take (a whole model in
    the wire dtype, kept across updates: `services.weight_group.receive_buckets`). They
    live outside vLLM's budget, so the engine is given that much less."""
    if not on_gpu:
        return 0.0
    wire_bytes = 2 if model.resolved_dtype(on_gpu) in ("bfloat16", "float16") else 4
    return parameter_count(model.local_folder()) * wire_bytes / gpu_total_bytes()


def engine_share(model: ModelSpec, on_gpu: bool, memory_utilization: float | None, receives_weights: bool) -> float:
    """vLLM's `gpu_memory_utilization`: the share asked for (vLLM's 0.85 on a GPU; on CPU
    the share of RAM), less the weight receiver's buffers on a GPU."""
    share = (memory_utilization or (0.85 if on_gpu else 0.3)) - (
        receive_share(model, on_gpu) if receives_weights else 0.0
    )
    if share < MIN_ENGINE_SHARE:
        raise ValueError(
            f"the engine's memory share {memory_utilization or 0.85} less the received weights' leaves {share:.3f} "
            f"of the GPU for vLLM: give it a GPU of its own or a larger share (TANDEM_MEMORY_UTILIZATION)"
        )
    return share


MIN_ENGINE_SHARE = 0.05
"""The least share of a GPU left to vLLM after the receiver's buffers: below it the weights
and a KV cache cannot fit, and vLLM's own error would not say why."""


def engine_options(
    model: ModelSpec,
    kv_cache_gib: float,
    seed: int = 0,
    memory_utilization: float | None = None,
    seeded_requests: bool = False,
    receives_weights: bool = False,
) -> dict:
    """vLLM's settings for this machine, shared by the rollout engine and `tandem
    serve-model` (so a served judge runs as the policy does); sets the environment the CPU
    build reads. `seeded_requests`: requests carry their own sampling seed (the judge
    proxy's calls do). `receives_weights`: the learner's broadcast lands in buffers beside
    the engine (a rollout engine), whose memory comes out of vLLM's share on a GPU."""
    # vLLM reports usage to its maintainers' server unless told not to; Tandem sends
    # nothing anywhere but Redis and the judge proxy (an operator may set it to 0).
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    import torch

    on_gpu = torch.cuda.is_available()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
    if not on_gpu:
        # Run the worker inside the engine-core process (the "uni" executor below; vLLM's
        # CPU platform swaps it for a worker process unless this is 0). A worker process
        # spins (sched_yield) for a second after every step, waiting for the next: under
        # a steady trickle of requests it never stops, which burnt 0.7 of one of this
        # machine's two cores (py-spy, bench/async_speedup.py). vLLM keeps its engine core
        # in a separate process either way.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    options = dict(
        model=model.local_folder(),
        dtype=model.resolved_dtype(on_gpu),
        max_model_len=model.max_model_len,
        enforce_eager=not on_gpu,
        gpu_memory_utilization=engine_share(model, on_gpu, memory_utilization, receives_weights),
        distributed_executor_backend=None if on_gpu else "uni",
        seed=seed,
    )
    if seeded_requests and not on_gpu:
        # A prompt prefilled in chunks samples a token at each chunk and throws it away,
        # then winds the request's generator back, which a CPU generator cannot do: with a
        # seeded request in a partial prefill the CPU engine dies ("CPU Generator does not
        # use offset"; a served simulator under ten concurrent 600-token prompts). Whole
        # prompts only, with a step budget that fits the longest.
        options |= dict(enable_chunked_prefill=False, max_num_batched_tokens=max(model.max_model_len, 2048))
    return options


RESUME_WAIT_S = 5.0
"""How long the end of a pause waits for vLLM to confirm the resume. vLLM carries out the
resume in order once it is sent, confirmed or not; a wedged engine never confirms, and a
server exiting (its update cancelled) must not wait on it."""

RELOAD_BYTES_PER_S = 50e6
"""The slowest read of a model's weights `reload_timeout_s` allows: below any disk a model
is served from (a network volume reads 100 MB/s and more)."""
RELOAD_FIXED_S = 60.0
"""The part of a reload that does not grow with the weights (vLLM's bookkeeping, a cold cache)."""


def reload_timeout_s(folder: str) -> float:
    """How long a reload of the weights in `folder` may take before the engine counts as wedged."""
    weight_bytes = sum(file.stat().st_size for file in Path(folder).glob("*.safetensors"))
    return RELOAD_FIXED_S + weight_bytes / RELOAD_BYTES_PER_S


class Engine:
    def __init__(self, llm, model: ModelSpec) -> None:
        self.llm = llm
        self.model = model
        self.version = 0
        self._serving = asyncio.Event()
        self._serving.set()
        self._pause_mode = "abort"
        self.busy = BusyClock()
        """Time with at least one request generating. In `keep` mode a request frozen
        through a weight update counts as busy; in `abort` mode it does not."""
        self.requests = 0
        """Requests submitted to vLLM and not yet finished (`generate` and `score`)."""
        self.progress_at = time.monotonic()
        """When vLLM last produced output, or a request found none in flight, or the
        workers came back from a weight update or reload (monotonic clock)."""
        self._in_collective = False
        """Set while the workers are in a weight update's or a reload's collective call."""
        self.unanswered_since: float | None = None
        """When vLLM was sent a pause or resume it has not answered (None: none). A wedged
        engine answers none, and with no request in flight nothing else would show it."""
        self.devices: list[str] = []
        """Each worker's device (`weight_group.device_identity`), once `identify_devices` ran."""

    @property
    def dead(self) -> bool:
        """vLLM's engine process died (a crash, the OOM killer): every request fails from
        then on, and only a new process brings the engine back."""
        return self.llm is not None and bool(self.llm.errored)

    def stalled_s(self) -> float:
        """Seconds vLLM has produced nothing while requests are in flight, or has left a
        pause or resume unanswered: a wedged engine (alive, not errored) grows it without
        bound. 0 when idle, and while the workers are in a weight update or reload, which
        waits on the learner or the disk instead."""
        if self._in_collective:
            return 0.0
        now = time.monotonic()
        unanswered = 0.0 if self.unanswered_since is None else now - self.unanswered_since
        return max(unanswered, now - self.progress_at if self.requests else 0.0)

    @classmethod
    def start(
        cls, model: ModelSpec, kv_cache_gib: float, seed: int = 0, memory_utilization: float | None = None
    ) -> Engine:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            **engine_options(model, kv_cache_gib, seed, memory_utilization, receives_weights=True),
            skip_tokenizer_init=True,
            worker_extension_cls=EXTENSION,
            # Behaviour logprobs must be those of the distribution actually sampled from
            # (after temperature), which the learner recomputes the same way.
            logprobs_mode="processed_logprobs",
            disable_log_stats=False,
        )
        return cls(AsyncLLM.from_engine_args(args), model)

    async def identify_devices(self) -> None:
        """Ask the workers which devices they run on (reported with the server's heartbeat)."""
        self.devices = list(await self.llm.collective_rpc("tandem_device"))

    async def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        temperature: float,
        stop_ids: list[int],
        ignore_eos: bool = False,
    ) -> Generation:
        """Sample up to `max_tokens` after `prompt`, stopping at `stop_ids` (and the model's
        EOS ids unless `ignore_eos`); each token tagged with the version that produced it."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        out = Generation()
        while True:
            await self._serving.wait()
            submitted = self.version
            params = SamplingParams(
                max_tokens=max_tokens - len(out.tokens),
                temperature=temperature,
                logprobs=0,
                detokenize=False,
                stop_token_ids=stop_ids,
                ignore_eos=ignore_eos,
                output_kind=RequestOutputKind.DELTA,
            )
            request = TokensPrompt(prompt_token_ids=prompt + out.tokens)
            self.busy.start()
            try:
                async for chunk in self._outputs(request, params):
                    completion = chunk.outputs[0]
                    tag = submitted if self._pause_mode == "abort" else self.version
                    out.tokens += completion.token_ids
                    out.logprobs += [next(iter(d.values())).logprob for d in completion.logprobs]
                    out.versions += [tag] * len(completion.token_ids)
                    out.finish_reason = completion.finish_reason or ""
            finally:
                self.busy.stop()
            if out.finish_reason != "abort":
                return out

    async def score(self, tokens: list[int]) -> list[float]:
        """Logprob of each token of `tokens` given the ones before it (0.0 for the first)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        final = None
        async for output in self._outputs(TokensPrompt(prompt_token_ids=tokens), params):
            final = output  # a streamed request: the last output holds the whole prompt's logprobs
        if final is None:
            raise RuntimeError("vLLM streamed no output for a scoring request")
        return [0.0] + [entry[token].logprob for entry, token in zip(final.prompt_logprobs[1:], tokens[1:])]

    async def _outputs(self, request, params):
        """vLLM's streamed outputs for one request, each noted as progress."""
        if self.requests == 0:
            self.progress_at = time.monotonic()
        self.requests += 1
        try:
            async for output in self.llm.generate(request, params, uuid.uuid4().hex):
                self.progress_at = time.monotonic()
                yield output
        finally:
            self.requests -= 1

    async def update_weights(
        self, plan: protocol.WeightPlan, plan_bytes: bytes, first_rank: int, pause_mode: str
    ) -> dict:
        """Pause, receive the broadcast into every worker, reload, resume."""
        self._pause_mode = pause_mode
        async with self._paused(pause_mode):
            # vLLM's uni executor ignores this timeout: Weights.update's deadline bounds the call.
            timeout = plan.timeout_s * (len(plan.buckets) + 1)
            async with self._collective():
                results = await self.llm.collective_rpc(
                    "tandem_receive", timeout=timeout, args=(plan_bytes, first_rank)
                )
            # Kept requests hold KV computed by the old weights: preempting them makes the
            # engine recompute it with the new ones (the prefix cache cannot be reset while
            # any request holds blocks, and vLLM then only warns).
            await self.llm.reset_prefix_cache(reset_running_requests=pause_mode == "keep")
            self.version = plan.version
            return results[0]

    async def reload_from_disk(self, path: str) -> None:
        """Back to the weights in `path` (a new job on the same model), version 0; a
        TimeoutError after `reload_timeout_s(path)` (vLLM's own `timeout` bounds nothing in
        its uni executor)."""
        async with asyncio.timeout(reload_timeout_s(path)), self._paused("abort"):
            async with self._collective():
                await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            await self.llm.reset_prefix_cache()
            self.version = 0

    @contextlib.asynccontextmanager
    async def _paused(self, mode: str):
        """Generation paused for the block; new requests wait for it to end."""
        self._serving.clear()
        try:
            async with self._answered():
                await self.llm.pause_generation(mode=mode, clear_cache=mode == "abort")
            yield
        finally:
            # Serving first (vLLM queues what arrives until the resume): should the pause
            # or the resume never return (a wedged engine, cut off by the caller's
            # deadline), the call left unanswered and the requests let in show the wedge
            # in `stalled_s`. A resume answered late still clears it.
            self._serving.set()
            resume = asyncio.ensure_future(self._resume())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RESUME_WAIT_S):
                    await asyncio.shield(resume)

    async def _resume(self) -> None:
        async with self._answered():
            await self.llm.resume_generation()

    @contextlib.asynccontextmanager
    async def _answered(self):
        """A pause or resume sent to vLLM: unanswered (cut off, or never returning), it
        counts in `stalled_s` from when it was sent until a later one is answered."""
        if self.unanswered_since is None:
            self.unanswered_since = time.monotonic()
        yield
        self.unanswered_since = None  # reached only when the call returned

    @contextlib.asynccontextmanager
    async def _collective(self):
        """A call into every worker that waits on something outside the engine (the
        learner's broadcast, the disk): no stall however long it takes, and in-flight
        requests count their stall from its end."""
        self._in_collective = True
        try:
            yield
        finally:
            self._in_collective = False
            self.progress_at = time.monotonic()

    def shutdown(self) -> None:
        import gc

        self.llm.shutdown()
        # Collect now, while modules are alive: AsyncLLM.__del__ shuts down again and
        # fails noisily if that first happens at interpreter exit. A shut-down engine is
        # not dead: `dead` (read by health checks) stays False.
        self.llm = None
        gc.collect()
