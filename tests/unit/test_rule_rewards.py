"""Each rule reward against values worked out by hand."""

from __future__ import annotations

import pytest

from rollout.rewards import rules


def scalar_levenshtein(a: str, b: str) -> int:
    """The textbook DP, one cell at a time, to check the vectorised rows against."""
    row = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        previous, row[0] = row[0], i
        for j, char_b in enumerate(b, start=1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (char_a != char_b))
    return row[-1]


@pytest.mark.parametrize(("a", "b", "distance"), [
    ("kitten", "sitting", 3),  # k->s, e->i, +g
    ("flaw", "lawn", 2),  # -f, +n
    ("abc", "abc", 0),
    ("", "abc", 3),
    ("abc", "", 3),
    ("", "", 0),
    ("ab", "ba", 2),  # no transpositions in Levenshtein
    ("héllo", "hello", 1),
])
def test_levenshtein_distance_counts_single_character_edits(a, b, distance):
    assert rules.levenshtein_distance(a, b) == distance


@pytest.mark.parametrize(("a", "b"), [
    ("intention", "execution"), ("sunday", "saturday"), ("aaaa\n\nbbbb", "bbbb\n\naaaa"),
    ("the quick brown fox", "a quick brown dog jumps"), ("xyxyxyxy", "yxyxyx"),
])
def test_levenshtein_distance_matches_the_cell_by_cell_dp(a, b):
    assert rules.levenshtein_distance(a, b) == scalar_levenshtein(a, b)


@pytest.mark.parametrize(("pred", "ref", "reward"), [
    ("kitten", "sitting", 1 - 3 / 7),
    ("flaw", "lawn", 0.5),
    ("same", "same", 1.0),
    ("", "", 1.0),
    ("abc", "", 0.0),
    ("abc", "xyz", 0.0),
])
def test_normalized_levenshtein_reward_is_one_minus_distance_over_the_longer_length(pred, ref, reward):
    assert rules.normalized_levenshtein_reward(pred, ref) == pytest.approx(reward)


def test_paragraphs_are_split_on_blank_lines_even_with_spaces_and_stripped():
    assert rules.paragraphs("  a\nstill a \n\n b\n   \n\nc\n\n") == ["a\nstill a", "b", "c"]


@pytest.mark.parametrize(("pred", "ref", "reward"), [
    ("a\n\nb", "a\n\nb\n\nc", 1 - 1 / 3),  # one missing of three
    ("a\n\nb\n\nc\n\nd", "a\n\nb", 1 - 2 / 4),  # two extra of four
    ("x\n\ny", "a\n\nb", 1.0),  # counts only, not content
    ("", "a", 0.0),
    ("", "  \n\n ", 1.0),  # neither has a paragraph
])
def test_paragraph_count_reward_penalises_missing_and_extra_paragraphs_alike(pred, ref, reward):
    assert rules.paragraph_count_reward(pred, ref) == pytest.approx(reward)


FOUR = "alpha one\n\nbeta two\n\ngamma three\n\ndelta four"


@pytest.mark.parametrize(("pred", "reward"), [
    (FOUR, 1.0),
    ("beta two\n\nalpha one\n\ngamma three\n\ndelta four", 1 - 1 / 6),  # positions [1,0,2,3]: 1 of 6 pairs
    ("delta four\n\ngamma three\n\nbeta two\n\nalpha one", 0.0),  # reversed: 6 of 6
])
def test_paragraph_order_reward_is_one_minus_the_share_of_inverted_pairs(pred, reward):
    assert rules.paragraph_order_reward(pred, FOUR) == pytest.approx(reward)


def test_paragraph_order_matches_each_reference_paragraph_to_its_most_similar_prediction():
    ref = "First paragraph here.\n\nSecond one follows.\n\nThird closes it."
    pred = "Third closes it!\n\nFirst paragraph here\n\nSecond one follows."

    assert rules.matched_positions(pred, ref) == [1, 2, 0]
    assert rules.paragraph_order_reward(pred, ref) == pytest.approx(1 - 2 / 3)  # (1,0) and (2,0) inverted


def test_several_reference_paragraphs_sharing_one_match_are_not_inversions():
    # "bbbb" is equally far from every prediction and goes to the earliest: positions [0, 0, 1, 2].
    assert rules.matched_positions("aaaa\n\ncccc\n\ndddd", "aaaa\n\nbbbb\n\ncccc\n\ndddd") == [0, 0, 1, 2]
    assert rules.paragraph_order_reward("aaaa\n\ncccc\n\ndddd", "aaaa\n\nbbbb\n\ncccc\n\ndddd") == 1.0


def test_paragraph_order_reward_edge_cases():
    assert rules.paragraph_order_reward("anything", "one paragraph") == 1.0  # no pair to invert
    assert rules.paragraph_order_reward("", "") == 1.0
    assert rules.paragraph_order_reward("", "a\n\nb") == 0.0  # nothing to match


def test_count_inversions_counts_strictly_decreasing_pairs():
    assert rules.count_inversions([3, 1, 2]) == 2
    assert rules.count_inversions([0, 0, 1]) == 0
    assert rules.count_inversions([]) == 0


def test_document_parsing_reward_sums_distance_count_and_order():
    assert rules.document_parsing_reward(FOUR, FOUR) == 3.0
    # 10 characters, 8 substitutions: 0.2; two paragraphs each: 1; one pair, inverted: 0.
    assert rules.document_parsing_reward("bbbb\n\naaaa", "aaaa\n\nbbbb") == pytest.approx(0.2 + 1.0 + 0.0)


def test_jaccard_similarity_is_over_lower_cased_word_sets():
    assert rules.jaccard_similarity("cheap flights to Paris", "inexpensive airfare to paris") == pytest.approx(2 / 6)
    assert rules.jaccard_similarity("a a b", "b") == pytest.approx(1 / 2)
    assert rules.jaccard_similarity("", "...") == 1.0
    assert rules.jaccard_similarity("a", "") == 0.0


def test_cosine_similarity_by_hand():
    assert rules.cosine_similarity([1, 0], [1, 1]) == pytest.approx(2 ** -0.5)
    assert rules.cosine_similarity([1, 2], [-1, -2]) == pytest.approx(-1.0)
    assert rules.cosine_similarity([0, 0], [1, 1]) == 0.0


CONCEPTS = {"cheap": 0, "inexpensive": 0, "flights": 1, "flight": 1, "airfare": 1, "to": 2, "paris": 3}


def concept_embedding(text: str) -> list[float]:
    """A synonym-aware bag of concepts: a stand-in sentence encoder with known outputs."""
    vector = [0.0] * 4
    for word in text.lower().split():
        vector[CONCEPTS[word]] += 1.0
    return vector


@pytest.mark.parametrize(("rewrite", "reward"), [
    ("inexpensive airfare to paris", 1.0 - 2 / 6),  # same meaning, half the words changed
    ("cheap flights to paris", 0.0),  # a copy earns nothing
    ("cheap flight", 2 / (2 ** 0.5 * 2) - 1 / 5),  # [1,1,0,0] vs [1,1,1,1]; {cheap} of 5 words
])
def test_query_rewrite_reward_is_embedding_cosine_minus_word_jaccard(rewrite, reward):
    assert rules.query_rewrite_reward("cheap flights to paris", rewrite, concept_embedding) == pytest.approx(reward)


@pytest.mark.parametrize(("text", "reward"), [
    ('{"query": "cheap flights"}', 0.2),
    ('  {"a": [1, 2]}\n', 0.2),
    ("{}", 0.2),
    ("[1, 2]", 0.0),  # an array is not an object
    ('"{}"', 0.0),  # a string is not an object
    ('{"a": 1', 0.0),  # partial
    ('Here you go: {"a": 1}', 0.0),  # the whole text must be the object
    ("", 0.0),
])
def test_json_format_reward_gives_point_two_only_when_the_whole_text_is_a_json_object(text, reward):
    assert rules.json_format_reward(text) == reward


@pytest.mark.parametrize(("text", "reward"), [
    ("no braces", 0.0),
    ('{"a": 1', 0.2),
    ('{"a": 1}', 0.4),
    ("} before {", 0.2),  # the only `}` comes before the `{`
    ("} then { then }", 0.4),
    ("{{{}}}", 0.4),  # capped at 0.4
])
def test_soft_json_format_reward_credits_an_opening_brace_and_a_later_closing_one(text, reward):
    assert rules.soft_json_format_reward(text) == reward


WITH_TOOL = ("<think>I need 17 * 23.</think>\n<tool_call>print(17 * 23)</tool_call>\n"
             "<tool_output>391</tool_output>\n<think>The tool says 391.</think>\n<answer> 391 </answer>\n")


@pytest.mark.parametrize(("text", "reward"), [
    (WITH_TOOL, 1.0),
    ("<think>easy</think><answer>4</answer>", 1.0),  # no tool call is a valid order
    ("<think>a</think><tool_call>x</tool_call><tool_output>1</tool_output>"
     "<tool_call>y</tool_call><tool_output>2</tool_output><answer>3</answer>", 1.0),  # two calls in one round
    ("<think>a</think><tool_call>x</tool_call><answer>4</answer>", 0.5),  # a call without its output
    ("<think>a</think><tool_output>1</tool_output><answer>4</answer>", 0.5),  # an output without a call
    ("<think>a</think><answer>4</answer> Hope this helps!", 0.5),  # text after the answer
    ("<answer>4</answer>", 0.5),  # no reasoning first
    ("<think>a<answer>4</answer>", 0.5),  # an unclosed think is no block
    ("<think>a</think><answer>3</answer><think>b</think><answer>4</answer>", 0.5),  # two answers
    ("<think>a</think>", 0.0),
    ("4", 0.0),
])
def test_tool_format_reward_checks_block_order_and_a_final_answer_block(text, reward):
    assert rules.tool_format_reward(text) == reward


@pytest.mark.parametrize(("text", "reference", "reward"), [
    (WITH_TOOL, "391", 1.0),
    ("<answer>New  York</answer>", "new york", 1.0),  # case and whitespace runs do not matter
    ("<answer>390</answer>", "391", 0.0),
    ("<answer>390</answer><answer>391</answer>", "391", 1.0),  # the last answer counts
    ("The answer is 391.", "391", 0.0),  # not in answer tags
])
def test_tool_answer_reward_compares_the_last_answer_block_with_the_reference(text, reference, reward):
    assert rules.tool_answer_reward(text, reference) == reward


def test_tool_execution_reward_is_the_share_of_successful_calls():
    assert rules.tool_execution_reward(3, 4) == 0.75
    assert rules.tool_execution_reward(0, 2) == 0.0
    assert rules.tool_execution_reward(0, 0) == 0.0  # no call, no execution credit
    with pytest.raises(ValueError, match="successes must be in"):
        rules.tool_execution_reward(5, 4)
