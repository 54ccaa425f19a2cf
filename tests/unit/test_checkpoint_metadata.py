"""A checkpoint's metadata (`rlhf_core.storage.metadata`) against the fixture that the main before it was a type
wrote (tests/data/checkpoints/metadata_v1, by tests/unit/checkpoint_fixture.py): the commit writes the same keys and
values today, the fixture reads back whole, a resume from it reads every field it needs, and a chunk's cache key
(which holds the format version) is the one that main computed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhf_core.driver.chunk import Chunk
from rlhf_core.driver.chunk_commit import Trained, checkpoint_metadata
from rlhf_core.driver.plan import plan_stage
from rlhf_core.driver.resume import Lineage, StageCheckpoints, load_start
from rlhf_core.driver.runner import StageRunner, _world_size_changes
from rlhf_core.ops.commit_alerts import expected_bytes_from_metadata
from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.storage.metadata import CheckpointMetadata, WorldSizeChange
from tests.unit.checkpoint_fixture import FIXTURE, STEPS, fixture_run, localized, normalized, write_checkpoints
from tests.unit.test_chunk_commit import RecordingGroup

# What depends on this machine rather than on the code: the semantic hash covers the run's absolute paths, and the
# package versions are the environment's.
MACHINE_DEPENDENT = {"config_hash", "versions"}


def fixture(step: int) -> dict:
    return json.loads((FIXTURE / f"step_{step}.json").read_text())


def test_todays_commit_writes_the_fixture_form(toy_assets, tmp_path):
    written = write_checkpoints(toy_assets, tmp_path)
    for step in STEPS:
        today, before = normalized(written[step], toy_assets, tmp_path), fixture(step)
        assert today.keys() == before.keys()
        assert {name: today[name] for name in today.keys() - MACHINE_DEPENDENT} == \
            {name: before[name] for name in before.keys() - MACHINE_DEPENDENT}


@pytest.mark.parametrize("step", STEPS)
def test_the_fixture_reads_back_whole(step):
    record = fixture(step)
    metadata = CheckpointMetadata.from_json(record)
    assert metadata.to_json() == record
    assert (metadata.stage, metadata.step, metadata.total_steps, metadata.seed) == ("sft", step, 32, 7)
    assert metadata.world_size_changes == (WorldSizeChange(5, 2, 1),)
    assert [entry["step"] for entry in metadata.metric_history] == list(STEPS[:STEPS.index(step) + 1])


def test_a_checkpoint_older_than_a_key_reads_its_default_and_an_unknown_key_is_kept():
    metadata = CheckpointMetadata.from_json({"stage": "sft", "step": 3, "zero_stage": 2, "written_by": "a later rlhf"})
    assert metadata.world_size is None and metadata.saved_world_size(4) == 4
    assert metadata.metric_history == () and metadata.model_sizes is None and metadata.trackers == {}
    assert expected_bytes_from_metadata(metadata) is None
    assert metadata.to_json()["written_by"] == "a later rlhf" and "model_sizes" not in metadata.to_json()


class LoadingGroup:
    """A worker group that records what the resume asks of it."""

    def __init__(self, world_size: int):
        self.world_size, self.step, self.calls = world_size, 0, []

    def setup(self, run, stage, chunk_ends, load_universal, saved_zero_stage=None):
        self.calls.append(("setup", load_universal, saved_zero_stage))

    def load(self, stage_url, storage_options, step, universal, weights_only):
        self.calls.append(("load", step, universal, weights_only))
        self.step = step


def test_a_resume_from_the_fixture_reads_every_field_it_needs(toy_assets, tmp_path):
    """Step 10 as the earlier main committed it, resumed by 2 ranks: the drift check passes (same settings, data and
    model), the load is told the saved ZeRO stage, the world-size changes carry on, and the next commit continues
    the metric history and the line's world-size changes."""
    run = fixture_run(toy_assets, tmp_path)
    store = CheckpointStore(run.stage_url("sft"))
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"w" * 1000)
    for step in STEPS:
        store.commit(step, str(folder), localized(fixture(step), toy_assets, tmp_path))
    group = LoadingGroup(world_size=2)
    start = load_start(run, "sft", StageCheckpoints(store, store.list(), Lineage()), group, [5, 10, 15])
    assert start is not None and start.info.step == 10 and not start.universal  # ZeRO-0 loads at any world size
    assert group.calls == [("setup", False, 0), ("load", 10, False, False)]
    changes = _world_size_changes(group, start)  # type: ignore[arg-type]
    assert changes == (WorldSizeChange(5, 2, 1), WorldSizeChange(10, 1, 2))

    with StageRunner(run) as runner:
        chunk = Chunk.of(runner, "sft", 15, plan=plan_stage(run, "sft"))
        assert chunk._saved_tracker_ids(10) == {}
        assert chunk._committed_result(store.list(), store.list()[:1]) is None  # step 15 not there yet
        ahead = RecordingGroup(folder, step=15)
        ahead.world_size = 2
        runner._held.warm = SimpleNamespace(world_size_changes=changes)  # type: ignore[assignment]
        summary = {"loss": 0.05, "mean_loss": 0.06}
        trained = Trained(ahead, store.list(), 10, [], None, False)  # type: ignore[arg-type]
        metadata = checkpoint_metadata(chunk, trained, summary)
        runner._held.warm = None
    assert [entry["step"] for entry in metadata.metric_history] == [5, 10, 15]
    assert metadata.world_size_changes == changes and metadata.world_size == 2
    assert metadata.consumed_samples == 15 * 8 and metadata.epoch == 0


def test_the_committed_result_of_a_fixture_step_carries_its_metrics(toy_assets, tmp_path):
    run = fixture_run(toy_assets, tmp_path)
    store = CheckpointStore(run.stage_url("sft"))
    folder = Path(tmp_path / "files")
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"w")
    store.commit(10, str(folder), localized(fixture(10), toy_assets, tmp_path))
    with StageRunner(run) as runner:
        chunk = Chunk.of(runner, "sft", 10, plan=plan_stage(run, "sft"))
        result = chunk._committed_result(store.list(), store.list())
    assert result is not None and result.metrics == fixture(10)["metrics"] and result.num_steps_trained == 0


def test_a_chunks_cache_key_is_the_one_the_earlier_main_computed(toy_assets, tmp_path):
    """Prefect skips a completed chunk by its key: a run resumed on this code after the earlier main's must find
    its chunks' keys unchanged (tasks/chunks.py's `chunk_cache_key` of 1b50b26, restated here)."""
    import hashlib

    from rlhf_core.config import semantic_hash
    from tasks.chunks import ChunkKey

    run, lineage = fixture_run(toy_assets, tmp_path), Lineage(5, "d" * 64, weights_only=True)
    identity = {"lineage": lineage.cache_token(), "run_name": run.run_name, "stage": "sft", "target_step": 10,
                "config_hash": semantic_hash(run, "sft"), "upstream_digest": "up", "format_version": 1}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    assert ChunkKey.of(run, "sft", 10, "up", lineage).cache_key() == f"fixture-sft-step10-{digest}"
