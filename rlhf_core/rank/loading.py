"""A rank's read of a committed checkpoint: the files it needs (`files_for_rank`), verified against the manifest
as they are read (`load_verified`): in place on a local store while they are hashed, else fetched (hashed as they
arrive) into a temporary folder first. docs/design-notes.md ("Safe checkpoint loading") has why.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf_core.rank.trainers.base import DeepSpeedTrainer
    from rlhf_core.storage.checkpoint import CheckpointStore

# DeepSpeed's per-rank shard files: ZeRO optimizer partitions (and ZeRO-3 weight partitions).
_RANK_SHARD = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_")


def load_verified(trainer: DeepSpeedTrainer, rank: int, store: CheckpointStore, step: int, universal: bool,
                  weights_only: bool) -> int:
    """Load committed `step` of `store` into `trainer` (this rank's files only, unless all shards are needed),
    verified as the files are read; returns the step loaded."""
    from rlhf_core.rank.ds_config import convert_to_universal
    from rlhf_core.storage.safe_load import check_no_pickled_code

    # The universal converter, and ZeRO-3's module-only load, read every rank's shard (with a plain
    # unpickler), so they get all files and a scan first; otherwise DeepSpeed's own reads are the scan.
    reads_all_shards = universal or (weights_only and trainer.cfg.zero_stage == 3)
    select = lambda paths: files_for_rank(paths, rank, reads_all_shards)  # noqa: E731
    if not reads_all_shards:  # both of those write into the folder they read: they get a copy
        # DeepSpeed loads while the files are hashed; a mismatch raises CorruptCheckpoint at the end of
        # the block, and the driver then loads an older checkpoint over whatever this load set.
        with store.read_in_place(step, select) as in_place:
            if in_place is not None:
                return trainer.load(in_place, False, weights_only)
    local_dir = tempfile.mkdtemp(prefix=f"rlhf-load-rank{rank}-")
    try:
        store.fetch(step, local_dir, select)
        if reads_all_shards:
            check_no_pickled_code(local_dir)
        universal = universal and convert_to_universal(local_dir)
        return trainer.load(local_dir, universal, weights_only)
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)


def files_for_rank(paths: list[str], rank: int, all_shards: bool) -> list[str]:
    """The checkpoint files one rank reads: the shared ones and its own ZeRO shards (every shard with
    `all_shards`), and the Hugging Face copies only when there is no DeepSpeed state to read instead."""
    has_deepspeed_state = any("/ds/" in path for path in paths)
    chosen = []
    for path in paths:
        if has_deepspeed_state and "/hf/" in path:
            continue
        shard = _RANK_SHARD.search(path)
        if shard is None or all_shards or int(shard.group(1)) == rank:
            chosen.append(path)
    return chosen
