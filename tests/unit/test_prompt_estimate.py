"""What a prompt estimate counts: every part of a request a provider bills, so a request
cannot hide prompt tokens from the budget in its tool calls, names or schemas."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from devtools.provider import count_prompt_tokens
from judge_proxy.upstream import UpstreamConfig, estimate_prompt_tokens

TOOL_TURNS = [
    {
        "role": "assistant",
        "content": None,
        "name": "bot",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"q": "abcdefgh"})},
            }
        ],
    },
    {"role": "tool", "content": "abcd", "tool_call_id": "call_1"},
]
SCHEMAS = {
    "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
    "response_format": {"type": "json_object"},
}


def test_the_estimate_counts_names_tool_calls_and_tool_call_ids_beside_the_content():
    # Each string by chars/4, rounded up: "bot" 1; the tool call's keys and values
    # id 1, call_1 2, type 1, function 2, function 2, name 1, lookup 2, arguments 3,
    # '{"q": "abcdefgh"}' 5 (17 chars): 19. The tool's reply: abcd 1, call_1 2.
    assert estimate_prompt_tokens(TOOL_TURNS) == (0 + 1 + 19 + 4) + (1 + 2 + 4) + 3


def test_the_estimate_counts_the_tools_and_response_format_schemas_of_the_request():
    # tools: type 1, function 2, function 2, name 1, lookup 2, parameters 3, type 1, object 2;
    # response_format: type 1, json_object 3.
    request = {"model": "m", "messages": TOOL_TURNS, "temperature": 0.5, **SCHEMAS}

    assert estimate_prompt_tokens(TOOL_TURNS, request=request) == (0 + 1 + 19 + 4) + (1 + 2 + 4) + 14 + 4 + 3


def test_the_stand_in_bills_a_messages_other_fields_and_the_requests_schemas_as_json_text():
    messages = [{"role": "user", "content": "hi", "name": "ann"}]
    request = {"messages": messages, "tools": [{"type": "function"}]}

    # hi 1; '"ann"' is " ann " 3; '[{"type": "function"}]' is [ { " type " : " function " } ] 11.
    assert count_prompt_tokens(messages, request=request) == (1 + 3 + 4) + 11 + 3


@pytest.mark.parametrize("band", [(1.5, 4.0), (0.5, 0.9), (0.0, 2.0)])
def test_a_prompt_ratio_band_must_hold_one_above_zero(band):
    with pytest.raises(ValidationError, match="prompt_ratio_band"):
        UpstreamConfig(name="a", model="m", base_url="http://x/v1", tpm=1, rpm=1, prompt_ratio_band=band)
