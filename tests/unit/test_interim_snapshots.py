"""Snapshots between commits (`rlhf_core.storage.interim`, `rlhf_core.rank.interim`, `rlhf_core.driver.interim`, `resume.restore_interim`): a
step counts only once every rank finished it whole and rebuilds as written, each rank keeps at most two, a new
group forgets what its failed predecessor wrote past its start, the interval keeps the stall within its budget, a dead driver's folders go, and the driver
falls back to the commit when no newer whole snapshot is there. The bit-exact restores on real ranks are in
tests/integration (test_chunk_retry: 2 ranks ZeRO-2; test_hang: 1 rank; test_zero3: 2 ranks ZeRO-3)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_core.config import RunConfig
from rlhf_core.driver.interim import InterimStart, interim_plan
from rlhf_core.driver.resume import Lineage, StageCheckpoints, restore_interim
from rlhf_core.rank.interim import InterimSnapshots
from rlhf_core.storage.interim import (STALL_BUDGET, InterimPlan, materialize, node_folder, recorded,
                                       remove_for_driver, remove_orphans, whole_at, whole_steps)
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.storage.manifest import STATUS_COMMITTED, CheckpointInfo

STATE_FILE = "actor_model/ds/mp_rank_00_model_states.pt"


class FakeEngine:
    """What `tensors_kept_in_memory` needs of a DeepSpeed engine: a checkpoint engine it can swap."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.checkpoint_engine = weight, None


def save_like_deepspeed(engine: FakeEngine, rank: int):
    """A `save_state`: the rank's state dict through the checkpoint engine, and a small file written directly
    (DeepSpeed's recovery script)."""
    def save(folder: str) -> None:
        os.makedirs(os.path.join(folder, "actor_model", "ds"), exist_ok=True)
        state = {"w": engine.weight, "empty": torch.empty(0, dtype=torch.bfloat16), "step": 3}  # ZeRO-3 has empty ones
        engine.checkpoint_engine.save(state, os.path.join(folder, STATE_FILE.replace("00", f"0{rank}")))
        Path(folder, "actor_model", "ds", "zero_to_fp32.py").write_text("# recovery script\n")
    return save


def snapshots(tmp_path: Path, rank: int = 0, world_size: int = 1, every_steps: int = 1) -> InterimSnapshots:
    plan = InterimPlan("key", every_steps, world_size, "host", 1)
    return InterimSnapshots(plan, rank, node_folder(plan, "node", root=str(tmp_path)))


def take(interim: InterimSnapshots, step: int, value: float, rank: int = 0, metrics=None) -> None:
    engine = FakeEngine(torch.full((4,), value))
    interim.take(step, [engine], save_like_deepspeed(engine, rank), metrics or [])


def rebuilt_weight(folder: str, step: int, world_size: int, rank: int, into: Path) -> torch.Tensor:
    """The state file `rank` wrote at `step`, rebuilt as DeepSpeed reads it."""
    name = STATE_FILE.replace("00", f"0{rank}")
    materialize(whole_at(folder, step, world_size), str(into), lambda paths: [path for path in paths if path == name])
    assert sorted(str(path.relative_to(into)) for path in into.rglob("*") if path.is_file()) == [name]
    state = torch.load(into / name, weights_only=True)
    assert state["step"] == 3 and state["empty"].dtype == torch.bfloat16 and state["empty"].shape == (0,)
    return state["w"]


def test_a_step_is_whole_once_every_rank_wrote_it_and_each_rank_keeps_two(tmp_path):
    rank0, rank1 = snapshots(tmp_path, 0, world_size=2), snapshots(tmp_path, 1, world_size=2)
    take(rank0, 3, 3.0, metrics=[{"loss": 1.5}])
    assert whole_steps(rank0.folder, 2) == []  # rank 1 has not finished step 3
    take(rank1, 3, 3.0, rank=1)
    assert whole_steps(rank0.folder, 2) == [3]
    assert recorded(whole_at(rank0.folder, 3, 2)[0][1]) == ([{"loss": 1.5}], 1)
    assert rebuilt_weight(rank0.folder, 3, 2, 1, tmp_path / "rebuilt-3").equal(torch.full((4,), 3.0))

    for step in (4, 5):
        take(rank0, step, float(step))
        take(rank1, step, float(step), rank=1)
    assert whole_steps(rank0.folder, 2) == [4, 5]  # step 3's slot now holds step 5: two each, no more
    assert sorted(os.listdir(rank0.folder)) == ["slot_0", "slot_1"]
    assert rebuilt_weight(rank0.folder, 5, 2, 0, tmp_path / "rebuilt-5").equal(torch.full((4,), 5.0))
    assert rebuilt_weight(rank0.folder, 4, 2, 1, tmp_path / "rebuilt-4").equal(torch.full((4,), 4.0))

    # rank 0 dies while it copies step 6 over its step-4 slot (its marker removed first); rank 1 finishes step 6
    slots = {json.loads((slot / "rank0.json").read_text())["step"]: slot for slot in Path(rank0.folder).iterdir()}
    (slots[4] / "rank0.json").unlink()
    take(rank1, 6, 6.0, rank=1)
    assert whole_steps(rank0.folder, 2) == [5]  # step 6 lacks rank 0; step 4 is gone
    # a file cut short makes its step unusable too
    with open(slots[5] / (STATE_FILE.replace("00", "01") + ".bin"), "r+b") as handle:
        handle.truncate(10)
    assert whole_steps(rank0.folder, 2) == []


def test_a_new_group_forgets_what_the_failed_one_wrote_past_its_start(tmp_path):
    failed = snapshots(tmp_path)
    for step in (6, 7):
        take(failed, step, float(step))
    replacement = snapshots(tmp_path)  # a new process for the same rank of the same command
    replacement.restore_from(6)
    assert whole_steps(replacement.folder, 1) == [6]
    assert not replacement.due(6) and replacement.due(7)  # nothing again of the step it starts from
    take(replacement, 7, 70.0)  # into the slot step 7 of the failed group was in, not over step 6
    assert whole_steps(replacement.folder, 1) == [6, 7]
    assert rebuilt_weight(replacement.folder, 7, 1, 0, tmp_path / "rebuilt").equal(torch.full((4,), 70.0))


def test_the_interval_keeps_the_stall_within_its_budget_unless_the_run_sets_it(tmp_path):
    chosen = snapshots(tmp_path, every_steps=0)
    for _ in range(5):
        chosen.step_done(1e-6)  # steps far shorter than any copy
    take(chosen, 1, 1.0)
    expected = math.ceil(chosen.stall_seconds / (STALL_BUDGET * 1e-6))
    assert chosen.interval == expected > 1 and not chosen.due(chosen.interval) and chosen.due(1 + chosen.interval)
    for _ in range(8):
        chosen.step_done(3600.0)  # the median of the last 16 steps
    take(chosen, 1 + chosen.interval, 2.0)
    assert chosen.interval == 1  # a step 20 times the stall or longer: every step

    fixed = snapshots(tmp_path / "fixed", every_steps=4)
    fixed.step_done(1e-6)
    take(fixed, 4, 1.0)
    assert fixed.interval == 4 and not fixed.due(7) and fixed.due(8)


def test_a_dead_drivers_folders_on_this_host_go_and_others_stay(tmp_path):
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folders = {name: tmp_path / f"rlhf-interim-{name}" for name in
               (f"{host}-{dead.stdout.strip()}-k1", f"{host}-{os.getpid()}-k2", f"elsewhere-{dead.stdout.strip()}-k3")}
    for folder in folders.values():
        (folder / "node" / "step_1").mkdir(parents=True)
    assert remove_orphans(str(tmp_path)) == [str(folders[f"{host}-{dead.stdout.strip()}-k1"])]
    remove_for_driver(str(tmp_path))  # this process's own, at its command's end
    assert [path.name for path in tmp_path.iterdir()] == [f"rlhf-interim-elsewhere-{dead.stdout.strip()}-k3"]


def make_run(tmp_path, **overrides) -> RunConfig:
    return RunConfig(sft=SFTConfig(pretrain="m", dataset="d.jsonl"), ckpt_path=str(tmp_path / "ckpt"), **overrides)


def test_each_command_group_shape_has_its_own_key_and_the_flag_turns_them_off(tmp_path):
    run = make_run(tmp_path)
    plan = interim_plan(run, "sft", "token", 2, 2)
    assert plan is not None and plan.every_steps == 0 and plan.world_size == 2 and plan.driver_pid == os.getpid()
    others = [interim_plan(run, "sft", "other-command", 2, 2), interim_plan(run, "sft", "token", 1, 2),
              interim_plan(run, "sft", "token", 2, 3)]
    assert len({plan.key, *(other.key for other in others if other)}) == 4
    assert interim_plan(make_run(tmp_path, snapshot_steps=-1), "sft", "token", 2, 2) is None
    no_state = make_run(tmp_path).model_copy(update={"sft": SFTConfig(pretrain="m", dataset="d.jsonl",
                                                                       disable_ds_ckpt=True)})
    assert interim_plan(no_state, "sft", "token", 2, 2) is None
    assert interim_plan(run, "sft", "", 2, 2) is None  # a group no runner gave a token


class FakeGroup:
    """The WorkerGroup calls `restore_interim` makes, with the snapshots every rank holds."""

    world_size = 1

    def __init__(self, held: list[int], fails: bool = False):
        self.held, self.fails, self.calls = held, fails, []

    def interim_steps(self, run, stage, saved_zero_stage):
        return self.held

    def setup(self, run, stage, chunk_ends, saved_zero_stage=None):
        self.calls.append("setup")

    def load_interim(self, step, base_step):
        self.calls.append(("load", step, base_step))
        if self.fails:
            raise RuntimeError("torch.load: truncated file")
        self.restored = InterimStart(step, base_step, [], 1)


class NoCommitsStore:
    def verified_training_metadata(self, step):  # pragma: no cover - no commit to read
        raise AssertionError("no commit to read")


@pytest.mark.parametrize("held, loaded", [([3, 4], 4), ([], None)])
def test_before_the_first_commit_the_newest_whole_snapshot_is_loaded(tmp_path, held, loaded):
    group = FakeGroup(held)
    restored, base = restore_interim(make_run(tmp_path), "sft", StageCheckpoints(NoCommitsStore(), [], Lineage()),
                                     group, [5, 10], below=5)
    assert (restored, base) == (loaded is not None, None)
    assert group.calls == ([] if loaded is None else ["setup", ("load", loaded, 0)])


class OneCommitStore:
    def verified_training_metadata(self, step):
        from rlhf_core.storage.metadata import CheckpointMetadata

        return CheckpointMetadata(stage="sft", step=step, total_steps=10, world_size=1, zero_stage=2)


COMMIT_5 = CheckpointInfo(5, "step_5", "file:///ckpt/step_5", STATUS_COMMITTED, 1)


@pytest.mark.parametrize("held, fails, loaded", [([4, 6, 7], False, 7), ([3, 4], False, None), ([7], True, None),
                                                 ([6, 7, 11, 12], False, 7)])
def test_only_a_snapshot_between_the_commit_and_the_target_is_used_and_a_bad_one_falls_back(tmp_path, held, fails,
                                                                                               loaded):
    """Above the commit (5) and below the chunk's target (10): steps 11 and 12 were trained ahead, into the next
    chunk, while step 10's commit was written (a group there would stand past its target)."""
    group = FakeGroup(held, fails)
    restored, base = restore_interim(make_run(tmp_path), "sft", StageCheckpoints(OneCommitStore(), [COMMIT_5],
                                                                                  Lineage()), group, [5, 10], below=10)
    assert restored == (loaded is not None)
    assert (base.info.step if base is not None else None) == (5 if loaded else None)
    usable = [step for step in held if 5 < step < 10]
    if usable:
        assert group.calls == ["setup", ("load", usable[-1], 5)]
    else:
        assert group.calls == []  # asked before any set-up: the commit's load sets the group up once


def test_a_new_group_lost_while_it_loads_a_snapshot_is_a_loss_not_a_bad_snapshot(tmp_path):
    from rlhf_core.errors import WorkerLost

    class LostGroup(FakeGroup):
        def load_interim(self, step, base_step):
            raise WorkerLost("rank 0 on node 10.0.0.5 was lost")

    with pytest.raises(WorkerLost):
        restore_interim(make_run(tmp_path), "sft", StageCheckpoints(OneCommitStore(), [COMMIT_5], Lineage()),
                        LostGroup([7]), [5, 10], below=10)



def test_a_full_tmpfs_stops_the_snapshots_with_one_warning_and_leaves_the_older_one(tmp_path, monkeypatch, caplog):
    """tmpfs full: the space is reserved before any page is written (a write through the mapping would be a SIGBUS,
    killing the rank), the refusal is one warning, and no rank takes another (they agree on each one)."""
    import errno

    from rlhf_core.storage import interim as slots

    interim = snapshots(tmp_path)
    take(interim, 1, 1.0)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(slots.os, "posix_fallocate", full)
    take(interim, 2, 3.0)
    take(interim, 3, 3.0)
    assert interim.refused and not interim.due(10)
    assert whole_steps(interim.folder, 1) == [1]
    refusals = [record.message for record in caplog.records if "takes no more snapshots" in record.message]
    assert len(refusals) == 1 and "No space left on device" in refusals[0] and "--snapshot_steps -1" in refusals[0]
