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


JOB_CREDENTIAL_PREFIX = "tj1"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def job_credential(token: str, job_id: str) -> str:
    """The bearer credential for the judge calls of one job: the job's id and an HMAC of it
    keyed by a client token. Whoever holds the token (a rollout server) can make it for any
    job; whoever holds only the credential can charge only that job."""
    return f"{JOB_CREDENTIAL_PREFIX}.{job_id}.{_job_mac(token, job_id)}"


def credential_job(authorization: str, tokens: Iterable[str]) -> str | None:
    """The job a `Bearer <job_credential(token, job)>` header speaks for, when one of `tokens`
    made it; None for anything else (a plain token included)."""
    scheme, _, presented = authorization.partition(" ")
    prefix, _, rest = presented.strip().partition(".")
    job_id, _, mac = rest.rpartition(".")
    if scheme.lower() != "bearer" or prefix != JOB_CREDENTIAL_PREFIX or not job_id:
        return None
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(_job_mac(token, job_id).encode(), mac.encode())
    return job_id if matched else None


def _job_mac(token: str, job_id: str) -> str:
    return hmac.new(token.encode(), f"tandem-judge-job:{job_id}".encode(), "sha256").hexdigest()


def is_loopback(host: str) -> bool:
    """Whether a listening address reaches only this machine (127.0.0.0/8, ::1, localhost)."""
    return host in LOOPBACK_HOSTS or host.startswith("127.")
