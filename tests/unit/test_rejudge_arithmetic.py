"""`tandem rejudge`'s arithmetic by hand: which stored conversations it re-scores, ranks and
Spearman's rho with ties, the rewards a new verdict gives, agreement, flipped pairs."""

from __future__ import annotations

import pytest

from devtools.provider_replies import coarse, interactivity_scores
from rollout.group_view import TEXT_CHARS, text
from tandem.rejudge import Judged, Picked, Rescored, compare, pick, ranks, rewards_with, spearman, steps_range

CONTEXT = [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": "I want a fruit."}]


def parts(r_llm: float | None, reward: float = 0.0, verdict: str = "") -> dict:
    return {"reward": reward, "token_penalty": 0.0, "r_llm": r_llm, "verdict": verdict}


def response(index: int, reward: float, futures: list[float | None], said: str = "Which fruit?") -> dict:
    return {
        "index": index,
        "messages": [{"role": "assistant", "content": said}],
        "reward": reward,
        "futures": [{"messages": [{"role": "user", "content": "A pear."}], "parts": parts(f)} for f in futures],
    }


def view(version: int, responses: list[dict], judge_weight: float = 0.5) -> dict:
    return {
        "task_id": version,
        "example": 0,
        "dispatched_version": version,
        "weights": {"judge_weight": judge_weight},
        "context": CONTEXT,
        "responses": responses,
        "reward_source": {},
    }


def test_ranks_share_ties_and_spearman_follows_them():
    assert ranks([0.3, 0.1, 0.3, 0.9]) == [2.5, 1.0, 2.5, 4.0]
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # ranks [1, 2, 3] against [1.5, 1.5, 3]: r = 0.866 (sqrt(3)/2)
    assert spearman([1, 2, 3], [0.2, 0.2, 0.9]) == pytest.approx(3**0.5 / 2)
    assert spearman([1, 1, 1], [1, 2, 3]) is None  # a group whose rewards all tie has no order


@pytest.mark.parametrize(
    "text_, bounds",
    [("3:7", (3, 7)), ("5", (5, 5)), (":4", (0, 4)), ("2:", (2, 2**63 - 1))],
)
def test_steps_take_a_range_either_end_open(text_, bounds):
    assert steps_range(text_) == bounds


@pytest.mark.parametrize("bad", ["a:b", "7:3", "-1:2", "1:2:3"])
def test_steps_that_name_no_range_are_refused_saying_so(bad):
    with pytest.raises(ValueError, match="--steps"):
        steps_range(bad)


def test_pick_keeps_the_steps_asked_for_and_every_judged_conversation_as_the_judge_read_it():
    long = text({"role": "user", "content": "x" * (TEXT_CHARS + 50)})
    views = [
        view(1, [response(0, 0.5, [0.8, None]), response(1, -1.0, [])]),  # one future unfinished; one floored
        view(2, [response(0, 0.2, [0.4])]),
        view(3, [response(0, 0.2, [0.4])]),
    ]
    views[1]["responses"][0]["futures"][0]["messages"] = [long]  # cut in the view: not re-scored
    picked = pick(views, (1, 2))
    assert [v["dispatched_version"] for v in picked.views] == [1, 2]
    assert picked.cut == 1 and len(picked.conversations) == 1
    only = picked.conversations[0]
    assert (only.group, only.response, only.future, only.recorded) == (0, 0, 0, 0.8)
    # The context, the response and the future, without the assistant's system prompt.
    assert [m["content"] for m in only.messages] == ["I want a fruit.", "Which fruit?", "A pear."]


def test_an_episode_modes_response_is_its_own_judged_conversation():
    episode = response(0, 0.9, [])
    episode["parts"] = parts(0.6, reward=0.9)
    picked = pick([view(0, [episode])], (0, 10))
    assert [(c.future, c.recorded) for c in picked.conversations] == [(None, 0.6)]
    moved = rewards_with(picked.views[0], [(picked.conversations[0], Rescored(0.2))])
    assert moved == [pytest.approx(0.9 + 0.5 * (0.2 - 0.6))]


def test_new_verdicts_move_rewards_by_the_judge_weight_over_the_futures_and_flip_pairs():
    # Three responses, two futures each, judge weight 0.5. Rewards 0.6 > 0.4 > 0.1 as recorded.
    group = view(0, [response(0, 0.6, [0.9, 0.9]), response(1, 0.4, [0.5, 0.5]), response(2, 0.1, [0.2, 0.0])])
    picked = pick([group], (0, 0))
    # The new judge: response 0's futures 0.1 and 0.1, response 1's 0.5 and 0.5, response 2's 0.2 and 0.0.
    new = {(0, 0): 0.1, (0, 1): 0.1, (1, 0): 0.5, (1, 1): 0.5, (2, 0): 0.2, (2, 1): 0.0}
    rescored = [Rescored(new[(c.response, c.future)]) for c in picked.conversations]
    # Response 0 moves by 0.5 x mean(0.1 - 0.9, 0.1 - 0.9) = -0.4: 0.2, now below response 1 (0.4).
    assert rewards_with(group, list(zip(picked.conversations, rescored))) == pytest.approx([0.2, 0.4, 0.1])
    report = compare(picked, rescored)
    assert report["flipped_pairs"]["count"] == 1 and report["flipped_pairs"]["comparable"] == 3
    assert report["flipped_pairs"]["pairs"][0]["responses"] == [0, 1]
    # Ranks [3, 2, 1] against [2, 3, 1]: rho = 1 - 6 x 2 / (3 x 8) = 0.5.
    assert report["rank_correlation"]["per_group"][0]["spearman"] == pytest.approx(0.5)
    agreement = report["agreement"]
    assert agreement["conversations"] == 6 and agreement["mean_abs_diff"] == pytest.approx(0.8 * 2 / 6)
    assert agreement["within_0_1"] == pytest.approx(4 / 6) and agreement["same_side_of_half"] == pytest.approx(4 / 6)


def test_a_group_with_a_verdict_that_failed_is_left_out_of_the_group_numbers():
    groups = [view(0, [response(0, 0.6, [0.9]), response(1, 0.4, [0.5])]), view(1, [response(0, 0.3, [0.2])])]
    picked = pick(groups, (0, 1))
    rescored = [Rescored(0.9), Rescored(error="judge proxy answered 502: unparseable verdict"), Rescored(0.2)]
    report = compare(picked, rescored)
    assert report["left_out"] == {"cut": 0, "failed": 1, "failed_groups": 1}
    assert [g["task_id"] for g in report["rank_correlation"]["per_group"]] == [1]
    assert report["agreement"]["conversations"] == 2


def test_picked_views_hold_what_compare_reads():
    judged = Judged(group=0, response=0, future=0, messages=[], recorded=0.5, recorded_verdict="")
    assert (
        compare(Picked([view(0, [response(0, 0.5, [0.5])])], [judged], 0), [Rescored(0.5)])["agreement"]["pearson"]
        is None
    )  # one conversation: no correlation to speak of


def test_the_stand_ins_coarse_judge_reads_only_whether_the_assistant_asked():
    # A question and no answer yet: the anchors give understanding 3 and suggestions 0.
    turns = [("user", "I want a fruit."), ("assistant", "Which fruit would you like?")]
    full = interactivity_scores(turns)
    assert full == {"understanding": 3, "clarification": 10, "suggestions": 0}
    assert coarse(full) == {"understanding": 5, "clarification": 10, "suggestions": 5}


@pytest.mark.parametrize("job_id", ["../../etc/passwd", "job-1234567/../x", "a:b-0123abcd", ""])
def test_a_job_id_that_is_not_one_is_refused_before_anything_is_asked(job_id, capsys):
    # The id names the API's path and the default output file: no traversal reaches either.
    from tandem.cli import main

    with pytest.raises(SystemExit, match="is not a job id"):
        main(["rejudge", job_id, "--judge-model", "m", "--api", "http://127.0.0.1:9"])


def test_steps_that_name_no_range_end_the_command_saying_so():
    from tandem.cli import main

    with pytest.raises(SystemExit, match="--steps"):
        main(["rejudge", "job-0123abcd", "--judge-model", "m", "--steps", "9:1", "--api", "http://127.0.0.1:9"])
