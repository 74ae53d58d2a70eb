"""The judge: a rubric's verdict on a conversation (`single`), or on several at once
(`group`), read from what a judge model answers. It asks its questions through a
`JudgeLLM` (the gateway) and remembers verdicts in the proxy's memory: a job's repeated
verdict comes from the cache, a retried request gets its stored reply."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from judge_proxy import metrics
from judge_proxy.errors import ProxyError
from judge_proxy.memory import Memory, Slot, digest
from judge_proxy.rubrics import (
    GroupParseError,
    Rubric,
    group_schema,
    parse_group_verdicts,
    parse_verdict,
    prompt_sha256,
    render,
    render_group,
    response_format,
    verdict_schema,
)
from services.judge_api import GroupJudgeResult, JudgeResult, reply_model
from services.quoting import quote_tag

log = logging.getLogger(__name__)


class JudgeLLM(Protocol):
    """All the judge needs of the gateway."""

    def structured(self, model: str) -> bool:
        """Whether `model` keeps to a JSON schema in `response_format` (404 ProxyError for a
        model the proxy does not serve)."""
        ...

    async def ask(self, body: dict, max_tokens: int, *, job: str, tag: str = "") -> dict:
        """The reply (JSON) to one chat request at the judge's priority, its budget settled."""
        ...


class Judge:
    def __init__(self, llm: JudgeLLM, memory: Memory) -> None:
        self.llm = llm
        self.memory = memory

    async def single(
        self,
        rubric: Rubric,
        messages: list[dict],
        reference: str | None,
        model: str,
        job: str,
        *,
        cache: bool = True,
        idempotency_key: str | None = None,
    ) -> JudgeResult:
        """A verdict: the job's earlier one on the same conversation (`cache`), the one
        stored under `idempotency_key`, or a new one."""
        parts = (model, rubric.name, messages, reference)
        key = self.memory.key("cache", job, *parts) if cache else None
        key = key or self.memory.replay(job, idempotency_key, *parts)
        raw, remembered = await self.memory.once(
            key, job, lambda: self.verdict(rubric, messages, reference, model, job, idempotency_key or "")
        )
        return JudgeResult.model_validate_json(raw).model_copy(update={"remembered": remembered})

    async def verdict(
        self, rubric: Rubric, messages: list[dict], reference: str | None, model: str, job: str, tag: str = ""
    ) -> bytes:
        """Ask for a verdict; ask once more, strictly, when the first cannot be read."""
        raws: list[str] = []
        usage: dict[str, int] = {}
        structured = self.llm.structured(model)
        for strict in (False, True):
            prompt = render(
                rubric,
                messages,
                reference,
                strict=strict,
                previous_reply=raws[-1] if raws else "",
                structured=structured,
            )
            body = {"model": model, "messages": prompt, "temperature": 0.0}
            if structured:
                body["response_format"] = response_format(rubric, verdict_schema(rubric))
            data = await self.llm.ask(body, rubric.max_tokens, job=job, tag=tag and tag + "/strict" * strict)
            raws.append(content_of(data))
            add_usage(usage, data.get("usage"))
            verdict = parse_verdict(rubric, raws[-1], quote_tag([messages]))
            if verdict is not None:
                metrics.VERDICTS.labels(rubric.name, "parsed_on_retry" if strict else "parsed").inc()
                return (
                    JudgeResult(
                        score=verdict.score,
                        criteria=verdict.criteria,
                        verdict=verdict.verdict,
                        raw=raws[-1],
                        usage=usage,
                        model=reply_model(data),
                        rubric_sha256=prompt_sha256(rubric, structured=structured),
                    )
                    .model_dump_json()
                    .encode()
                )
        metrics.VERDICTS.labels(rubric.name, "unparseable").inc()
        raise ProxyError(502, "unparseable verdict", "unparseable_verdict", extra={"raw": raws, "usage": usage})

    async def group(
        self,
        rubric: Rubric,
        candidates: list[list[dict]],
        reference: str | None,
        model: str,
        job: str,
        *,
        cache: bool = True,
        idempotency_key: str | None = None,
    ) -> GroupJudgeResult:
        """One verdict per candidate, from as few judge calls as possible: candidates the
        job's cache knows cost nothing, identical ones are judged once, the rest together
        in one call (`GroupVerdicts`)."""
        key = self.memory.replay(job, idempotency_key, model, rubric.name, candidates, reference)
        verdicts = GroupVerdicts(self, rubric, candidates, reference, model, job, cache, idempotency_key or "")
        raw, remembered = await self.memory.once(key, job, verdicts.reply)
        return GroupJudgeResult.model_validate_json(raw).model_copy(update={"remembered": remembered})


@dataclass
class GroupVerdicts:
    """One group verdict request being answered."""

    judge: Judge
    rubric: Rubric
    candidates: list[list[dict]]
    reference: str | None
    model: str
    job: str
    cache: bool
    tag: str = ""
    """The request's idempotency key, sent upstream to name its calls."""

    async def reply(self) -> bytes:
        """Cached candidates first; the distinct rest in one group call, or one by one when
        its reply is unusable (counted by reason)."""
        slots = [self.cache_slot(c) for c in self.candidates]
        stored = await self.judge.memory.lookup([s for s in slots if s])
        results: list[JudgeResult | None] = [None] * len(self.candidates)
        for index, raw in zip((i for i, s in enumerate(slots) if s), stored):
            if raw is not None:
                results[index] = JudgeResult.model_validate_json(raw).model_copy(update={"remembered": True})
        todo: dict[str, list[int]] = {}
        for index, candidate in enumerate(self.candidates):
            if results[index] is None:
                todo.setdefault(digest(candidate), []).append(index)
        self.count("cached", sum(r is not None for r in results))
        self.count("duplicate", sum(len(same) - 1 for same in todo.values()))
        usage: dict[str, int] = {}
        fallback = None
        if todo:
            firsts = [same[0] for same in todo.values()]
            verdicts, fallback = await self.judge_distinct(
                [self.candidates[i] for i in firsts], [slots[i] for i in firsts], usage
            )
            for same, verdict in zip(todo.values(), verdicts):
                for index in same:
                    results[index] = verdict
        return GroupJudgeResult(results=results, usage=usage, fallback=fallback).model_dump_json().encode()

    async def judge_distinct(
        self, distinct: list[list[dict]], slots: list[Slot | None], usage: dict[str, int]
    ) -> tuple[list[JudgeResult], str | None]:
        """Verdicts on distinct candidates (`slots`: where each is cached, if it is)."""
        if len(distinct) > 1:
            try:
                verdicts = await self.group_call(distinct, slots, usage)
                self.count("group", len(distinct))
                return verdicts, None
            except GroupParseError as err:
                reason = err.reason
                metrics.GROUP_FALLBACKS.labels(self.rubric.name, reason).inc()
                log.warning("group verdict unusable (%s); judging %d candidates one by one", err, len(distinct))
        else:
            reason = None
        singles = await asyncio.gather(
            *(
                self.judge.single(
                    self.rubric,
                    c,
                    self.reference,
                    self.model,
                    self.job,
                    cache=self.cache,
                    idempotency_key=self.tag and f"{self.tag}/c{index}",
                )
                for index, c in enumerate(distinct)
            )
        )
        for single in singles:
            add_usage(usage, single.usage if not single.remembered else {})
        self.count("fallback" if reason else "alone", len(distinct))
        return list(singles), reason

    async def group_call(
        self, distinct: list[list[dict]], slots: list[Slot | None], usage: dict[str, int]
    ) -> list[JudgeResult]:
        structured = self.judge.llm.structured(self.model)
        prompt = render_group(self.rubric, distinct, self.reference, structured=structured)
        body = {"model": self.model, "messages": prompt, "temperature": 0.0}
        if structured:
            body["response_format"] = response_format(self.rubric, group_schema(self.rubric, len(distinct)))
        data = await self.judge.llm.ask(body, self.rubric.group_max_tokens(len(distinct)), job=self.job, tag=self.tag)
        add_usage(usage, data.get("usage"))
        text = content_of(data)
        provenance = {
            "model": reply_model(data),
            "rubric_sha256": prompt_sha256(self.rubric, group=True, structured=structured),
        }
        verdicts = [
            JudgeResult(score=v.score, criteria=v.criteria, verdict=v.verdict, raw=text, usage={}, **provenance)
            for v in parse_group_verdicts(self.rubric, text, len(distinct), quote_tag(distinct))
        ]
        await self.judge.memory.store({slot: v.model_dump_json().encode() for slot, v in zip(slots, verdicts) if slot})
        return verdicts

    def cache_slot(self, candidate: list[dict]) -> Slot | None:
        """The same entry a single verdict on this conversation is cached under."""
        if not self.cache:
            return None
        return self.judge.memory.key("cache", self.job, self.model, self.rubric.name, candidate, self.reference)

    def count(self, outcome: str, number: int) -> None:
        if number:
            metrics.GROUP_CANDIDATES.labels(self.rubric.name, outcome).inc(number)


def content_of(data: dict) -> str:
    try:
        return data["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise ProxyError(502, "upstream reply has no choices[0].message.content", "bad_upstream_reply") from None


def add_usage(total: dict[str, int], usage: object) -> None:
    """Add a reply's integer usage counts into `total`."""
    for key, value in (usage or {}).items() if isinstance(usage, dict) else ():
        if isinstance(value, int) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value
