"""`tandem rejudge JOB --judge-model M [--rubric R] [--steps A:B]`: the conversations a job's
judge scored, scored again by another judge (or rubric), and how the two agree.

What is re-scored: the training groups the job keeps as text (`GET /v1/jobs/{id}/groups`,
about the newest 200; `rollout.group_view`), each conversation whose R* had an R_llm: a
response's futures (multiturn mode) or the response's whole conversation (episode mode).
Each is sent as the job's judge read it (`rollout.rewards.conversation.judged`: the context,
the response and the future, no system prompt; the task's reference when the job showed it
one) and asked as the job asked (one call a conversation, or with `reward.judge_mode: group`
one call for a response's futures; the proxy's cache as `reward.judge_cache` says), charged
to a key of its own (`rejudge-<8 hex>-<job>`): it passes through the proxy's budgets and
shares, and its cost is read back from the proxy (`GET /v1/spend`). A conversation a view cut (a message over
`rollout.group_view.TEXT_CHARS`) is not re-scored: the new judge would read less than the
old one did.

The comparison (`compare`), what a user picking a judge needs:
- agreement over conversations: mean R_llm under each, the mean absolute difference, the
  share within 0.1, the share on the same side of 0.5, Pearson's r;
- per group, Spearman's rank correlation between the responses' rewards as recorded and as
  they would be with the new verdicts (each future's R* with its R_llm swapped, the
  response's reward the mean over its futures, as the rollout server computes it): GRPO's
  advantages follow that order;
- the pairs of responses in a group whose order flips;
- the cost: the re-judging's bill and its cost a verdict, beside the job's judge's bill.
A group with a conversation that could not be re-scored is left out of the group numbers.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import secrets
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

from rollout.concurrent import gather_all
from rollout.group_view import was_cut
from rollout.rewards.conversation import judged
from services.config import RewardSpec
from services.judge_client import JudgeClient, JudgeError
from tandem.progress import Progress

WITHIN = 0.1
"""Two verdicts on one conversation 'agree' when this close."""


@dataclass(frozen=True)
class Judged:
    """One conversation the job's judge scored, as a stored group view holds it."""

    group: int
    """Its group's place in the views compared."""
    response: int
    future: int | None
    """Which of the response's futures; None: the response's own conversation (episode mode)."""
    messages: list[dict]
    recorded: float
    """The job's judge's R_llm."""
    recorded_verdict: str


@dataclass
class Rescored:
    """What the new judge said of one conversation, or why it said nothing."""

    score: float | None = None
    verdict: str = ""
    error: str = ""


@dataclass(frozen=True)
class Picked:
    """The views in the steps asked for and what they hold to re-score."""

    views: list[dict]
    conversations: list[Judged]
    cut: int
    """Judged conversations left out because a view cut their text."""


def steps_range(text: str) -> tuple[int, int]:
    """`A:B` (either end may be left out) as inclusive bounds on the weight version a group
    was dispatched at (the step after which its policy was published)."""
    start, sep, end = text.partition(":")
    try:
        bounds = (int(start) if start else 0, int(end) if end else sys.maxsize) if sep else (int(text), int(text))
    except ValueError:
        raise ValueError(f"--steps takes A:B (either may be left out), not {text!r}") from None
    if bounds[0] < 0 or bounds[1] < bounds[0]:
        raise ValueError(f"--steps {text!r} is empty or negative")
    return bounds


def pick(views: list[dict], steps: tuple[int, int]) -> Picked:
    """The views dispatched within `steps` and every conversation in them the judge scored."""
    kept = [v for v in views if steps[0] <= v["dispatched_version"] <= steps[1]]
    found: list[Judged] = []
    cut = 0
    for g, view in enumerate(kept):
        for response in view["responses"]:
            said = response["messages"]
            scored: list[tuple[int | None, list[dict], dict | None]] = [(None, said, response.get("parts"))]
            scored += [(f, said + future["messages"], future["parts"]) for f, future in enumerate(response["futures"])]
            for future, after, parts in scored:
                if not parts or parts.get("r_llm") is None:
                    continue
                messages = judged(view["context"] + after)
                if any(was_cut(m["content"]) for m in messages):
                    cut += 1
                    continue
                found.append(Judged(g, response["index"], future, messages, parts["r_llm"], parts.get("verdict", "")))
    return Picked(kept, found, cut)


@dataclass(frozen=True)
class Asked:
    """How the verdicts are asked for."""

    key: str
    """The job key the calls are charged to (`rejudge-<8 hex>-<job>`)."""
    rubric: str
    model: str
    group: bool
    """One call for each response's futures (`reward.judge_mode: group`), else one a conversation."""
    cache: bool
    """Let the proxy answer a conversation it judged under `key` before (`reward.judge_cache`)."""


class CallOptions(TypedDict):
    """What each re-judging call passes to `JudgeClient.judge` and `judge_group`."""

    job: str
    model: str
    cache: bool
    idempotency_key: str


async def rescore(client: JudgeClient, picked: Picked, asked: Asked, references: list[str | None]) -> list[Rescored]:
    """Each conversation's verdict, asked as `asked` says, at most `client`'s connections at
    once. A call that fails keeps its reason for each of its conversations."""
    conversations = picked.conversations
    calls: dict[tuple, list[int]] = {}
    for index, c in enumerate(conversations):
        calls.setdefault((c.group, c.response) if asked.group else (index,), []).append(index)
    rescored = [Rescored() for _ in conversations]
    progress = Progress(len(conversations), "rejudging", "verdicts")

    async def ask(number: int, indices: list[int]) -> None:
        messages, reference = [conversations[i].messages for i in indices], references[indices[0]]
        options = CallOptions(
            job=asked.key, model=asked.model, cache=asked.cache, idempotency_key=f"{asked.key}/{number}"
        )
        try:
            if len(indices) == 1:
                results = [await client.judge(asked.rubric, messages[0], reference, **options)]
            else:
                results = (await client.judge_group(asked.rubric, messages, reference, **options)).results
            for i, result in zip(indices, results):
                rescored[i] = Rescored(result.score, result.verdict)
        except JudgeError as err:
            for i in indices:
                rescored[i] = Rescored(error=str(err))
        progress.advance(len(indices))

    with progress:
        await gather_all(*(ask(n, indices) for n, indices in enumerate(calls.values())))
    return rescored


def compare(picked: Picked, rescored: list[Rescored]) -> dict:
    """Agreement over conversations, and rank correlation and flipped pairs per group (what
    the new R_llm, at each group's judge weight, does to its responses' rewards)."""
    scored = [(c, r, r.score) for c, r in zip(picked.conversations, rescored) if r.score is not None]
    failed_groups = {c.group for c, r in zip(picked.conversations, rescored) if r.score is None}
    in_group: dict[int, list[tuple[Judged, Rescored]]] = {}
    for c, r, _ in scored:
        in_group.setdefault(c.group, []).append((c, r))
    groups, flips, comparable = [], [], 0
    for g, view in enumerate(picked.views):
        if g in failed_groups:
            continue
        before = [r["reward"] for r in view["responses"]]
        after = rewards_with(view, in_group.get(g, []))
        where = {"task_id": view["task_id"], "version": view["dispatched_version"]}
        groups.append(where | {"spearman": spearman(before, after)})
        for i, j in itertools.combinations(range(len(before)), 2):
            comparable += before[i] != before[j]
            if (before[i] - before[j]) * (after[i] - after[j]) < 0:
                flips.append(
                    where | {"responses": [i, j], "recorded": [before[i], before[j]], "rejudged": [after[i], after[j]]}
                )
    defined = [g["spearman"] for g in groups if g["spearman"] is not None]
    return {
        "agreement": agreement([c.recorded for c, _, _ in scored], [score for _, _, score in scored]),
        "rank_correlation": {
            "groups": len(groups),
            "defined": len(defined),
            "mean": mean(defined),
            "min": min(defined, default=None),
            "per_group": groups,
        },
        "flipped_pairs": {
            "count": len(flips),
            "comparable": comparable,
            "share": len(flips) / comparable if comparable else 0.0,
            "pairs": flips,
        },
        "left_out": {
            "cut": picked.cut,
            "failed": len(picked.conversations) - len(scored),
            "failed_groups": len(failed_groups),
        },
    }


def agreement(old: list[float], new: list[float]) -> dict:
    """How two judges' scores of the same conversations agree."""
    diffs = [abs(a - b) for a, b in zip(old, new)]
    return {
        "conversations": len(old),
        "mean_recorded": mean(old),
        "mean_rejudged": mean(new),
        "mean_abs_diff": mean(diffs),
        "within_0_1": mean([d <= WITHIN + 1e-12 for d in diffs]),
        "same_side_of_half": mean([(a >= 0.5) == (b >= 0.5) for a, b in zip(old, new)]),
        "pearson": pearson(old, new),
    }


def rewards_with(view: dict, rescored: list[tuple[Judged, Rescored]]) -> list[float]:
    """The view's responses' rewards with the new verdicts: each scored conversation's R*
    moves by the view's judge weight x (new - old R_llm), one not re-scored not at all; a
    multiturn response's reward is the mean over its futures, so it moves by the mean of theirs."""
    judge_weight = view["weights"]["judge_weight"]
    moved = [r["reward"] for r in view["responses"]]
    for conversation, verdict in rescored:
        if verdict.score is None:
            continue
        response = view["responses"][conversation.response]
        share = 1 / len(response["futures"]) if conversation.future is not None else 1.0
        moved[conversation.response] += judge_weight * (verdict.score - conversation.recorded) * share
    return moved


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def pearson(a: list[float], b: list[float]) -> float | None:
    """Pearson's r; None when either side does not vary."""
    if len(a) < 2:
        return None
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    sa = math.sqrt(sum((x - ma) ** 2 for x in a))
    sb = math.sqrt(sum((y - mb) ** 2 for y in b))
    if sa == 0 or sb == 0:
        return None
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (sa * sb)


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            out[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return out


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson's r of the ranks); None when either side is all ties."""
    return pearson(ranks(a), ranks(b))


def main(args) -> None:
    """The command: read the job and its groups from the API, re-score, compare, print and
    write the JSON."""
    from services.config import parse_job_spec
    from services.jobs import JOB_ID
    from tandem.client import ApiClient, ApiError

    if not JOB_ID.fullmatch(args.job_id):
        sys.exit(f"tandem rejudge: {args.job_id!r} is not a job id (NAME-8 hex digits, as `tandem submit` prints)")
    try:
        steps = steps_range(args.steps) if args.steps else (0, sys.maxsize)
        api = ApiClient(args.api, args.token)
        record, views = api.get(args.job_id), api.groups(args.job_id)
    except (ValueError, ApiError) as err:
        sys.exit(f"tandem rejudge: {err}")
    spec = parse_job_spec(record["spec"])
    reward = spec.reward
    rubric = args.rubric or reward.judge_rubric
    if not rubric:
        sys.exit(f"tandem rejudge: job {args.job_id} has no judge rubric (reward.judge_rubric): give --rubric")
    picked = pick(views, steps)
    if not picked.conversations:
        sys.exit(
            f"tandem rejudge: no conversation the judge scored in the {len(picked.views)} groups job "
            f"{args.job_id} keeps within --steps ({picked.cut} were cut)"
        )
    references: list[str | None] = (
        references_for(spec, picked) if reward.judge_reference else [None] * len(picked.conversations)
    )
    key = f"rejudge-{secrets.token_hex(4)}-{args.job_id}"
    rescored, bill = asyncio.run(run(args, picked, key, rubric, references, reward))
    report = {
        "job": args.job_id,
        "steps": [steps[0], None if steps[1] == sys.maxsize else steps[1]],
        "recorded": {"judge_model": reward.judge_model, "rubric": reward.judge_rubric,
                     "reward_source": next((v["reward_source"] for v in picked.views if v["reward_source"]), {})},
        "rejudged": {"judge_model": args.judge_model, "rubric": rubric, "key": key, "judge_mode": reward.judge_mode},
        "groups": len(picked.views),
        **compare(picked, rescored),
        "cost": cost(bill, len([r for r in rescored if r.score is not None]), record.get("spend", {})),
        "conversations": [
            asdict(c) | {"messages": len(c.messages)} | {f"rejudged_{k}": v for k, v in asdict(r).items()}
            for c, r in zip(picked.conversations, rescored)
        ],
    }  # fmt: skip
    out = Path(args.out or f"rejudge-{args.job_id}-{re.sub(r'[^A-Za-z0-9_.-]', '_', args.judge_model)}.json")
    out.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"wrote {out}")


def references_for(spec, picked: Picked) -> list[str | None]:
    """The task's reference for each conversation, as the job's judge was shown it
    (`reward.judge_reference`)."""
    from rollout.tasks import load_task

    task_set = load_task(spec.task, spec.train.seed)
    return [task_set.reference(picked.views[c.group]["example"]) for c in picked.conversations]


async def run(
    args, picked: Picked, key: str, rubric: str, references: list[str | None], reward: RewardSpec
) -> tuple[list[Rescored], dict]:
    """The verdicts (`rescore`, asked as the job asked: `reward.judge_mode` and
    `judge_cache`), and the re-judging's bill at the proxy."""
    client = JudgeClient(args.judge_url, token=args.judge_token, max_connections=args.concurrency)
    try:
        asked = Asked(key, rubric, args.judge_model, reward.judge_mode == "group", reward.judge_cache)
        rescored = await rescore(client, picked, asked, references)
        return rescored, await client.bill(key)
    finally:
        await client.aclose()


def cost(bill: dict, verdicts: int, recorded: dict) -> dict:
    """The re-judging's bill and its cost a verdict, and the job's judge's whole bill (every
    verdict of the job, the groups it no longer keeps included)."""
    judge = recorded.get("by_role", {}).get("judge", {})
    return {
        "usd": bill["usd"],
        "tokens": bill["tokens"],
        "calls": bill["calls"],
        "usd_per_verdict": bill["usd"] / verdicts if verdicts else None,
        "recorded_judge_usd": judge.get("usd", 0.0),
        "recorded_judge_calls": judge.get("calls", 0),
    }


def table(report: dict) -> str:
    """The comparison as people read it."""
    a, r, f, c = report["agreement"], report["rank_correlation"], report["flipped_pairs"], report["cost"]
    old, new = report["recorded"], report["rejudged"]
    return "\n".join([
        f"{a['conversations']} conversations of {report['groups']} groups re-scored "
        f"({report['left_out']['cut']} cut and {report['left_out']['failed']} failed left out)",
        f"{'':24}{'recorded':>20}{'rejudged':>20}",
        f"{'judge model':24}{str(old['judge_model'] or 'judge'):>20}{new['judge_model']:>20}",
        f"{'rubric':24}{str(old['rubric']):>20}{new['rubric']:>20}",
        f"{'mean R_llm':24}{fmt(a['mean_recorded']):>20}{fmt(a['mean_rejudged']):>20}",
        f"agreement: within {WITHIN} {pct(a['within_0_1'])}, same side of 0.5 {pct(a['same_side_of_half'])}, "
        f"mean |diff| {fmt(a['mean_abs_diff'])}, Pearson {fmt(a['pearson'])}",
        f"rank correlation of rewards per group (Spearman; GRPO's order): mean {fmt(r['mean'])}, "
        f"min {fmt(r['min'])} over {r['defined']} groups",
        f"flipped pairs: {f['count']} of {f['comparable']} ({pct(f['share'])})",
        f"cost: ${c['usd']:.6f} for {a['conversations']} verdicts in {c['calls']} calls "
        f"(${fmt(c['usd_per_verdict'], 6)} a verdict); the job's judge: ${c['recorded_judge_usd']:.6f} "
        f"in {c['recorded_judge_calls']} calls over the whole job",
    ])  # fmt: skip


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
