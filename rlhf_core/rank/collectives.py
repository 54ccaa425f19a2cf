"""Collectives over a stage's ranks: every rank calls each with its own values and gets the same result."""

from __future__ import annotations


def mean_extra_logs_over_ranks(logs: dict[str, list[float]], world_size: int) -> dict[str, float]:
    """A rank's `extra_logs`, each averaged over every value of every rank (a collective: every rank calls it)."""
    import torch.distributed as dist

    gathered: list[dict] = [{}] * world_size
    dist.all_gather_object(gathered, {key: (sum(values), len(values)) for key, values in logs.items()})
    totals: dict[str, list[float]] = {}
    for rank_logs in gathered:
        for key, (total, count) in rank_logs.items():
            totals.setdefault(key, [0.0, 0])
            totals[key][0] += total
            totals[key][1] += count
    return {key: total / count for key, (total, count) in sorted(totals.items()) if count}
