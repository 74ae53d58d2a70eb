"""The search tool: which documents a query finds in the built-in collection and in a given
file, what the model reads back, and how bad queries and bad data files are reported."""

from __future__ import annotations

import json

import pytest

from rollout.tools.base import ToolError
from rollout.tools.search import MAX_TEXT_CHARS, SearchTool
from services.config import SearchToolSpec


def search_tool(**spec) -> SearchTool:
    return SearchTool(SearchToolSpec(name="search", kind="search", **spec))


def write_jsonl(path, rows: list) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def hit_ids(reply: str) -> list[str]:
    """The ids of the hits in a reply, in order: each line starts with `[id]`."""
    return [line[1 : line.index("]")] for line in reply.splitlines()]


@pytest.mark.parametrize(
    ("query", "expected_id"),
    [
        ("How tall is the clock tower in Brindlemoor?", "d03"),
        ("Who is the mayor of Brindlemoor", "d04"),
        ("how many metres in a nautical mile", "d16"),
        ("how many centimetres in an inch", "d14"),
        ("speed of sound in air", "d27"),
    ],
)
async def test_a_question_finds_the_document_holding_its_answer_first(query, expected_id):
    reply = await search_tool().call({"query": query})

    assert hit_ids(reply)[0] == expected_id


async def test_a_hit_reads_as_id_title_and_text_on_one_line():
    reply = await search_tool(top_k=1).call({"query": "ferry Hollin Cross"})

    assert reply == (
        "[d07] Brindlemoor ferry: A ferry crosses the river Asket from Brindlemoor to the village "
        "of Hollin Cross every 40 minutes; the crossing takes 12 minutes."
    )


async def test_top_k_caps_the_hits_and_only_documents_sharing_a_word_count():
    # 13 fixture documents mention Brindlemoor; "speed of sound" shares words with two.
    assert len(hit_ids(await search_tool(top_k=5).call({"query": "Brindlemoor"}))) == 5
    assert len(hit_ids(await search_tool(top_k=1).call({"query": "Brindlemoor"}))) == 1
    assert hit_ids(await search_tool(top_k=10).call({"query": "speed of sound"})) == ["d27", "d21"]


@pytest.mark.parametrize("query", ["zebra quantum", "the of and"])
async def test_a_query_matching_no_document_is_a_tool_error(query):
    with pytest.raises(ToolError, match="No document matches"):
        await search_tool().call({"query": query})


@pytest.mark.parametrize("query", ["", "   \n"])
async def test_an_empty_query_is_a_tool_error(query):
    with pytest.raises(ToolError, match="empty"):
        await search_tool().call({"query": query})


async def test_a_given_data_file_replaces_the_fixture_and_long_texts_are_cut(tmp_path):
    long_text = "Otters hold hands while sleeping. " * 30
    data = write_jsonl(
        tmp_path / "docs.jsonl",
        [
            {"id": "a", "title": "Otters", "text": long_text, "source": "notes"},
            "",
            {"id": "b", "title": "Badgers", "text": "Badgers dig setts."},
        ],
    )
    tool = search_tool(data=data, top_k=10)

    reply = await tool.call({"query": "otters sleeping"})

    assert hit_ids(reply) == ["a"]
    assert reply.startswith("[a] Otters: Otters hold hands while sleeping. Otters")
    assert reply.endswith(" ...")
    assert len(reply) <= len("[a] Otters: ") + MAX_TEXT_CHARS + len(" ...")
    with pytest.raises(ToolError):
        await tool.call({"query": "clock tower"})  # a fixture document, not in this file


@pytest.mark.parametrize(
    ("bad_line", "complaint"),
    [
        ('{"id": "b", "title": "Badgers"', "not valid JSON"),
        ('["b", "Badgers", "Badgers dig setts."]', "expected an object"),
        ('{"id": "b", "text": "Badgers dig setts."}', "missing 'title'"),
        ('{"id": 2, "title": "Badgers", "text": "Badgers dig setts."}', "'id' must be a string"),
        ('{"id": "a", "title": "Badgers", "text": "Badgers dig setts."}', "id 'a' repeats"),
    ],
)
def test_a_bad_line_is_rejected_naming_the_file_the_line_and_the_fault(tmp_path, bad_line, complaint):
    data = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "title": "Otters", "text": "Otters swim."}, bad_line])

    with pytest.raises(ValueError, match=f"docs.jsonl, line 2: {complaint}"):
        search_tool(data=data)


def test_a_file_without_documents_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no documents"):
        search_tool(data=write_jsonl(tmp_path / "empty.jsonl", [""]))


def test_the_schema_asks_for_one_required_query_string_and_takes_the_spec_description():
    function = search_tool(description="Look things up in the atlas.").schema()["function"]

    assert function["name"] == "search"
    assert function["description"] == "Look things up in the atlas."
    assert function["parameters"]["properties"]["query"]["type"] == "string"
    assert function["parameters"]["required"] == ["query"]
    assert search_tool().schema()["function"]["description"].startswith("Search the document collection")
