"""Snapshots between commits on several nodes (`rlhf_core.storage.interim_copies`, `InterimHoldings`): each rank's
snapshot is copied to the next node's keeper, so after a node is lost every rank's snapshot is still whole on a
live node; a new rank loads it from its own node or through the keeper of the node holding it; a copy cut short is
never used; and K covers the copy's time. The keepers here are plain objects (`ray.get` passes values through);
the same on a real multi-node Ray cluster, a node killed mid-chunk, is in
tests/integration/test_ray_cluster.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import ray
import torch

from rlhf_core.driver.interim import InterimHoldings
from rlhf_core.rank.interim import InterimSnapshots
from rlhf_core.storage import interim_copies
from rlhf_core.storage.interim import InterimPlan, holdings, node_folder
from rlhf_core.storage.interim_copies import NodeSnapshots
from tests.unit.test_interim_snapshots import FakeEngine

PLAN = InterimPlan("key", 1, 2, "host", 1)


def shard_name(rank: int) -> str:
    return f"actor_model/ds/bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def take(interim: InterimSnapshots, step: int, value: float) -> None:
    """A snapshot of `interim`'s rank: its ZeRO shard (what only that rank reads), and the recovery script every
    rank writes."""
    engine = FakeEngine(torch.full((4,), value))

    def save(folder: str) -> None:
        os.makedirs(os.path.join(folder, "actor_model", "ds"), exist_ok=True)
        engine.checkpoint_engine.save({"w": engine.weight}, os.path.join(folder, shard_name(interim.rank)))
        Path(folder, "actor_model", "ds", "zero_to_fp32.py").write_text("# recovery script\n")

    interim.take(step, [engine], save, [])


class Keeper:
    """A NodeSnapshots as a rank and the driver call it (`keeper.method.remote(...)`), without Ray."""

    def __init__(self, node: str):
        self.node, self.served = node, NodeSnapshots(PLAN.folder_name, node, PLAN.world_size)

    def __getattr__(self, name):
        method = getattr(self.served, name)
        return type("Remote", (), {"remote": staticmethod(method)})


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    """Two nodes' keepers under one tmpfs root, and `ray.get` as the identity (the keepers answer at once)."""
    monkeypatch.setattr(interim_copies, "interim_root", lambda: str(tmp_path))
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    return {node: Keeper(node) for node in ("node-a", "node-b")}


def rank_on(tmp_path: Path, rank: int, node: str, copy_to=None) -> InterimSnapshots:
    import dataclasses

    plan = dataclasses.replace(PLAN, copy_to=copy_to)
    return InterimSnapshots(plan, rank, node_folder(plan, node, root=str(tmp_path)))


class LoadingTrainer:
    """What `InterimSnapshots.load` asks of a trainer: load a folder as a commit's; keeps what it read."""

    def __init__(self):
        self.read: dict[str, torch.Tensor] = {}

    def load(self, folder: str, universal: bool, weights_only: bool) -> int:
        for parent, _, names in os.walk(folder):
            for name in names:
                path = os.path.join(parent, name)
                if path.endswith(".pt"):
                    self.read[os.path.relpath(path, folder)] = torch.load(path, weights_only=True)["w"]
        return 4


def two_nodes_trained(tmp_path: Path, nodes: dict) -> None:
    """Rank 0 on node a and rank 1 on node b take steps 3 and 4, each copying to the other node."""
    ranks = [rank_on(tmp_path, 0, "node-a", nodes["node-b"]), rank_on(tmp_path, 1, "node-b", nodes["node-a"])]
    for step in (3, 4):
        for rank, interim in enumerate(ranks):
            take(interim, step, 10.0 * step + rank)
    for interim in ranks:
        interim._wait_for_copy()
        assert interim.copy_seconds > 0


def test_after_a_node_is_lost_every_ranks_snapshot_loads_from_the_peer_that_kept_it(tmp_path, nodes):
    two_nodes_trained(tmp_path, nodes)
    shutil.rmtree(node_folder(PLAN, "node-b", root=str(tmp_path)))  # node b is gone, with rank 1's own slots
    held = InterimHoldings(PLAN, {"node-a": holdings(node_folder(PLAN, "node-a", root=str(tmp_path)), 2)})
    assert held.steps() == [3, 4]
    assert all(keeper is None for _, keeper in held.sources(4, "node-a").values())  # both on node a

    trainer = LoadingTrainer()  # the new rank 1, placed on node a
    assert rank_on(tmp_path, 1, "node-a").load(4, trainer, held.sources(4, "node-a")) == 4
    assert trainer.read.keys() == {shard_name(1)} and trainer.read[shard_name(1)].equal(torch.full((4,), 41.0))

    held.keepers["node-a"] = nodes["node-a"]  # a new rank on a new node reads through node a's keeper
    sources = held.sources(4, "node-c")
    assert {rank: keeper for rank, (_, keeper) in sources.items()} == {0: nodes["node-a"], 1: nodes["node-a"]}
    trainer = LoadingTrainer()
    rank_on(tmp_path, 1, "node-c").load(4, trainer, sources)
    assert trainer.read.keys() == {shard_name(1)} and trainer.read[shard_name(1)].equal(torch.full((4,), 41.0))
    assert not os.path.exists(node_folder(PLAN, "node-c", root=str(tmp_path)) + "/slot_0/rank1.json")


def test_without_copies_a_lost_nodes_ranks_have_no_snapshot(tmp_path, nodes):
    """What the copies add: the same two ranks without them leave node a with rank 0's snapshots only."""
    ranks = [rank_on(tmp_path, 0, "node-a"), rank_on(tmp_path, 1, "node-b")]
    for step in (3, 4):
        for rank, interim in enumerate(ranks):
            take(interim, step, 10.0 * step + rank)
    held = InterimHoldings(PLAN, {"node-a": holdings(node_folder(PLAN, "node-a", root=str(tmp_path)), 2)})
    assert held.steps() == []


def test_a_copy_cut_short_is_never_used_and_a_new_group_forgets_past_its_start(tmp_path, nodes):
    two_nodes_trained(tmp_path, nodes)
    folder_a = node_folder(PLAN, "node-a", root=str(tmp_path))
    newest_copy = next(path for path in Path(folder_a).glob("slot_*/rank1.json") if '"step": 4' in path.read_text())
    with open(newest_copy.parent / (shard_name(1) + ".bin"), "r+b") as handle:
        handle.truncate(1)  # the copy's bytes cut short: its marker names another size
    assert {rank: sorted(steps) for rank, steps in holdings(folder_a, 2).items()} == {0: [3, 4], 1: [3]}
    assert InterimHoldings(PLAN, {"node-a": holdings(folder_a, 2)}).steps() == [3]

    nodes["node-a"].forget_after.remote(3)  # a new group starts from step 3
    assert {rank: sorted(steps) for rank, steps in holdings(folder_a, 2).items()} == {0: [3], 1: [3]}


def test_k_covers_the_copy_to_the_peer(tmp_path, nodes):
    interim = rank_on(tmp_path, 0, "node-a", nodes["node-b"])
    interim.plan = InterimPlan("key", 0, 2, "host", 1, nodes["node-b"])  # K chosen by the run
    for _ in range(4):
        interim.step_done(1.0)
    interim.copy_seconds, interim.stall_seconds = 3.5, 0.01
    interim._choose_interval()
    assert interim.interval == 4  # the copy takes 3.5 steps: one every 4 keeps up
