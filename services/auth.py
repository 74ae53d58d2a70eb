"""Bearer-token checks shared by the HTTP services (the job API, the judge proxy). Each
service decides what a failed check answers; this module only says which token matched."""

from __future__ import annotations

import hmac
from collections.abc import Iterable


def match_bearer(authorization: str, tokens: Iterable[str]) -> str | None:
    """The one of `tokens` that an `Authorization` header value presents as `Bearer <token>`
    (scheme in any case), or None. Every token is compared, each in constant time, so the
    time taken tells neither which token matched nor how much of a wrong one was right."""
    scheme, _, presented = authorization.partition(" ")
    presented_bytes = presented.strip().encode()
    matched = None
    for token in tokens:
        if hmac.compare_digest(token.encode(), presented_bytes):
            matched = token
    return matched if scheme.lower() == "bearer" else None
