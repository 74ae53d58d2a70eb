"""The bearer-token match both HTTP services use (services/auth.py)."""

from __future__ import annotations

import pytest

from services.auth import match_bearer

TOKENS = ["alpha-token", "beta-token"]


@pytest.mark.parametrize(
    "header, matched",
    [
        ("Bearer beta-token", "beta-token"),
        ("bearer alpha-token", "alpha-token"),  # the scheme is case-insensitive
        ("Bearer   alpha-token", "alpha-token"),  # RFC 7235: one or more spaces after the scheme
        ("Bearer gamma-token", None),
        ("Bearer alpha", None),  # a prefix of a token is no token
        ("Basic alpha-token", None),
        ("alpha-token", None),
        ("Bearer ", None),
        ("", None),
    ],
)
def test_the_header_matches_the_token_it_presents_with_the_bearer_scheme(header, matched):
    assert match_bearer(header, TOKENS) == matched


def test_no_tokens_match_nothing():
    assert match_bearer("Bearer anything", []) is None
