"""Redis replies read the same whether a client decodes them or not."""

from services.redis_values import raw, stream_entries, text, text_fields


def test_text_and_raw_take_bytes_or_text_alike():
    assert text(b"caf\xc3\xa9") == text("café") == "café"
    assert raw("café") == raw(b"caf\xc3\xa9") == b"caf\xc3\xa9"
    assert text_fields({b"status": b"RUNNING", "step": "3"}) == {"status": "RUNNING", "step": "3"}


def test_stream_entries_give_ids_as_text_and_skip_nil_entries():
    reply = [(b"1-0", {b"f": b"a"}), (None, None), ("2-0", None), ("3-0", {"f": "c"})]
    assert list(stream_entries(reply)) == [("1-0", {b"f": b"a"}), ("3-0", {"f": "c"})]
    assert list(stream_entries(None)) == []
