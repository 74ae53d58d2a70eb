"""Where the learner and the rollout engine run on one machine: learner ranks, compute
threads per rank, engine threads, and on GPUs which device each gets.

Both run at once (generation overlaps training), so no process with several compute
threads shares its cores or its GPU unannounced: an OpenMP thread spins while it waits
for the others, and two CPU processes each with a thread per core slowed each other to a
fraction of their speed (`bench/shared_cpu_engines.py`: 0.07 of one engine's speed each,
0.68 with one thread each). The figures behind each choice are in
docs/results/placement.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

VLLM_GPU_MEMORY = 0.85
"""vLLM's share of a GPU's memory when nothing else is said (`rollout.engine.engine_options`)."""
SHARED_GPU_ENGINE_MEMORY = 0.3
"""vLLM's share of the one GPU it shares with the learner. vLLM's default (0.85) would
leave the learner too little: training holds about eight times the bytes per parameter
that serving does (fp32 weights, gradients and two Adam moments against bf16 weights),
plus activations, so the engine gets weights and a KV cache, the learner the rest."""


@dataclass(frozen=True)
class Placement:
    """One machine's plan. Threads are OpenMP (torch's intra-op) threads; GPU ids are
    CUDA_VISIBLE_DEVICES ids of the machine."""

    cores: int
    gpus: int
    learner_ranks: int
    """torchrun processes of the learner on this machine."""
    learner_threads: int
    """Compute threads of each learner rank."""
    engine_threads: int
    """Compute threads of the rollout server's vLLM engine."""
    learner_gpus: tuple[int, ...] = ()
    engine_gpus: tuple[int, ...] = ()
    engine_memory_utilization: float | None = None
    """vLLM's share of its GPU's memory when that GPU is shared; None: vLLM's default."""

    @property
    def shared_gpu(self) -> bool:
        return bool(set(self.learner_gpus) & set(self.engine_gpus))

    def learner_env(self) -> dict[str, str]:
        """Environment of the learner's torchrun: each rank's torch reads OMP_NUM_THREADS
        for its intra-op threads (and torchrun, finding it set, keeps it)."""
        return {"OMP_NUM_THREADS": str(self.learner_threads)} | _visible(self.learner_gpus)

    def engine_env(self, servers: int = 1) -> dict[str, str]:
        """Environment of a rollout server, one of `servers` on the engine's GPU. On CPU
        vLLM's engine runs its worker in the engine-core process (the `uni` executor,
        `rollout.engine.engine_options`), whose torch sizes its OpenMP pool from
        OMP_NUM_THREADS (vLLM's own per-core binding, VLLM_CPU_OMP_THREADS_BIND, applies
        only to its worker processes). On a GPU the servers split the engine's memory
        share evenly: each vLLM takes its share of the whole GPU, so two at the default
        0.85 would not both start."""
        env = {"OMP_NUM_THREADS": str(self.engine_threads)} | _visible(self.engine_gpus)
        share = self.engine_memory_utilization
        if self.engine_gpus and servers > 1:
            share = round((share or VLLM_GPU_MEMORY) / servers, 4)
        if share is not None:
            env["TANDEM_MEMORY_UTILIZATION"] = str(share)
        return env

    def describe(self) -> str:
        """One line for a log: what runs where."""
        where = "CPU" if not self.gpus else ("one shared GPU" if self.shared_gpu else "GPUs apart")
        return (
            f"{self.cores} cores, {self.gpus} GPUs ({where}): learner {self.learner_ranks} rank(s) x "
            f"{self.learner_threads} thread(s){_on(self.learner_gpus)}, engine {self.engine_threads} "
            f"thread(s){_on(self.engine_gpus)}"
        )


def plan_for(cores: int, gpus: int = 0) -> Placement:
    """The placement for a machine of `cores` CPU cores and `gpus` GPUs, with one rollout
    server beside the learner.

    - No GPU: the engine gets half the cores as threads; the learner one single-threaded
      gloo rank per other core, and one more on the engine's core when the engine has one
      thread. An OpenMP team (a process of several threads) collapses when anything else
      runs on its cores (its threads wait on each other at every barrier): on 2 shared
      cores a 2-thread learner beside a 1-thread engine trained at 0.04 of its speed
      alone, and a 2-thread engine under load generated at 0.23 of a 1-thread one.
      Single-threaded processes only time-share a core: two 1-thread ranks beside a
      1-thread engine kept 0.81 of the learner's speed and 0.83 of the engine's, against
      0.45 and 0.73 with one rank (`bench/placement.py`). Alone on quiet cores one rank
      with both threads was faster (its best RL step 1.36x, SFT 1.50x): a warm start,
      which trains while the engine idles, gives that up for RL steps that keep their
      speed beside generation. On one core both get that core: nothing to divide.
    - Two GPUs or more: the engine on GPU 0, the learner on the others, one rank each;
      vLLM reserves most of its GPU's memory, so they never share one.
    - One GPU: shared, stated rather than silent: one learner rank and the engine on GPU 0,
      vLLM held to `SHARED_GPU_ENGINE_MEMORY` of its memory.

    On GPUs the CPU threads only feed the devices: the cores are split evenly among the
    processes (each learner rank and the engine), at least one each."""
    if cores < 1 or gpus < 0:
        raise ValueError(f"a machine has at least one core and no negative GPUs (got {cores} cores, {gpus} GPUs)")
    if gpus == 0:
        engine = max(1, cores // 2)
        ranks = max(1, cores - engine + (1 if engine == 1 else 0))
        return Placement(cores, gpus, learner_ranks=ranks, learner_threads=1, engine_threads=engine)
    if gpus == 1:
        share = max(1, cores // 2)
        return Placement(
            cores,
            gpus,
            learner_ranks=1,
            learner_threads=share,
            engine_threads=share,
            learner_gpus=(0,),
            engine_gpus=(0,),
            engine_memory_utilization=SHARED_GPU_ENGINE_MEMORY,
        )
    share = max(1, cores // gpus)
    return Placement(
        cores,
        gpus,
        learner_ranks=gpus - 1,
        learner_threads=share,
        engine_threads=share,
        learner_gpus=tuple(range(1, gpus)),
        engine_gpus=(0,),
    )


def this_machine() -> Placement:
    """The plan for the cores this process may run on and the GPUs torch sees."""
    import torch

    return plan_for(len(os.sched_getaffinity(0)), torch.cuda.device_count())


def _visible(gpus: tuple[int, ...]) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else {}


def _on(gpus: tuple[int, ...]) -> str:
    return f" on GPU {','.join(map(str, gpus))}" if gpus else ""
