"""Warm spare ranks: rank actors started beside a worker group, with torch, DeepSpeed and the stage's trainer
already imported, that a group replacing lost or hung ranks takes as its ranks (`SparePool.take`). On a CPU a new
rank spends about 5 s of its 6 s start in its process start and these imports; a spare skips them.

Spares hold no resources of the cluster (0 CPUs: they idle until taken) and live on the ranks' nodes: one takes a
rank's place only where the new group's bundle for that rank is (never on a node the group holds nothing on, such
as a head node kept free of work). They warm up at nice 19, after a commit once the group is SPARES_AFTER_S old
(idle time counts): a spare costs about 5 s of CPU, which a short run would not win back. Only a spare whose
warm-up has finished is taken. GPU ranks get none by default: a spare would have to hold a GPU of its own, idle;
their replacement starts cold in the lost rank's freed bundle. On a running cluster spares outlive the command like
its ranks (`rlhf_core.driver.lingering`): one not taken by the end serves the next command.
docs/design-notes.md ("Replacing a lost rank") has the rest.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlhf_core.config import RunConfig
from rlhf_core.driver.engine import rank_actor
from rlhf_core.driver.lingering import lingers, retire_ranks
from rlhf_core.driver.placement import placement_bundle

logger = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 2.0
SPARES_AFTER_S = 30.0  # a group's age (since it started, idle time too) before its spares start (module docstring)


def num_spares(run: RunConfig, world_size: int) -> int:
    """`--num_spare_workers`, by default as many as the group's ranks when they use no GPU, else none."""
    if run.num_spare_workers is not None:
        return run.num_spare_workers
    return 0 if placement_bundle(run).get("GPU", 0) else world_size


class SparePool:
    """Warm rank actors not yet part of any group, each with its node and the reference to its warm-up (done
    when ready)."""

    def __init__(self) -> None:
        self._spares: list[tuple[ActorHandle, str, ray.ObjectRef]] = []
        self._outlive = False  # whether they were started to outlive the command (`fill`)

    def __len__(self) -> int:
        return len(self._spares)

    def num_ready(self) -> int:
        """How many spares have finished their warm-up (a bench waits for them before it kills a rank)."""
        refs = [ready for _, _, ready in self._spares]
        return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else 0

    def fill(self, run: RunConfig, stage: str, count: int, node_ids: list[str]) -> None:
        """Start spares, without waiting, until there are `count`, on the nodes `node_ids` (the group's ranks',
        in turn): a spare takes a rank's place only on a node where the group holds that rank's bundle."""
        self._outlive = lingers(run)  # then a spare not taken by the end serves the next command (driver/lingering.py)
        for index in range(len(self._spares), count):
            node_id = node_ids[index % len(node_ids)]
            spare = rank_actor(run, -1, 0, outlive_on=node_id) if self._outlive else \
                rank_actor(run, -1, 0, num_cpus=0, num_gpus=0,
                           scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
            self._spares.append((spare, node_id, spare.warm_spare.remote(run, stage)))

    def take(self, bundle_nodes: list[str]) -> dict[int, ActorHandle]:
        """For each rank whose bundle is on `bundle_nodes[rank]`, a spare on that node whose warm-up has finished
        (by rank); a spare whose warm-up failed (its process died) is dropped."""
        refs = [ready for _, _, ready in self._spares]
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        wanted = dict(enumerate(bundle_nodes))
        taken: dict[int, ActorHandle] = {}
        kept: list[tuple[ActorHandle, str, ray.ObjectRef]] = []
        for spare, node_id, ready in self._spares:
            rank = next((rank for rank, node in wanted.items() if node == node_id), None)
            if ready not in done or rank is None:
                kept.append((spare, node_id, ready))
                continue
            try:
                ray.get(ready, timeout=1.0)
            except Exception:  # noqa: BLE001 - a spare that failed its warm-up is no spare
                logger.info("a spare rank failed its warm-up; dropped", exc_info=True)
                with contextlib.suppress(Exception):
                    ray.kill(spare)
                continue
            taken[rank] = spare
            del wanted[rank]
        self._spares = kept
        return taken

    def close(self, retire: bool = False) -> None:
        """Kill the spares, waiting at most CLOSE_TIMEOUT_S: after a SIGTERM to the whole process group Ray's GCS
        may be gone, and `ray.kill` would wait for it (leaving the process ends them anyway). `retire`: after a
        clean end, those that may outlive the command and finished their warm-up stay for the next one."""
        spares, self._spares = self._spares, []
        if not spares:
            return
        if retire and self._outlive:
            done = set(ray.wait([ready for _, _, ready in spares], num_returns=len(spares), timeout=0)[0])
            retire_ranks([spare for spare, _, ready in spares if ready in done])
            spares = [entry for entry in spares if entry[2] not in done]

        def kill() -> None:
            for spare, _, _ in spares:
                with contextlib.suppress(Exception):
                    ray.kill(spare)

        killing = threading.Thread(target=kill, name="rlhf-kill-spares", daemon=True)
        killing.start()
        killing.join(CLOSE_TIMEOUT_S)

