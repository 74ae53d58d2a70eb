"""R_llm through the judge proxy, for one job: one call per conversation, or one per group
of conversations (`reward.judge_mode`), answered from the job's cache where the proxy can
(`reward.judge_cache`)."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.concurrent import gather_all
from rollout.tasks.base import Verdict
from services.config import RewardSpec
from services.judge_client import JudgeClient


@dataclass
class ProxyJudge:
    client: JudgeClient
    job_id: str
    spec: RewardSpec

    async def __call__(self, rubric: str, messages: list[dict], reference: str | None) -> float:
        """One conversation's score (the judge a task's metric asks)."""
        result = await self.client.judge(
            rubric, messages, reference, job=self.job_id, model=self.spec.judge_model, cache=self.spec.judge_cache
        )
        return result.score

    async def complete(self, messages: list[dict], max_tokens: int, response_format: dict | None) -> str:
        """A chat completion by the job's judge model at temperature 0 (an extraction,
        `rollout.tasks.extraction`), charged as a judge call."""
        result = await self.client.chat(
            messages,
            model=self.spec.judge_model or "judge",
            max_tokens=max_tokens,
            temperature=0.0,
            job=self.job_id,
            priority="judge",
            response_format=response_format,
            role="extraction",
        )
        return result.content

    async def structured(self) -> bool:
        """Whether the judge model's upstreams keep to a JSON schema."""
        return await self.client.structured_output(self.spec.judge_model or "judge")

    async def score_all(
        self, rubric: str, conversations: list[list[dict]], reference: str | None, call_id: str = ""
    ) -> list[Verdict]:
        """Each conversation's verdict; `call_id` keys the calls (`/c<i>` per conversation)."""
        job, model, cache = self.job_id, self.spec.judge_model, self.spec.judge_cache
        if self.spec.judge_mode == "group" and len(conversations) > 1:
            group = await self.client.judge_group(
                rubric, conversations, reference, job=job, model=model, cache=cache, idempotency_key=call_id
            )
            return [Verdict(r.score, r.verdict) for r in group.results]
        results = await gather_all(
            *(
                self.client.judge(
                    rubric,
                    c,
                    reference,
                    job=job,
                    model=model,
                    cache=cache,
                    idempotency_key=call_id and f"{call_id}/c{i}",
                )
                for i, c in enumerate(conversations)
            )
        )
        return [Verdict(r.score, r.verdict) for r in results]
