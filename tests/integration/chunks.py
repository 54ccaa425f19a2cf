"""Chunks trained straight through `ensure_checkpoint`, without Prefect, on a `StageRunner` of their own that is
closed afterwards (its ranks stopped): each call starts from the store, as a resumed command does."""

from __future__ import annotations

from rlhf_core.config import RunConfig
from rlhf_core.driver.chunk import ChunkResult, ensure_checkpoint
from rlhf_core.driver.resume import Lineage
from rlhf_core.driver.runner import StageRunner


def train_chunks(run: RunConfig, stage: str, *targets: int, lineage: Lineage = Lineage(),
                 cold: bool = False) -> list[ChunkResult]:
    """`ensure_checkpoint` for each target in turn, the worker group kept warm between them unless `cold` (then
    restarted before each, as a resume would)."""
    results = []
    with StageRunner(run) as runner:
        for target in targets:
            if cold:
                runner.release_workers()
            results.append(ensure_checkpoint(runner, stage, target, lineage))
    return results
