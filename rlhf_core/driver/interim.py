"""The driver's side of the snapshots between commits (`rlhf_core.rank.interim`): which group takes them, under
which key, where a group on several nodes keeps its copies (`peer_keepers`: a keeper on each node, the ring's next
node for each), which snapshot a new group can start from (`InterimHoldings`), and what it carries into its chunk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

from rlhf_core.config import RunConfig
from rlhf_core.storage.interim import NUM_SLOTS, STALL_BUDGET, InterimPlan
from rlhf_core.stages.base import StageConfig

logger = logging.getLogger(__name__)

# How long a keeper may take to say what its node holds, or to forget: a node lost but not yet marked dead by Ray
# (it takes ~5-30 s) never answers, and the new group goes on without it.
KEEPER_ANSWER_S = 5.0


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
            "share of the DeepSpeed state (a group on several nodes keeps a copy of each on the next node too)")


def keeper_name(plan: InterimPlan, node_id: str) -> str:
    return f"{plan.folder_name}-{node_id}"


def peer_keepers(plan: InterimPlan, nodes: list[str]) -> dict[str, Any]:
    """For a group whose ranks are on `nodes` (by rank): each node's keeper of copies (a `NodeSnapshots` actor the
    driver owns, started once per node and group shape), mapped from the node before it in the ring of the group's
    nodes. Empty on one node: a copy on the same node survives nothing the slots do not."""
    ring = list(dict.fromkeys(nodes))
    if len(ring) < 2:
        return {}
    keepers = {node: keeper_on(plan, node) for node in ring}
    return {node: keepers[ring[(index + 1) % len(ring)]] for index, node in enumerate(ring)}


def keeper_on(plan: InterimPlan, node: str) -> Any:
    """The keeper of `plan`'s snapshots on `node`: the one there, else a new one (the driver owns it)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlhf_core.storage.interim_copies import NodeSnapshots

    # several ranks' copies at once; ray's typed overloads of remote() omit max_concurrency, an actor option it takes
    remote = ray.remote(num_cpus=0, max_concurrency=4)(NodeSnapshots)  # type: ignore[call-overload]
    return remote.options(name=keeper_name(plan, node), get_if_exists=True,
                          scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                          ).remote(plan.folder_name, node, plan.world_size)


def rank_plans(plan: InterimPlan | None, nodes: list[str]) -> list[InterimPlan | None]:
    """The plan each rank gets (`nodes`: each rank's node): with the keeper its copies go to."""
    copy_to = peer_keepers(plan, nodes) if plan is not None else {}
    return [plan if plan is None else dataclasses.replace(plan, copy_to=copy_to.get(node)) for node in nodes]


@dataclass
class InterimHoldings:
    """Which node holds which rank's snapshot of which step, for a new group of `plan`'s shape: what its own ranks'
    nodes hold, and, for a rank held on none of them, what the keepers on the cluster's other live nodes hold."""

    plan: InterimPlan
    held: dict[str, dict[int, dict[int, dict]]] = field(default_factory=dict)  # node -> rank -> step -> marker
    keepers: dict[str, Any] = field(default_factory=dict)  # node -> its keeper, for the nodes asked through one

    @classmethod
    def gather(cls, plan: InterimPlan, ask_ranks: Callable[[], list[tuple[str, dict]]]) -> InterimHoldings:
        """`ask_ranks()`: each new rank's (node, what its node holds)."""
        holdings = cls(plan, dict(ask_ranks()))
        if not holdings.steps():
            holdings._ask_keepers()
        return holdings

    def _ask_keepers(self) -> None:
        import ray

        asked = {node: keeper for node, keeper in existing_keepers(self.plan, live_nodes()).items()
                 if node not in self.held}
        answers: dict[str, Any] = {node: keeper.holdings.remote() for node, keeper in asked.items()}
        for node, answer in answers.items():
            try:
                self.held[node] = ray.get(answer, timeout=KEEPER_ANSWER_S)
                self.keepers[node] = asked[node]
            except Exception as error:  # noqa: BLE001 - a keeper lost with its node holds nothing usable
                logger.info("the snapshots kept on node %s are out of reach (%s)", node, type(error).__name__)

    def steps(self) -> list[int]:
        """The steps of which every rank's snapshot is whole on some node, oldest first."""
        per_rank = [{step for ranks in self.held.values() for step in ranks.get(rank, {})}
                    for rank in range(self.plan.world_size)]
        return sorted(set.intersection(*per_rank)) if per_rank else []

    def sources(self, step: int, node: str) -> dict[int, tuple[dict, Any]]:
        """For a rank on `node` loading `step`: each rank's (marker, keeper to read it through; None on `node`
        itself)."""
        found = {}
        for rank in range(self.plan.world_size):
            if step in self.held.get(node, {}).get(rank, {}):
                found[rank] = (self.held[node][rank][step], None)
            else:
                holder = next(holder for holder, ranks in self.held.items() if step in ranks.get(rank, {}))
                if holder not in self.keepers:  # a node of the new group: its keeper serves the others
                    self.keepers[holder] = keeper_on(self.plan, holder)
                found[rank] = (self.held[holder][rank][step], self.keepers[holder])
        return found

    def forget_after(self, step: int) -> None:
        """The keepers on the nodes that held anything forget what the failed group wrote past `step` there (each
        new rank forgets its own slots' too)."""
        import ray

        unasked = [node for node in self.held if node not in self.keepers]
        self.keepers = existing_keepers(self.plan, unasked) | self.keepers
        with contextlib.suppress(Exception):
            ray.get([keeper.forget_after.remote(step) for keeper in self.keepers.values()], timeout=KEEPER_ANSWER_S)


def drop_keepers(plan: InterimPlan | None) -> None:
    """At a clean end: every live node's keeper of `plan` removes its node's snapshots and ends."""
    import ray

    if plan is None:
        return
    keepers = list(existing_keepers(plan, live_nodes()).values())
    with contextlib.suppress(Exception):
        ray.get([keeper.drop.remote() for keeper in keepers], timeout=KEEPER_ANSWER_S)
    for keeper in keepers:
        ray.kill(keeper)


def live_nodes() -> list[str]:
    import ray

    return [node["NodeID"] for node in ray.nodes() if node["Alive"]]


def existing_keepers(plan: InterimPlan, nodes: list[str]) -> dict[str, Any]:
    """The keepers of `plan` already started on `nodes` (none is started here), by node."""
    import ray

    found = {}
    for node in nodes:
        with contextlib.suppress(ValueError):  # no keeper there
            found[node] = ray.get_actor(keeper_name(plan, node))
    return found
