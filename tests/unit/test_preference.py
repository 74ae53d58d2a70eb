"""Preference pairs: picked from a scored group, and read from a pairs file with errors
that name the line."""

from __future__ import annotations

import json

import pytest

from learner import pairs
from services import preference
from services.protocol import Sample


def sample(reward: float, index: int, tokens: list[int] | None = None) -> Sample:
    tokens = tokens or [1, 2, 3, 10 + index]
    return Sample(
        sample_id=f"j:0:{index}",
        tokens=tokens,
        mask=[0, 0, 0, 1],
        logprobs=[0.0] * 4,
        versions=[-1, -1, -1, 0],
        reward=reward,
        advantage=0.0,
        num_turns=1,
    )


def test_pick_pair_takes_the_best_and_the_worst():
    group = [sample(0.2, 0), sample(0.9, 1), sample(-0.1, 2), sample(0.5, 3)]
    chosen, rejected = pairs.pick_pair(group, margin=0.0)
    assert (chosen.sample_id, rejected.sample_id) == ("j:0:1", "j:0:2")


def test_pick_pair_needs_a_gap_of_at_least_the_margin():
    group = [sample(0.5, 0), sample(0.8, 1)]
    assert pairs.pick_pair(group, margin=0.3) is not None
    assert pairs.pick_pair(group, margin=0.31) is None
    assert pairs.pick_pair([sample(0.5, 0), sample(0.5, 1)], margin=0.0) is None  # no preference
    assert pairs.pick_pair([sample(0.5, 0)], margin=0.0) is None


def test_pairs_from_groups_flattens_chosen_then_rejected():
    groups = [
        type("G", (), {"samples": [sample(1.0, 0), sample(0.0, 1)]})(),
        type("G", (), {"samples": [sample(0.3, 2), sample(0.3, 3)]})(),  # tie: no pair
        type("G", (), {"samples": [sample(0.0, 4), sample(2.0, 5)]})(),
    ]
    flat, too_long = pairs.pairs_from_groups(groups, margin=0.0, max_pair_tokens=8)
    assert [s.sample_id for s in flat] == ["j:0:0", "j:0:1", "j:0:5", "j:0:4"] and too_long == 0
    flat, too_long = pairs.pairs_from_groups(groups, margin=0.0, max_pair_tokens=7)
    assert flat == [] and too_long == 2  # a rank takes both sides of a pair


def write_rows(path, rows) -> None:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))


def good_row(**changes) -> dict:
    return {
        "context_ids": [5, 6, 7],
        "chosen_ids": [8, 9],
        "rejected_ids": [10],
        "chosen_score": 1.0,
        "rejected_score": 0.25,
        "turn": 0,
    } | changes


def test_a_row_round_trips_into_masked_samples(tmp_path):
    chosen, rejected = sample(1.0, 0, [5, 6, 7, 8, 9]), sample(0.25, 1, [5, 6, 7, 10])
    row = preference.pair_row([5, 6, 7], chosen, rejected, turn=0)
    assert row == good_row()
    write_rows(tmp_path / "pairs.jsonl", [row, "", row])
    loaded = preference.load_pairs(tmp_path / "pairs.jsonl", vocab_size=64)
    assert len(loaded) == 4
    first_chosen, first_rejected = loaded[:2]
    assert first_chosen.tokens == [5, 6, 7, 8, 9] and first_chosen.mask == [0, 0, 0, 1, 1]
    assert first_rejected.tokens == [5, 6, 7, 10] and first_rejected.mask == [0, 0, 0, 1]
    assert (first_chosen.reward, first_rejected.reward) == (1.0, 0.25)
    assert len({s.sample_id for s in loaded}) == 4  # the reference's memory is keyed by them


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (good_row(chosen_ids=None) | {}, "chosen_ids is not a list of integers"),
        ({k: v for k, v in good_row().items() if k != "rejected_score"}, "missing rejected_score"),
        (good_row(rejected_ids=[]), "rejected_ids is empty"),
        (good_row(context_ids=[1, 2.5]), "context_ids is not a list of integers"),
        (good_row(chosen_ids=[99]), "outside the tokenizer's vocabulary"),
        (good_row(chosen_score="high"), "chosen_score is not a finite number"),
        (good_row(chosen_score=0.0), "chosen_score is below rejected_score"),
        (good_row(context_ids=list(range(31))), "over train.max_tokens_per_rank=64"),
    ],
)
def test_a_malformed_row_is_an_error_naming_the_line(tmp_path, bad, reason):
    path = tmp_path / "pairs.jsonl"
    write_rows(path, [good_row(), bad])
    with pytest.raises(ValueError) as err:
        preference.load_pairs(path, vocab_size=64, max_pair_tokens=64)
    assert f"{path}, line 2: " in str(err.value) and reason in str(err.value)


def test_an_empty_file_is_an_error(tmp_path):
    (tmp_path / "pairs.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no preference pairs"):
        preference.load_pairs(tmp_path / "pairs.jsonl")


def test_offline_batches_cover_every_pair_once_per_pass_and_depend_on_the_step_alone():
    from learner.runs.offline import step_pairs

    passes = [step_pairs(10, 5, step, seed=3) + step_pairs(10, 5, step + 1, seed=3) for step in (0, 2, 4)]
    assert all(sorted(p) == list(range(10)) for p in passes)  # each pass: every pair once
    assert passes[0] != passes[1]  # reshuffled every pass
    assert step_pairs(10, 4, 2, seed=3) == step_pairs(10, 4, 2, seed=3)  # a resumed run trains the same batch
    assert step_pairs(10, 4, 2, seed=3)[:2] == passes[0][8:]  # a batch across a pass boundary
