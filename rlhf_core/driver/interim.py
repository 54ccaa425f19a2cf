"""The driver's side of the snapshots between commits (`rlhf_core.rank.interim`): which group takes them, under
which key, and what a group started from one carries into its chunk.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass

from rlhf_core.config import RunConfig
from rlhf_core.storage.interim import NUM_SLOTS, STALL_BUDGET, InterimPlan
from rlhf_core.stages.base import StageConfig


@dataclass(frozen=True)
class InterimStart:
    """A group started from a snapshot between commits: its step, the commit it trained on from (0: none yet),
    and the metrics of the steps between the two (the chunk's summary counts them, as if it had trained them)."""

    step: int
    base_step: int
    metrics: list[dict[str, float]]
    interval: int  # K, as the ranks had chosen it when they took it

    def describe(self) -> str:
        return f"a snapshot between commits, taken every {self.interval} step{'s' if self.interval != 1 else ''}"


def interim_plan(run: RunConfig, stage: str, token: str, world_size: int, zero_stage: int | None
                 ) -> InterimPlan | None:
    """The ranks' snapshots between commits for one group (None: --snapshot_steps -1, a stage saving no
    DeepSpeed state, or no command token). The key tells one command's stage on one group shape from any other:
    a snapshot is never read by another command, world size or ZeRO stage."""
    if not token or run.snapshot_steps < 0 or run.section(stage, StageConfig).disable_ds_ckpt:
        return None
    key = hashlib.sha256(f"{token}/{run.stage_url(stage)}/{world_size}/{zero_stage}".encode()).hexdigest()[:16]
    return InterimPlan(key, run.snapshot_steps, world_size, socket.gethostname(), os.getpid())


def interim_note(run: RunConfig) -> str:
    """The placement line's words on the snapshots between commits (the run's memory for them, bounded)."""
    if run.snapshot_steps < 0:
        return ""
    every = (f"every {run.snapshot_steps} step{'s' if run.snapshot_steps > 1 else ''}" if run.snapshot_steps
             else f"every K steps (a copy within {STALL_BUDGET:.0%} of training)")
    return (f"; snapshots between commits {every} in each node's tmpfs, at most {NUM_SLOTS} per rank, each its "
            "share of the DeepSpeed state")
