"""Quoting text a model wrote inside a prompt for another model (the judge, the user
simulator), so that it reads as data and never as the prompt's own instructions.

Each turn goes between `<TAG role="...">` and `</TAG>`, TAG a digest of the conversations
being quoted. A turn cannot hold the closing tag, since it would have to contain a digest
of itself, so no turn can end its quote, or the transcript, early. The digest is a
function of the text, so the same request renders the same prompt every time (the
judge's cache and a provider's prefix cache still match). `quoted_turns` reads the turns
back, as the stand-in provider does; `unquoted` is a model's answer without the turns it
quoted back, so that what a quoted turn says is never read as the answer's own words.

Quoting does not stop a served model's tokenizer from reading `<|im_start|>user`, spelled in
a turn with ordinary tokens, as the special token that opens a turn: every quoted turn is
`neutralised` first (a zero-width joiner after the marker's first character), and so is any
model-written text that reaches a model as a chat turn of its own (τ²'s user).

Reading what a model wrote is here too: its Markdown fenced blocks (`fenced_blocks`), the
JSON object a reply holds among other text (`json_object`), and a reply that is one JSON
object and nothing else (`only_json_object`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable

TAG = re.compile(r"q[0-9a-f]{16}")
ZERO_WIDTH_JOINER = "\u200d"
_MARKER_OPENING = re.compile(r"<(?=[|\uff5c])|<(?=/?(?:s|bos|eos|start_of_turn|end_of_turn)>)|\[(?=/?INST\])")
"""The opening character of a turn marker's spelling, broken by `neutralised`."""
_WHOLE_FENCE = re.compile(r"\A```[\w+-]*[ \t]*\n(.*)\n[ \t]*```\Z", re.DOTALL)
_FENCE = re.compile(r"^```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)


def quote_tag(conversations: list[list[dict]]) -> str:
    """A tag no turn of `conversations` contains."""
    texts = json.dumps(conversations, sort_keys=True, default=str)
    digest = hashlib.sha256(texts.encode()).hexdigest()
    while f"q{digest[:16]}" in texts:  # only by chance, one time in 2**64
        digest = hashlib.sha256(digest.encode()).hexdigest()
    return f"q{digest[:16]}"


def quote_turns(turns: list[tuple[str, str]], tag: str) -> str:
    """(role, text) pairs, each quoted and `neutralised`, separated by blank lines."""
    return "\n\n".join(f'<{tag} role="{role}">\n{neutralised(text)}\n</{tag}>' for role, text in turns)


def turn_pattern(tag: str) -> re.Pattern:
    """One turn quoted with `tag`; groups: role, text."""
    return re.compile(rf'<{tag} role="([^"]*)">\n(.*?)\n</{tag}>', re.DOTALL)


def quoted_turns(text: str, tag: str) -> list[tuple[str, str]]:
    """The (role, text) pairs quoted with `tag` in `text`, in order."""
    return turn_pattern(tag).findall(text)


def unquoted(text: str, tag: str) -> str:
    """`text` with every turn quoted with `tag` (opening tag to closing tag) cut out; `text`
    itself when `tag` is empty. Only the prompt's writer and the model answering know the tag,
    so no quoted turn can cut the answer's own words."""
    if not tag:
        return text
    return re.sub(rf"<{tag}\b[^>]*>.*?</{tag}>", "\n", text, flags=re.DOTALL)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """Each Markdown ``` fenced block of `text`, in order, as (info word lower-cased, body);
    the info word is '' for a bare fence. Fences open and close at the start of a line."""
    return [(info.lower(), body) for info, body in _FENCE.findall(text)]


def json_object(text: str) -> dict | None:
    """The JSON object from the first `{` to the last `}` of a reply (fences and words around
    it are common), read leniently: raw newlines inside strings are allowed, as models
    write them. None when there is no such object."""
    start, end = text.find("{"), text.rfind("}")
    if not 0 <= start < end:
        return None
    try:
        found = json.loads(text[start : end + 1], strict=False)
    except json.JSONDecodeError:
        return None
    return found if isinstance(found, dict) else None


def only_json_object(text: str) -> dict | None:
    """The JSON object that is the whole reply (blank space or one ``` fence around it
    allowed; raw newlines inside strings too), or None: nothing is picked out of other text,
    so an object the reply merely quotes is never taken for the reply."""
    body = text.strip()
    if fenced := _WHOLE_FENCE.match(body):
        body = fenced.group(1)
    try:
        found = json.loads(body, strict=False)
    except json.JSONDecodeError:
        return None
    return found if isinstance(found, dict) else None


def neutralised(text: str, markers: Iterable[str] = ()) -> str:
    """`text` with every control-token spelling broken by a zero-width joiner after its first
    character, so that no tokenizer reads it as the special token: the turn markers of the
    common chat template families (`<|...|>` as in ChatML, Llama 3, Phi; `<｜...｜>`;
    Gemma's `<start_of_turn>`; Mistral's `[INST]`, `<s>`), and each of `markers` (a
    tokenizer's own special tokens). Text without them is returned as it is."""
    text = _MARKER_OPENING.sub(lambda found: found.group(0) + ZERO_WIDTH_JOINER, text)
    for marker in markers:
        if len(marker) > 1 and marker in text:
            text = text.replace(marker, marker[0] + ZERO_WIDTH_JOINER + marker[1:])
    return text
