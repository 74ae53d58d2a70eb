"""Redis replies as Tandem reads them.

redis-py annotates every reply value as `bytes | str`: a client built with
`decode_responses=True` gets text, any other gets bytes. Tandem's clients (`queues.connect`)
never decode, so replies arrive as bytes; these helpers take either, so the code and the
type checker agree without casts, and a client that did decode would still read right.
"""

from collections.abc import Iterable, Iterator, Mapping

Value = bytes | str
"""One value of a Redis reply: a key, a field, a member, an entry id."""


def text(value: Value) -> str:
    """`value` as text (UTF-8, as every writer in Tandem encodes)."""
    return value.decode() if isinstance(value, bytes) else value


def raw(value: Value) -> bytes:
    """`value` as bytes, for msgspec decoding and byte-level parsing."""
    return value if isinstance(value, bytes) else value.encode()


def text_fields(record: Mapping[Value, Value]) -> dict[str, str]:
    """A hash (HGETALL's reply) with its fields and values as text."""
    return {text(field): text(value) for field, value in record.items()}


def stream_entries(
    reply: Iterable[tuple[Value | None, Mapping[Value, Value] | None]] | None,
) -> Iterator[tuple[str, Mapping[Value, Value]]]:
    """A stream range's entries (XRANGE's, XREVRANGE's reply) as (id as text, fields).
    redis-py's type lets an entry be nil, which only an XREADGROUP or XCLAIM of a deleted
    entry returns; a range never does, and such an entry would carry nothing to read."""
    for entry_id, fields in reply or ():
        if entry_id is not None and fields is not None:
            yield text(entry_id), fields
