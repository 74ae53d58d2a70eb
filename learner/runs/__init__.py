"""One run class per job kind, over a common base (`base.Run`); `run_for` is the one
place that maps a kind to its run."""

from __future__ import annotations

from learner.runs.base import Learner, Run
from learner.runs.generate import GenerateRun
from learner.runs.offline import OfflineRun
from learner.runs.rl import RLRun
from services.config import JobSpec

RUNS: dict[str, type[Run]] = {"rl": RLRun, "offline": OfflineRun, "generate": GenerateRun}


def run_for(learner: Learner, job_id: str, spec: JobSpec) -> Run:
    """The run of the job's kind."""
    return RUNS[spec.kind](learner, job_id, spec)
