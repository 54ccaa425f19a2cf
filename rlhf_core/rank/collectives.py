"""Collectives over a stage's ranks: every rank calls each with its own values and gets the same result.

Each runs over torch.distributed's default group (or `group`). On one process (a world of one, or
torch.distributed not initialized, as for a trainer built in a unit test) each computes the same result
locally. Sums and means are taken in float64.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from rlhf_core.errors import UserError

Result = TypeVar("Result")


def world_size(group=None) -> int:
    """The ranks in `group` (default: the whole world); 1 when torch.distributed is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_reduce_sum(totals: torch.Tensor, group=None) -> torch.Tensor:
    """`totals` summed over every rank, as a new float64 tensor (ppo_math's `reduce`)."""
    totals = totals.to(torch.float64).clone()
    if world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    return totals


def sum_over_ranks(*values: float, group=None) -> list[float]:
    """Each of `values` summed over every rank (one all-reduce for all of them)."""
    return all_reduce_sum(torch.tensor(values, dtype=torch.float64), group).tolist()


def mean_over_ranks(values: list[float], group=None) -> float:
    """The mean of every rank's `values` (each value weighs the same, whichever rank holds it)."""
    totals = all_reduce_sum(torch.tensor([sum(values), len(values)], dtype=torch.float64), group)
    return (totals[0] / totals[1]).item()


def max_over_ranks(values: list[float], group=None, device: torch.device | str = "cpu") -> list[float]:
    """Each of `values`, the highest over every rank (reduced on `device`: a GPU group's NCCL wants cuda)."""
    highest = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size(group) > 1:
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    return highest.tolist()


def agreed(work: Callable[[], Result], group=None) -> Result:
    """`work()`'s result; a UserError on any rank (the user's reward function or agent) stops every rank
    with the same sentence (a rank left behind would wait in the next collective forever)."""
    problem = ""
    try:
        result = work()  # unset only when work() raised, and then every rank raises below
    except UserError as error:
        problem = str(error)
    problems = [problem]
    if world_size(group) > 1:
        problems = [""] * world_size(group)
        dist.all_gather_object(problems, problem, group=group)
    if any(problems):
        raise UserError(next(text for text in problems if text))
    return result


def mean_extra_logs_over_ranks(logs: dict[str, list[float]], group=None) -> dict[str, float]:
    """A rank's `extra_logs`, each averaged over every value of every rank (a key no rank logged is left out)."""
    mine = {key: (sum(values), len(values)) for key, values in logs.items()}
    gathered = [mine]
    if world_size(group) > 1:
        gathered = [{}] * world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
    totals: dict[str, list[float]] = {}
    for rank_logs in gathered:
        for key, (total, count) in rank_logs.items():
            totals.setdefault(key, [0.0, 0])
            totals[key][0] += total
            totals[key][1] += count
    return {key: total / count for key, (total, count) in sorted(totals.items()) if count}
