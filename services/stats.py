"""Small aggregation helpers shared by the processes' metrics."""

from __future__ import annotations


def mean_by_key(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over the rows that have it (a metric that does not apply to a row,
    like `asked` for a follow-up context, is not counted as zero)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for row in rows:
        for name, value in row.items():
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    return {name: sums[name] / counts[name] for name in sums}
