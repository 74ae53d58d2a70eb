"""The search tool: BM25 over a local collection of short documents, so an episode can look
up a fact it has to cite instead of recalling it.

The collection is a JSONL file of {"id", "title", "text"} objects (the built-in fixture
`data/search_docs.jsonl` when the spec names none). It is read and indexed once, when the
tool is built; a call only tokenizes the query and ranks the documents. Words are lower-cased
and English stopwords dropped by `bm25s.tokenize`; there is no stemming, so "bridges" does
not match "bridge".
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import bm25s

from rollout.tools.base import ToolError, function_schema
from services.config import SearchToolSpec

FIXTURE = Path(__file__).parent / "data" / "search_docs.jsonl"
"""The collection searched when the spec names no `data` file."""
DESCRIPTION = "Search the document collection; returns the best matching passages."
MAX_TEXT_CHARS = 300
"""A hit's text is cut near this length so a few hits stay short in a small model's context."""
_FIELDS = ("id", "title", "text")
MAX_DATA_BYTES = 256 << 20
"""The largest collection a search tool loads: the whole file is held and indexed in memory."""


@dataclass(frozen=True)
class Document:
    """One searchable passage; the model sees `id` to tell hits apart and cite them."""

    id: str
    title: str
    text: str


def load_documents(path: Path) -> list[Document]:
    """Every document of the JSONL file at `path`, in file order. Blank lines are skipped and
    keys other than id, title and text ignored. Raises ValueError naming the file and line
    for a line that is not such an object or repeats an earlier id, and for a file with no
    documents."""
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file")
    if path.stat().st_size > MAX_DATA_BYTES:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, over the {MAX_DATA_BYTES} a search tool loads")
    documents: list[Document] = []
    seen_ids: set[str] = set()
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                document = _parse_document(line)
            except ValueError as error:
                raise ValueError(f"{path}, line {number}: {error}") from None
            if document.id in seen_ids:
                raise ValueError(f"{path}, line {number}: id {document.id!r} repeats an earlier line's")
            seen_ids.add(document.id)
            documents.append(document)
    if not documents:
        raise ValueError(f"{path}: no documents to search")
    return documents


def _parse_document(line: str) -> Document:
    """The document one JSONL line holds; ValueError saying what is wrong with the line."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected an object with id, title and text, got a {type(row).__name__}")
    for key in _FIELDS:
        if key not in row:
            raise ValueError(f"missing {key!r}")
        if not isinstance(row[key], str):
            raise ValueError(f"{key!r} must be a string, got a {type(row[key]).__name__}")
    return Document(row["id"], row["title"], row["text"])


def _tokenize(texts: list[str]) -> list[list[str]]:
    """Each text as its lower-cased words of two or more characters, English stopwords out;
    the same function tokenizes the collection and the queries, so their words line up."""
    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


def format_hit(document: Document) -> str:
    """One line the model reads: `[id] title: text`, whitespace collapsed and the text cut at
    a word boundary near `MAX_TEXT_CHARS`."""
    text = " ".join(document.text.split())
    if len(text) > MAX_TEXT_CHARS:
        text = text[:MAX_TEXT_CHARS].rsplit(" ", 1)[0] + " ..."
    return f"[{document.id}] {document.title}: {text}"


class SearchTool:
    """A `Tool` answering {"query": str} with the `spec.top_k` best matching documents, one
    per line, best first. Only documents sharing a word with the query count as matches."""

    def __init__(self, spec: SearchToolSpec):
        self.name = spec.name
        self.description = spec.description or DESCRIPTION
        self.top_k = spec.top_k
        self.documents = load_documents(Path(spec.data) if spec.data else FIXTURE)
        self.retriever = bm25s.BM25()
        # The title is indexed with the text: it often holds the very word a query asks about.
        self.retriever.index(_tokenize([f"{d.title}\n{d.text}" for d in self.documents]), show_progress=False)

    def schema(self) -> dict:
        query = {"type": "string", "description": "Keywords or a short question to look up."}
        return function_schema(self.name, self.description, {"query": query}, ["query"])

    async def call(self, arguments: dict) -> str:
        query = arguments["query"]
        if not query.strip():
            raise ToolError("The query is empty; give some keywords to search for.")
        # Ranking is CPU work: a thread keeps the event loop free for the other episodes.
        hits = await asyncio.to_thread(self.search, query)
        if not hits:
            raise ToolError(f"No document matches {query!r}; try other keywords.")
        return "\n".join(format_hit(document) for document in hits)

    def search(self, query: str) -> list[Document]:
        """The documents scoring above zero for `query`, best first, at most `top_k`."""
        k = min(self.top_k, len(self.documents))  # bm25s refuses a k above the collection size
        indices, scores = self.retriever.retrieve(_tokenize([query]), k=k, show_progress=False)
        return [self.documents[i] for i, score in zip(indices[0], scores[0]) if score > 0]

    async def close(self) -> None:
        """Nothing to release: the index is plain memory."""


async def open_tools(specs: list[SearchToolSpec]) -> list[SearchTool]:
    """The tools of `specs` (all of this kind), in their order (`rollout.tools.box.TOOL_MODULES`)."""
    return [await asyncio.to_thread(SearchTool, spec) for spec in specs]
