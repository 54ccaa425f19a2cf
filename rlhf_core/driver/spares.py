"""Warm spare ranks: rank actors started beside a worker group, with torch, DeepSpeed and the stage's trainer
already imported, that a group replacing lost or hung ranks takes as its ranks (`SparePool.take`). On a CPU a new
rank spends about 5 s of its 6 s start in its process start and these imports; a spare skips them.

Spares hold no resources of the cluster (0 CPUs: they idle until taken), and warm up on CPU time the ranks leave
unused (SCHED_IDLE, as the checkpoint writer does), so training does not slow down for them. Only a spare whose
warm-up has finished is taken; the others are left to finish. GPU ranks get none by default: a spare would have
to hold a GPU of its own, idle; their replacement starts cold in the lost rank's freed bundle.
docs/design-notes.md ("Replacing a lost rank") has the rest.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import ray
from ray.actor import ActorHandle

from rlhf_core.config import RunConfig
from rlhf_core.driver.engine import rank_actor
from rlhf_core.driver.placement import placement_bundle

logger = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 2.0


def num_spares(run: RunConfig, world_size: int) -> int:
    """`--num_spare_workers`, by default as many as the group's ranks when they use no GPU, else none."""
    if run.num_spare_workers is not None:
        return run.num_spare_workers
    return 0 if placement_bundle(run).get("GPU", 0) else world_size


class SparePool:
    """Warm rank actors not yet part of any group, each with the reference to its warm-up (done when ready)."""

    def __init__(self) -> None:
        self._spares: list[tuple[ActorHandle, ray.ObjectRef]] = []

    def __len__(self) -> int:
        return len(self._spares)

    def num_ready(self) -> int:
        """How many spares have finished their warm-up (a bench waits for them before it kills a rank)."""
        refs = [ready for _, ready in self._spares]
        return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else 0

    def fill(self, run: RunConfig, stage: str, count: int) -> None:
        """Start spares, without waiting, until there are `count`."""
        for _ in range(count - len(self._spares)):
            spare = rank_actor(run, -1, 0, num_cpus=0, num_gpus=0)
            self._spares.append((spare, spare.warm_spare.remote(run, stage)))

    def take(self, count: int) -> list[ActorHandle]:
        """Up to `count` spares whose warm-up has finished; a spare whose warm-up failed (its process died) is
        dropped."""
        done_refs = set()
        if self._spares:
            refs = [ready for _, ready in self._spares]
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            done_refs = set(done)
        taken: list[ActorHandle] = []
        kept: list[tuple[ActorHandle, ray.ObjectRef]] = []
        for spare, ready in self._spares:
            if ready not in done_refs or len(taken) == count:
                kept.append((spare, ready))
                continue
            try:
                ray.get(ready, timeout=1.0)
            except Exception:  # noqa: BLE001 - a spare that failed its warm-up is no spare
                logger.info("a spare rank failed its warm-up; dropped", exc_info=True)
                with contextlib.suppress(Exception):
                    ray.kill(spare)
                continue
            taken.append(spare)
        self._spares = kept
        return taken

    def close(self) -> None:
        """Kill the spares, waiting at most CLOSE_TIMEOUT_S: after a SIGTERM to the whole process group Ray's GCS
        may be gone, and `ray.kill` would wait for it (leaving the process ends them anyway)."""
        spares, self._spares = self._spares, []
        if not spares:
            return

        def kill() -> None:
            for spare, _ in spares:
                with contextlib.suppress(Exception):
                    ray.kill(spare)

        killing = threading.Thread(target=kill, name="rlhf-kill-spares", daemon=True)
        killing.start()
        killing.join(CLOSE_TIMEOUT_S)
