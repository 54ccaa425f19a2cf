"""One node's keeper of the snapshots between commits of a group on several nodes (`rlhf_core.storage.interim`):
a Ray actor the driver places on each of the group's nodes and owns, so it outlives every rank. Each rank sends a
copy of each snapshot it takes to the keeper of the next node of the group's ring, which writes it into its
node's tmpfs; after a lost node, the new group finds every rank's snapshot on some node still alive and reads the
ones not on its own node through that node's keeper. Not in OpenRLHF; Gemini (SOSP '23) keeps checkpoints in
peers' memory the same way.
"""

from __future__ import annotations

import os
import shutil

from rlhf_core.storage.interim import (forget_after, holdings, interim_root, read_slot, store_copy)


class NodeSnapshots:
    """The snapshots of one group shape (`folder_name`, an `InterimPlan`'s) held on one node (`node_id`)."""

    def __init__(self, folder_name: str, node_id: str, world_size: int):
        self.folder = os.path.join(interim_root(), folder_name, node_id)
        self.world_size = world_size

    def store(self, rank: int, marker: dict, files: dict[str, bytes]) -> None:
        """A copy of `rank`'s snapshot, sent by that rank from its own node."""
        store_copy(self.folder, rank, marker, files)

    def holdings(self) -> dict[int, dict[int, dict]]:
        """Per rank, the steps this node holds whole for it, with their markers."""
        return holdings(self.folder, self.world_size)

    def read(self, rank: int, step: int, names: list[str]) -> dict[str, bytes]:
        """The files `names` of `rank`'s snapshot of `step`, for a rank on another node to load."""
        return read_slot(self.folder, rank, step, names)[1]

    def forget_after(self, step: int) -> None:
        """A new group starts from `step`: every rank's snapshots past it here are forgotten."""
        for rank in range(self.world_size):
            forget_after(self.folder, rank, step)

    def drop(self) -> None:
        """The command ended cleanly: this node's snapshots of the group shape go."""
        shutil.rmtree(os.path.dirname(self.folder), ignore_errors=True)
