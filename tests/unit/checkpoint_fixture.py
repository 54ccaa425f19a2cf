"""Writes a checkpoint's `training_metadata.json` as the driver does (`driver/chunk.py`'s commit), with a stand-in
worker group. The committed fixture `tests/data/checkpoints/metadata_v1/` was written by this helper as it was in
5b14528, through the commit of the main before the metadata became a type (1b50b26, a dict built in chunk.py), so
tests/unit/test_checkpoint_metadata.py holds today's code to that on-disk form.

Regenerate (only when the format version changes): `.venv/bin/python -m tests.unit.checkpoint_fixture DIR`."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from rlhf_core.driver.chunk_commit import ChunkState, Trained, commit_chunk
from rlhf_core.driver.plan import plan_stage
from rlhf_core.driver.runner import StageRunner, WarmGroup
from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.storage.metadata import WorldSizeChange
from tests.unit.test_chunk_commit import RecordingGroup
from tests.unit.test_chunk_planning import toy_run

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "checkpoints" / "metadata_v1"
STEPS = (5, 10)  # step 10 continues step 5: its metric history carries step 5's entry
# A world-size change recorded in the line of checkpoints (as after --allow_fewer_workers), so the fixture has one.
WORLD_SIZE_CHANGES = (WorldSizeChange(step=5, from_size=2, to=1),)


def write_checkpoints(toy_assets: dict[str, str], folder: Path) -> dict[int, dict]:
    """Commit SFT steps 5 and 10 of a toy run into `folder/ckpt`; returns each step's metadata as written."""
    run = fixture_run(toy_assets, folder)
    plan, store = plan_stage(run, "sft"), CheckpointStore(run.stage_url("sft"))
    snapshot = folder / "snapshot"
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "weights.bin").write_bytes(b"w" * 1000)
    start = 0
    for step in STEPS:
        group = RecordingGroup(snapshot, step=step)
        with StageRunner(run) as runner:
            runner._held.warm = WarmGroup(group, (), WORLD_SIZE_CHANGES)  # type: ignore[arg-type]
            commit(runner, plan, store, group, start)
            runner._held.warm = None  # a stand-in: nothing to shut down
        start = step
    return {step: store.read_metadata(step) for step in STEPS}


def fixture_run(toy_assets: dict[str, str], folder: Path):
    return toy_run(toy_assets, ckpt_path=str(folder / "ckpt"), run_name="fixture", seed=7, sft={"save_steps": 5})


def commit(runner, plan, store, group, start: int) -> None:
    """One commit through the driver's own code (the call that this helper keeps in step with the code)."""
    metrics = [{"step": index, "loss": 1.0 / index, "lr": 1e-5} for index in range(start + 1, group.step + 1)]
    chunk = ChunkState(runner, "sft", group.step, plan, runner.identity("sft"), store)
    commit_chunk(chunk, Trained(group, store.list(), start, metrics, None, False))


def normalized(metadata: dict, toy_assets: dict[str, str], folder: Path) -> dict:
    """The metadata with this machine's folders as placeholders (`<toy>`, `<tmp>`)."""
    text = json.dumps(metadata, sort_keys=True)
    toy_root = str(Path(toy_assets["model"]).parent)
    return json.loads(text.replace(toy_root, "<toy>").replace(str(folder), "<tmp>"))


def localized(metadata: dict, toy_assets: dict[str, str], folder: Path) -> dict:
    """The fixture's metadata with its placeholders back as this machine's folders."""
    text = json.dumps(metadata)
    toy_root = str(Path(toy_assets["model"]).parent)
    return json.loads(text.replace("<toy>", toy_root).replace("<tmp>", str(folder)))


if __name__ == "__main__":
    from rlhf_core.toy import init_toy

    work = Path(sys.argv[1])
    assets = init_toy(str(work / "toy"))
    written = write_checkpoints(assets, work / "run")
    shutil.rmtree(FIXTURE, ignore_errors=True)
    FIXTURE.mkdir(parents=True)
    for step, metadata in written.items():
        (FIXTURE / f"step_{step}.json").write_text(
            json.dumps(normalized(metadata, assets, work / "run"), indent=2, sort_keys=True) + "\n")
