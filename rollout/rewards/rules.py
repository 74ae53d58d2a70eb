"""Rule-based rewards used in the community, each a pure function of text.

Document parsing (Infinity-Parser): normalised edit distance, paragraph count and
paragraph order. Query rewriting: embedding cosine minus word Jaccard. JSON format: a hard
and a soft check. Tool use (ARTIST): final answer, tag format, tool-execution success ratio.

A paragraph is a maximal run of non-blank lines, stripped; blank lines separate paragraphs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence

import numpy as np

Embed = Callable[[str], Sequence[float]]
"""text -> a fixed-length vector (e.g. a sentence encoder's output)."""

_BLANK_LINES = re.compile(r"\n\s*\n")
_WORD = re.compile(r"\w+")
_TOOL_BLOCK = re.compile(r"<(think|tool_call|tool_output|answer)>(.*?)</\1>", re.DOTALL)
_TOOL_ORDER = re.compile(r"(T(CO)*)+A")
"""think blocks, each followed by any number of (tool_call, tool_output) pairs, then one
answer; over the block letters of `_block_letters`."""
_LETTER = {"think": "T", "tool_call": "C", "tool_output": "O", "answer": "A"}


def levenshtein_distance(a: str, b: str) -> int:
    """The least number of one-character insertions, deletions and substitutions turning
    `a` into `b`. Time O(len(a) * len(b)), memory O(len(b)).

    The classic row-by-row DP, with each row computed by numpy: substitutions and deletions
    depend only on the previous row; insertions chain along the row, and
    row[j] = min_k<=j (cand[k] + j - k) is a running minimum of cand[k] - k, plus j.
    """
    b_codes = np.array([ord(c) for c in b], dtype=np.int64)
    offsets = np.arange(len(b) + 1)
    row = offsets.copy()
    for i, char in enumerate(a, start=1):
        cand = np.empty_like(row)
        cand[0] = i
        cand[1:] = np.minimum(row[1:] + 1, row[:-1] + (b_codes != ord(char)))
        row = np.minimum.accumulate(cand - offsets) + offsets
    return int(row[-1])


def normalized_levenshtein_reward(pred: str, ref: str) -> float:
    """1 - levenshtein(pred, ref) / max(len(pred), len(ref)), in [0, 1]: 1 for identical
    strings (two empty strings included), 0 when no character lines up."""
    longest = max(len(pred), len(ref))
    if longest == 0:
        return 1.0
    return 1.0 - levenshtein_distance(pred, ref) / longest


def paragraphs(text: str) -> list[str]:
    """The non-empty paragraphs of `text`, in order, each stripped."""
    return [p.strip() for p in _BLANK_LINES.split(text) if p.strip()]


def paragraph_count_reward(pred: str, ref: str) -> float:
    """1 - |n_pred - n_ref| / max(n_pred, n_ref) over paragraph counts, in [0, 1]: missing
    and extra paragraphs cost the same. 1 when both texts have no paragraph."""
    n_pred, n_ref = len(paragraphs(pred)), len(paragraphs(ref))
    if max(n_pred, n_ref) == 0:
        return 1.0
    return 1.0 - abs(n_pred - n_ref) / max(n_pred, n_ref)


def matched_positions(pred: str, ref: str) -> list[int]:
    """For each reference paragraph, in reference order, the index of the predicted
    paragraph most similar to it (highest normalised Levenshtein reward; the earliest on
    a tie). Several reference paragraphs may match the same predicted one."""
    predicted = paragraphs(pred)
    return [
        max(range(len(predicted)), key=lambda j: (normalized_levenshtein_reward(predicted[j], r), -j))
        for r in paragraphs(ref)
    ]


def count_inversions(positions: Sequence[int]) -> int:
    """Pairs i < j with positions[i] > positions[j] (equal positions are no inversion)."""
    return sum(positions[i] > positions[j] for i in range(len(positions)) for j in range(i + 1, len(positions)))


def paragraph_order_reward(pred: str, ref: str) -> float:
    """1 - inversions / (n_ref choose 2), in [0, 1], where the inversions are counted in the
    `matched_positions` of the reference paragraphs: 1 when the matched paragraphs appear in
    reference order, 0 when fully reversed.

    With fewer than two reference paragraphs no pair can be out of order: 1. With two or
    more and no predicted paragraph there is nothing to match: 0. Missing paragraphs are the
    count reward's business, so several reference paragraphs matching one predicted
    paragraph are not inverted."""
    num_ref = len(paragraphs(ref))
    if num_ref < 2:
        return 1.0
    if not paragraphs(pred):
        return 0.0
    return 1.0 - count_inversions(matched_positions(pred, ref)) / (num_ref * (num_ref - 1) / 2)


def document_parsing_reward(pred: str, ref: str) -> float:
    """Infinity-Parser's multi-aspect reward R_dist + R_count + R_order, in [0, 3]."""
    return normalized_levenshtein_reward(pred, ref) + paragraph_count_reward(pred, ref) + paragraph_order_reward(pred, ref)


def jaccard_similarity(a: str, b: str) -> float:
    """|A & B| / |A | B| over the sets of lower-cased words (`\\w+`), in [0, 1]; 1 when
    neither text has a word."""
    words_a, words_b = set(_WORD.findall(a.lower())), set(_WORD.findall(b.lower()))
    if not words_a | words_b:
        return 1.0
    return len(words_a & words_b) / len(words_a | words_b)


def cosine_similarity(u: Sequence[float], v: Sequence[float]) -> float:
    """u . v / (|u| |v|), in [-1, 1]; 0 when either vector is zero."""
    u, v = np.asarray(u, dtype=np.float64), np.asarray(v, dtype=np.float64)
    norms = np.linalg.norm(u) * np.linalg.norm(v)
    return float(u @ v / norms) if norms else 0.0


def query_rewrite_reward(query: str, rewrite: str, embed: Embed) -> float:
    """cosine(embed(query), embed(rewrite)) - jaccard(query, rewrite), in [-2, 1]: high
    when the rewrite means the same thing in other words.

    `embed` is required: no encoder ships with Tandem (nothing is downloaded at run time),
    so the caller plugs in one (the m3e-small sentence encoder in the original recipe)."""
    return cosine_similarity(embed(query), embed(rewrite)) - jaccard_similarity(query, rewrite)


def json_format_reward(text: str) -> float:
    """Hard format check: 0.2 if the whole text, less surrounding whitespace, parses as one
    JSON object (a dict; an array or a scalar does not count), else 0.0."""
    try:
        return 0.2 if isinstance(json.loads(text), dict) else 0.0
    except json.JSONDecodeError:
        return 0.0


def soft_json_format_reward(text: str) -> float:
    """Soft format check, in {0, 0.2, 0.4}: 0.2 if the text contains `{`, and 0.2 more if a
    `}` appears after the first `{`. Partial credit while the model learns the format."""
    opening = text.find("{")
    if opening < 0:
        return 0.0
    return 0.4 if "}" in text[opening + 1:] else 0.2


def _normalise_answer(text: str) -> str:
    return " ".join(text.split()).casefold()


def tool_answer_reward(text: str, reference: str) -> float:
    """1.0 if the content of the last `<answer>...</answer>` block in `text` equals
    `reference` up to case and whitespace runs, else 0.0 (also when there is no block)."""
    answers = [body for tag, body in _TOOL_BLOCK.findall(text) if tag == "answer"]
    return float(bool(answers) and _normalise_answer(answers[-1]) == _normalise_answer(reference))


def _block_letters(text: str) -> str:
    """The closed tag blocks of a tool-use rollout in order, one letter each: T (think),
    C (tool_call), O (tool_output), A (answer). Unclosed tags are not blocks."""
    return "".join(_LETTER[tag] for tag, _ in _TOOL_BLOCK.findall(text))


def tool_format_reward(text: str) -> float:
    """ARTIST-style format reward for a whole tool-use rollout, in {0, 0.5, 1}.

    The template: `<think>...</think>`, then any number of `<tool_call>...</tool_call>`
    each followed at once by its `<tool_output>...</tool_output>`, repeated in rounds that
    each open with `<think>`, and finally `<answer>...</answer>`.
    0.5 if the blocks follow that order (exactly one answer, last); 0.5 if the text ends
    with an answer block (nothing but whitespace after `</answer>`).
    """
    order = 0.5 if _TOOL_ORDER.fullmatch(_block_letters(text)) else 0.0
    final = 0.5 if re.search(r"<answer>.*?</answer>\s*\Z", text, re.DOTALL) else 0.0
    return order + final


def tool_execution_reward(successes: int, total: int) -> float:
    """Successful tool calls / tool calls, in [0, 1]; 0 for a rollout with no tool call
    (it earns no execution credit)."""
    if not 0 <= successes <= total:
        raise ValueError(f"successes must be in [0, total], got {successes} of {total}")
    return successes / total if total else 0.0
