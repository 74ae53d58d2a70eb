"""What jobs and tenants have spent, as the judge proxy charged them, and the operator's
cap on what each tenant's jobs spend in a calendar month.

The API's settings (`TANDEM_TENANT_BUDGET_USD`, `TANDEM_TENANT_BUDGET_TOKENS`) set one cap
that every tenant is held to, month by month (UTC). The API writes it to Redis while it runs
(`Keys.tenant_caps`, every minute; cleared when unset), so the judge proxy, which charges every
call to its job and to its job's tenant for the month (`Keys.tenant_spend`), holds each call
against it as it holds it against the job's own `budget` (`judge_proxy.spend`): no call is
made that could take the tenant's month past the cap, and a job whose call is refused for it
ends as a job at its own cap does. The API refuses a new job (402) while its tenant's month
is spent, and shows the tenant its month (`GET /v1/spend`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import BaseModel, Field
from redis.exceptions import RedisError

from services.config import BudgetSpec
from services.queues import Keys
from services.redis_values import Value, text, text_fields

SPEND_KINDS = ("usd", "tokens", "cached", "calls")
CAPS_EVERY_S = 60.0
"""How often the API writes the tenant cap again (`keep_caps`)."""
log = logging.getLogger(__name__)


def period(now: float | None = None) -> str:
    """The calendar month (UTC) a call made at `now` is charged to: `2026-11`."""
    return time.strftime("%Y-%m", time.gmtime(time.time() if now is None else now))


async def write_caps(client: aioredis.Redis, cap: BudgetSpec) -> None:
    """Make `cap` the cap on every tenant's month (none: no cap)."""
    async with client.pipeline(transaction=True) as pipe:
        pipe.delete(Keys.tenant_caps)
        for field, limit in cap.limits.items():
            pipe.hset(Keys.tenant_caps, field, limit)
        await pipe.execute()


def cap_of(raw: Mapping[Value, Value]) -> BudgetSpec:
    """The `Keys.tenant_caps` hash read back: the cap on every tenant's month, as the API
    last wrote it."""
    fields = text_fields(raw)
    usd, tokens = fields.get("usd"), fields.get("tokens")
    return BudgetSpec(usd=None if usd is None else float(usd), tokens=None if tokens is None else int(tokens))


def bill_of(raw: Mapping[Value, Value]) -> dict:
    """A spend hash read back (`Keys.job_spend`, `Keys.tenant_spend`): `usd`, `tokens`,
    `cached` and `calls` in all, and `by_role`."""
    by_role: dict[str, dict[str, float]] = {}
    for field, value in raw.items():
        kind, _, role = text(field).partition(":")
        if kind not in SPEND_KINDS or not role:
            continue
        by_role.setdefault(role, {"usd": 0.0, "tokens": 0, "cached": 0, "calls": 0})[kind] = (
            float(value) if kind == "usd" else int(value)
        )
    totals = {kind: sum(r[kind] for r in by_role.values()) for kind in SPEND_KINDS}
    return totals | {"by_role": by_role}


class BillView(BaseModel):
    """A bill as the job API and the judge proxy show it (`bill_of`)."""

    usd: float
    tokens: int
    cached: int
    calls: int
    by_role: dict[str, dict[str, float]] = Field(
        description="Role (simulator, judge, extraction, eval) -> usd, tokens, cached, calls."
    )


def job_cap_label(cap: BudgetSpec) -> str:
    """What a job's own cap is called in its record and in a refusal."""
    return f"the job's spend cap ({describe(cap)})"


def tenant_cap_label(tenant: str, month: str, cap: BudgetSpec) -> str:
    """What the cap on a tenant's month is called in its jobs' records and in a refusal."""
    return f"the spend cap of tenant {tenant!r} for {month} ({describe(cap)})"


def describe(cap: BudgetSpec) -> str:
    return ", ".join(f"{name} {value}" for name, value in cap.limits.items())


@dataclass(frozen=True)
class Month:
    """A tenant's month: what it spent, and the cap."""

    tenant: str
    period: str
    spent: dict
    cap: BudgetSpec

    @property
    def exhausted(self) -> bool:
        """The month's bill has reached a cap: no call of the tenant can be made."""
        return any(self.spent[field] >= cap for field, cap in self.cap.limits.items())

    @property
    def label(self) -> str:
        return tenant_cap_label(self.tenant, self.period, self.cap)

    def view(self) -> dict:
        return {"period": self.period, "cap": self.cap.model_dump(), **self.spent}


async def month(client: aioredis.Redis, tenant: str, cap: BudgetSpec) -> Month:
    """`tenant`'s spend this month, held to `cap`."""
    now = period()
    return Month(tenant, now, bill_of(await client.hgetall(Keys.tenant_spend(tenant, now))), cap)


async def keep_caps(client: aioredis.Redis, cap: BudgetSpec, every_s: float = CAPS_EVERY_S) -> None:
    """Write `cap` now and every `every_s` seconds, so a Redis that lost it (a restart
    without persistence) has it back within that, and a Redis that was down when the API
    started gets it when it is back (the API's lifetime)."""
    while True:
        try:
            await write_caps(client, cap)
        except (RedisError, OSError) as exc:
            log.warning("could not write the tenant spend cap to Redis (%s); trying again in %.0f s", exc, every_s)
        await asyncio.sleep(every_s)
