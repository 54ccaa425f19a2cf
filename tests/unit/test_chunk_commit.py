"""The commit at a chunk boundary (rlhf_core.driver.chunk_commit.commit_chunk), driven with a stand-in worker group and
a real local store: the ranks stand idle only for their snapshot, which refuses non-finite weights first."""

from __future__ import annotations

import pytest

from rlhf_core.driver.chunk_commit import ChunkState, Trained, commit_chunk
from rlhf_core.driver.plan import plan_stage
from rlhf_core.driver.runner import StageRunner
from rlhf_core.errors import StoreFull
from rlhf_core.ops.alerts import NonFiniteTraining
from rlhf_core.ops.commit_alerts import ModelSize
from rlhf_core.storage.checkpoint import CheckpointStore
from tests.unit.test_chunk_planning import toy_run


class RecordingGroup:
    """A worker group at `step` whose one rank's snapshot is `folder`; records the driver's calls in order."""

    def __init__(self, folder, step: int, non_finite: list[str] | None = None):
        self.folder, self.step, self.non_finite = str(folder), step, non_finite or []
        self.world_size, self.zero_stage, self.write_seconds, self.calls = 1, 0, {}, []

    def snapshot(self):
        self.calls.append("snapshot")
        return ([] if self.non_finite else [self.folder]), self.non_finite

    def train_ahead(self, target_step: int) -> None:
        self.calls.append(f"train_ahead:{target_step}")

    def model_sizes(self) -> dict:  # a 1M-parameter fp32 model: a checkpoint of about 16 MB
        return {"on_gpu": False, "models": {"actor_model": ModelSize(10**6, 10**6, 4).to_dict()}}

    def start_write(self, folders, store_url, storage_options, pending):
        self.calls.append("start_write")
        return [CheckpointStore(store_url, storage_options).upload_tree(pending, folder) for folder in folders]

    def finish_write(self, writes):
        return [entry for entries in writes for entry in entries]

    def drop_snapshots(self, folders) -> None:
        self.calls.append(f"drop:{len(folders)}")


@pytest.fixture
def boundary(toy_assets, tmp_path, monkeypatch):
    """(run, plan, store, group at step 5 with a one-file snapshot); the store's prepare_step is recorded too."""
    run = toy_run(toy_assets, ckpt_path=str(tmp_path / "ckpt"), run_name="boundary", sft={"save_steps": 5})
    plan, store = plan_stage(run, "sft"), CheckpointStore(run.stage_url("sft"))
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "weights.bin").write_bytes(b"w" * 1000)
    group = RecordingGroup(snapshot, step=5)
    prepare_step = store.prepare_step
    monkeypatch.setattr(store, "prepare_step", lambda step: group.calls.append("prepare_step") or prepare_step(step))
    return run, plan, store, group


def commit(boundary, train_ahead: bool = True):
    run, plan, store, group = boundary
    with StageRunner(run) as runner:
        state = ChunkState(runner, "sft", group.step, plan, runner.identity("sft"), store)
        return commit_chunk(state, Trained(group, store.list(), 0, [{"loss": 0.5}], None, train_ahead))


def test_the_ranks_train_ahead_straight_after_their_snapshot_and_the_step_commits(boundary):
    outcome = commit(boundary)
    _, _, store, group = boundary
    assert group.calls == ["snapshot", "train_ahead:10", "prepare_step", "start_write"]
    assert outcome.info.step == 5
    assert [(known.step, known.status) for known in store.list(verify=True)] == [(5, "committed")]
    assert outcome.ahead_since is not None and {"stall", "commit"} <= outcome.seconds.keys()


def test_without_training_ahead_the_ranks_wait_for_the_commit(boundary):
    outcome = commit(boundary, train_ahead=False)
    assert boundary[3].calls == ["snapshot", "prepare_step", "start_write"] and outcome.ahead_since is None


def test_non_finite_weights_fail_the_chunk_before_training_ahead_or_writing(boundary):
    _, _, store, group = boundary
    group.non_finite = ["actor_model:lm_head.weight"]
    with pytest.raises(NonFiniteTraining, match="lm_head.weight"):
        commit(boundary)
    assert group.calls == ["snapshot"] and store.list() == []


def test_a_disk_found_full_after_the_ranks_train_ahead_stops_before_any_write(boundary, monkeypatch):
    _, _, store, group = boundary
    monkeypatch.setattr(store, "free_bytes", lambda: 10)
    with pytest.raises(StoreFull, match=r"0.00 MB free, the checkpoint needs 1\d.\d\d MB"):
        commit(boundary)
    assert group.calls == ["snapshot", "train_ahead:10"] and store.list() == []


def test_a_step_committed_meanwhile_is_kept_and_the_snapshot_dropped(boundary):
    commit(boundary)
    _, _, store, group = boundary
    group.calls.clear()
    outcome = commit(boundary)
    assert group.calls == ["snapshot", "train_ahead:10", "prepare_step", "drop:1"]
    assert outcome.info.step == 5 and [known.step for known in store.list(verify=True)] == [5]
