"""Trackers on a fake metrics stream: TensorBoard event files read back with tensorboard's own
EventAccumulator, wandb in offline mode (no network), and the chunk loop that feeds them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rlhf_core.driver.chunk import train_and_log
from rlhf_core.config import RunConfig
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.errors import UserError
from rlhf_core.ops.trackers import OpenTrackers, require_tracker_packages, split_metrics

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")


def make_run(tmp_path: Path, logging_steps: int = 1, **overrides) -> RunConfig:
    sft = SFTConfig(pretrain="model", dataset="data.jsonl", logging_steps=logging_steps)
    return RunConfig(run_name="exp", ckpt_path=str(tmp_path / "ckpt"), sft=sft, **overrides)


def fake_stream(first: int, last: int, offset: float = 0.0, eval_every: int = 0) -> list[dict]:
    """Per-step metrics as a chunk brings them back, with recognisable values."""
    stream = []
    for step in range(first, last + 1):
        metrics = {"step": step, "loss": offset + 1.0 / step, "lr": 1e-3 * step}
        if eval_every and step % eval_every == 0:
            metrics["eval_accuracy"] = offset + step / 100
        stream.append(metrics)
    return stream


def scalars(log_dir: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(log_dir)
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


@pytest.fixture
def opened():
    """The stage trackers a driver holds open; all closed at the end of the test."""
    trackers = OpenTrackers()
    yield trackers
    trackers.close()


@pytest.fixture(autouse=True)
def wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    yield
    import wandb

    wandb.teardown()  # wandb keeps the settings of its first run per process; the next test sets others


def test_split_metrics_tags_train_and_eval():
    train, evaluation = split_metrics({"step": 4, "loss": 0.5, "lr": 1e-3, "eval_accuracy": 0.75,
                                       "eval_loss": 1, "flag": True, "note": "text"})
    assert train == {"loss": 0.5, "lr": 1e-3}
    assert evaluation == {"accuracy": 0.75, "loss": 1.0}


def test_tensorboard_logs_every_logging_steps_and_every_eval(opened, tmp_path):
    run = make_run(tmp_path, logging_steps=3, use_tensorboard=str(tmp_path / "tb"))
    trackers = opened.open(run, "sft", {}, start_step=0)
    trackers.log(fake_stream(1, 7, eval_every=2))
    opened.close(run, "sft")

    log_dir = str(tmp_path / "tb" / "exp" / "sft")
    assert trackers.tracker_ids() == {"wandb_run_id": None, "tensorboard_dir": log_dir}
    assert scalars(log_dir, "train/loss") == [(3, pytest.approx(1 / 3)), (6, pytest.approx(1 / 6))]
    assert [step for step, _ in scalars(log_dir, "train/lr")] == [3, 6]
    # Evaluation is not thinned by logging_steps: it is logged on every step that evaluated.
    assert scalars(log_dir, "eval/accuracy") == [(2, pytest.approx(0.02)), (4, pytest.approx(0.04)),
                                                 (6, pytest.approx(0.06))]


def test_tensorboard_resume_shows_each_step_once_with_the_retrained_values(opened, tmp_path):
    """A run logged to step 6, died, and resumes from its step-5 checkpoint: TensorBoard must show
    steps 1-5 of the first session and 6-10 of the second, each once."""
    run = make_run(tmp_path, use_tensorboard=str(tmp_path / "tb"))
    opened.open(run, "sft", {}, start_step=0).log(fake_stream(1, 6))
    opened.close(run, "sft", failed=True)
    opened.open(run, "sft", {}, start_step=5).log(fake_stream(6, 10, offset=100.0))
    opened.close(run, "sft")

    logged = scalars(str(tmp_path / "tb" / "exp" / "sft"), "train/loss")
    assert [step for step, _ in logged] == list(range(1, 11))
    assert all(value < 100 for step, value in logged if step <= 5)
    assert all(value > 100 for step, value in logged if step > 5)


def offline_runs(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "wandb-dir" / "wandb").glob("offline-run-*"))


def test_wandb_offline_run_resumes_the_same_id(opened, tmp_path):
    run = make_run(tmp_path, use_wandb=True, wandb_project="proj")
    first = opened.open(run, "sft", {}, start_step=0)
    assert first.wandb_run.name == "exp-sft" and first.wandb_run.project == "proj"
    first.log(fake_stream(1, 5))
    saved = first.tracker_ids()
    opened.close(run, "sft")

    second = opened.open(run, "sft", saved, start_step=5)
    assert second.wandb_run.id == saved["wandb_run_id"]
    second.log(fake_stream(6, 8))
    opened.close(run, "sft")

    folders = offline_runs(tmp_path)
    assert len(folders) == 2
    for folder in folders:
        assert folder.name.startswith("offline-run-") and saved["wandb_run_id"] in folder.name
        assert (folder / f"run-{saved['wandb_run_id']}.wandb").is_file()


def test_wandb_skips_steps_it_already_logged_in_this_process(opened, tmp_path, monkeypatch):
    """A chunk retried after a failure re-trains steps the wandb run already shows."""
    run = make_run(tmp_path, use_wandb=True, wandb_run_name="named")
    first = opened.open(run, "sft", {}, start_step=0)
    assert first.wandb_run.name == "named"
    first.log(fake_stream(1, 6, eval_every=3))
    saved = first.tracker_ids()
    opened.close(run, "sft", failed=True)

    retried = opened.open(run, "sft", saved, start_step=4)
    payloads = []
    original_log = retried.wandb_run.log
    monkeypatch.setattr(retried.wandb_run, "log", lambda data, **kw: (payloads.append(data), original_log(data, **kw)))
    retried.log(fake_stream(5, 8, eval_every=3))
    assert [payload["train/global_step"] for payload in payloads] == [7, 8]
    assert "eval/accuracy" not in payloads[0]


def test_wandb_payload_has_both_step_metrics(opened, tmp_path, monkeypatch):
    run = make_run(tmp_path, logging_steps=2, use_wandb=True)
    trackers = opened.open(run, "sft", {}, start_step=0)
    payloads = []
    monkeypatch.setattr(trackers.wandb_run, "log", payloads.append)
    trackers.log(fake_stream(1, 4, eval_every=3))
    assert payloads == [
        {"train/global_step": 2, "train/loss": 0.5, "train/lr": pytest.approx(2e-3)},
        {"eval/global_step": 3, "eval/accuracy": pytest.approx(0.03)},
        {"train/global_step": 4, "train/loss": 0.25, "train/lr": pytest.approx(4e-3)},
    ]


def test_wandb_online_without_an_api_key_is_one_user_error(opened, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with pytest.raises(UserError, match="--use_wandb.*WANDB_API_KEY.*WANDB_MODE=offline"):
        opened.open(make_run(tmp_path, use_wandb=True), "sft", {}, start_step=0)


@pytest.mark.parametrize(("flag", "package", "settings"), [("--use_tensorboard", "tensorboard", {"use_tensorboard": "tb"}),
                                                           ("--use_wandb", "wandb", {"use_wandb": True})])
def test_missing_tracker_package_names_flag_and_extra(tmp_path, monkeypatch, flag, package, settings):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real_find_spec(name, *a))
    with pytest.raises(UserError) as refused:
        require_tracker_packages(make_run(tmp_path, **settings))
    assert flag in str(refused.value) and "rlhf-pipeline[tracking]" in str(refused.value)
    require_tracker_packages(make_run(tmp_path))  # no flag, no package needed


def test_open_trackers_are_kept_per_stage_and_closed(opened, tmp_path):
    run = make_run(tmp_path, use_tensorboard=str(tmp_path / "tb"))
    assert opened.get(run, "sft") is None
    trackers = opened.open(run, "sft", {}, start_step=0)
    assert opened.get(run, "sft") is trackers
    # Other tracker settings for the same stage: the open ones are closed, not reused.
    assert opened.get(run.model_copy(update={"use_tensorboard": str(tmp_path / "other")}), "sft") is None
    assert trackers.tensorboard is None
    opened.open(run, "sft", {}, start_step=0)
    opened.close()
    assert len(opened) == 0


class FakeGroup:
    """train_until as WorkerGroup's: the metrics of every step up to the target."""

    training_ahead_to = None  # never trained ahead (a chunk's own round trips)

    def __init__(self, step: int):
        self.step, self.calls = step, []

    def train_until(self, target: int) -> list[dict]:
        self.calls.append(target)
        metrics = fake_stream(self.step + 1, target)
        self.step = target
        return metrics


def test_chunk_trains_to_each_logged_step_so_metrics_stream(opened, tmp_path):
    run = make_run(tmp_path, logging_steps=4, use_tensorboard=str(tmp_path / "tb"))
    trackers = opened.open(run, "sft", {}, start_step=5)
    group = FakeGroup(step=5)
    step_metrics = train_and_log(group, 15, trackers, 4, "sft", 32)
    assert group.calls == [8, 12, 15]
    assert [metrics["step"] for metrics in step_metrics] == list(range(6, 16))
    opened.close()
    assert [step for step, _ in scalars(trackers.tensorboard_dir, "train/loss")] == [8, 12]

    untracked = FakeGroup(step=0)
    assert len(train_and_log(untracked, 10, None, 1, "sft", 32)) == 10
    assert untracked.calls == [10]  # no trackers: one round trip per chunk, as before


def test_a_chunk_trained_ahead_to_its_first_logged_step_collects_it_then_stops_at_the_next(opened, tmp_path):
    run = make_run(tmp_path, logging_steps=2, use_tensorboard=str(tmp_path / "tb"))
    trackers = opened.open(run, "sft", {}, start_step=5)
    group = FakeGroup(step=5)
    group.training_ahead_to = 6  # the previous chunk's commit let the ranks train on to step 6
    step_metrics = train_and_log(group, 10, trackers, 2, "sft", 32)
    assert group.calls == [6, 8, 10]
    assert [metrics["step"] for metrics in step_metrics] == list(range(6, 11))
    opened.close()
    assert [step for step, _ in scalars(trackers.tensorboard_dir, "train/loss")] == [6, 8, 10]
