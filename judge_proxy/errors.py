"""The errors the judge proxy answers with, in OpenAI's shape, or passes through."""

from __future__ import annotations


class ProxyError(Exception):
    """An error answered to the client in OpenAI's shape, `{"error": {"message", "type",
    "param", "code"}, **extra}`: `param` names the field at fault, `code` repeats `kind`."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        *,
        retry_after_s: int | None = None,
        param: str | None = None,
        extra: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.retry_after_s = retry_after_s
        self.extra = extra or {}

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.kind},
            **self.extra,
        }


class UpstreamClientError(Exception):
    """An upstream's 4xx about the request itself, passed through (key redacted)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"upstream answered {status}")
        self.status, self.body = status, body


def too_large(model: str, cost_tokens: int) -> ProxyError:
    return ProxyError(
        400,
        f"the request needs {cost_tokens} tokens (estimated prompt + n * max_tokens), more "
        f"than any upstream of {model!r} allows per minute",
        "request_too_large",
        param="max_tokens",
    )
