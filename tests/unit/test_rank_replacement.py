"""When a chunk replaces its ranks in place (`StageRunner.replaces_ranks_after`), what the ledger keeps of it
(`goodput.replace_ranks`), what `rlhf goodput` prints, and where the raylet's ten lines about a dead worker go.
The replacement itself, on real Ray ranks, is in tests/integration/test_chunk_retry.py and test_hang.py."""

from __future__ import annotations

import json
import pickle
import signal

import pytest

from rlhf_core.config import RunConfig
from rlhf_core.driver.runner import MAX_REPLACEMENTS_PER_CHUNK, StageRunner
from rlhf_core.driver.spares import num_spares
from prefect.states import Failed

from rlhf_core.errors import (FailedAt, PlacementFailed, RankHung, StallRepeats, TransientStoreError, UserError,
                              WorkerLost, exit_code_of, is_retryable)
from rlhf_core.ops import console, ray_output
from rlhf_core.ops.goodput import begin_attempt, empty_ledger, replace_ranks
from rlhf_core.ops.goodput_summary import format_summary, summarize
from rlhf_core.stages.sft import SFTConfig


def make_run(tmp_path, **overrides) -> RunConfig:
    return RunConfig(sft=SFTConfig(pretrain="m", dataset="d.jsonl"), ckpt_path=str(tmp_path / "ckpt"), **overrides)


def test_a_lost_or_hung_rank_is_replaced_in_place_a_few_times_per_chunk_and_nothing_else_is(tmp_path):
    runner = StageRunner(make_run(tmp_path))
    for error in (UserError("bad flag"), PlacementFailed("no room"), TransientStoreError("503"), RuntimeError("?")):
        assert not runner.replaces_ranks_after(error, "sft", 8), error  # Prefect's retries, or none, decide these
    for _ in range(MAX_REPLACEMENTS_PER_CHUNK):
        assert runner.replaces_ranks_after(WorkerLost("rank 0 was lost"), "sft", 8)
    assert not runner.replaces_ranks_after(WorkerLost("rank 0 was lost"), "sft", 8)  # this chunk used its budget
    assert runner.replaces_ranks_after(RankHung("rank 1 made no progress"), "sft", 16)  # the next chunk has its own


def test_a_hang_replaced_in_place_announces_its_alert_once_and_a_stop_replaces_nothing(tmp_path):
    announced: list = []
    runner = StageRunner(make_run(tmp_path), announce=announced.append)
    alert = {"name": "rlhf.alert.hang", "run_name": "rlhf", "stage": "sft"}
    assert runner.replaces_ranks_after(RankHung("rank 0 made no progress", 0, None, alert), "sft", 8)
    assert runner.replaces_ranks_after(WorkerLost("rank 0 was lost"), "sft", 8)
    assert announced == [alert]
    runner.signals.signal_number = signal.SIGTERM  # as its handler records it: the run stops, it does not heal
    assert not runner.replaces_ranks_after(WorkerLost("rank 0 was lost"), "sft", 16)


def test_the_ledger_keeps_each_replacement_and_goodput_prints_their_count_and_times():
    doc = empty_ledger()
    begin_attempt(doc, "a1", now=100.0)
    replace_ranks(doc, "sft", "lost ranks", seen_at=110.0, ready_at=111.5, first_step_s=0.5)
    replace_ranks(doc, "sft", "hangs", seen_at=200.0, ready_at=206.0, first_step_s=1.0)
    entries = doc["stages"]["sft"]["replacements"]
    assert [(entry["cause"], entry["recovery_s"]) for entry in entries] == [("lost ranks", 2.0), ("hangs", 7.0)]
    text = format_summary(summarize(doc), "file:///ckpt/rlhf")
    assert "ranks replaced in place: 2 time(s); from the loss to training again median 7.0 s, worst 7.0 s" in text
    assert json.loads(json.dumps(summarize(doc).to_dict()))["replacements"] == 2


def test_the_raylets_dead_worker_lines_go_to_the_log_file_not_the_console(tmp_path, capsys, monkeypatch):
    from ray._private import worker as ray_worker

    printed = []
    monkeypatch.setattr(ray_worker, "print_to_stdstream", lambda data, ignore_prefix: printed.append(data))
    log_file = tmp_path / "driver.log"
    console.configure_console(str(log_file), verbose=False)
    try:
        console.open_log_file()
        ray_output._raylet_errors_to_the_file()
        dead = {"pid": "raylet", "ip": "10.0.0.1", "is_err": False,
                "lines": ["A worker died or was killed while executing a task by an unexpected system error."]}
        ray_worker.print_to_stdstream(dead, ignore_prefix=False)
        ray_worker.print_to_stdstream({"pid": "autoscaler", "lines": ["Adding 1 node(s)"], "is_err": False},
                                      ignore_prefix=False)
    finally:
        console.reset_console()
    assert "A worker died" not in capsys.readouterr().err and [batch["pid"] for batch in printed] == ["autoscaler"]
    assert "(pid=raylet, ip=10.0.0.1) A worker died or was killed" in log_file.read_text()


@pytest.mark.parametrize("bundle, expected", [({"CPU": 1}, [2, 0, 1]), ({"CPU": 1, "GPU": 1}, [0, 0, 1])])
def test_spares_default_to_one_per_cpu_rank_none_for_gpu_ranks_and_the_flag_overrides(tmp_path, monkeypatch, bundle,
                                                                                       expected):
    monkeypatch.setattr("rlhf_core.driver.spares.placement_bundle", lambda run: bundle)  # no cluster to ask here
    assert [num_spares(make_run(tmp_path, **flag), 2) for flag in ({}, {"num_spare_workers": 0},
                                                                   {"num_spare_workers": 1})] == expected


def hung_at(step: int, frame: str = "DPOTrainer.logps (rank/trainers/dpo.py:88)") -> RankHung:
    alert = {"name": "rlhf.alert.hang", "run_name": "rlhf", "stage": "dpo", "step": step}
    return RankHung(f"rank 0 made no progress at step {step}", 0, "/logs/hang-1-rank0.txt", alert,
                    FailedAt(0, step, frame, 60.0))


def test_the_same_stall_after_every_replacement_stops_the_run_with_one_sentence_and_no_retry(tmp_path, monkeypatch):
    """A hang at the same step in the same frame on new ranks, after the 3 replacements a chunk allows: the run
    stops (StallRepeats) with the step, the frame, each try's time and the flag to raise; neither the chunk's
    Prefect retries nor a deployment's restarts take it up."""
    from flows import restarts
    from tasks.chunks import _retry_if_retryable

    now = [1000.0]
    monkeypatch.setattr("rlhf_core.driver.repeats.time.monotonic", lambda: now[0])
    announced: list = []
    runner = StageRunner(make_run(tmp_path), announce=announced.append)
    for try_seconds in (75, 71, 72):
        runner._held.tries.try_starts()  # as `group_at` does at each try's start
        now[0] += try_seconds
        assert runner.replaces_ranks_after(hung_at(7), "dpo", 8)
    runner._held.tries.try_starts()
    now[0] += 70
    with pytest.raises(StallRepeats) as stopped:
        runner.replaces_ranks_after(hung_at(7), "dpo", 8)
    assert str(stopped.value) == (
        "dpo stalled at step 7 in DPOTrainer.logps (rank/trainers/dpo.py:88) on 4 tries in a row, each on new ranks "
        "(they ran 75 s, 71 s, 72 s, 70 s): new ranks, retries and restarts do not cure it, so the run stops here. If "
        "that work is only slow, raise --hang_timeout_s above 60 s and run the same command again; its stacks are in "
        "/logs/hang-1-rank0.txt.")
    assert len(announced) == 3 and stopped.value.alert == hung_at(7).alert  # the chunk task emits the 4th's
    assert not is_retryable(stopped.value) and exit_code_of(stopped.value) == 1
    assert not _retry_if_retryable(None, None, Failed(data=stopped.value))  # no Prefect retry of the chunk
    monkeypatch.setattr(restarts, "deployment_run_id", lambda: "00000000-0000-0000-0000-000000000001")
    assert restarts.after_failure(runner.run, stopped.value) is None  # a deployment's run ends Failed, no restart
    assert pickle.loads(pickle.dumps(stopped.value)).alert == stopped.value.alert


def test_a_lost_rank_at_the_same_step_every_time_stops_the_run_too(tmp_path):
    """A rank killed at the same step on every try (a deterministic OOM kill): the same stop, with its remedy."""
    runner = StageRunner(make_run(tmp_path))
    lost = WorkerLost("rank 1 on node 10.0.0.2 was lost mid-chunk at step 12 (its actor died).", FailedAt(1, 12))
    for _ in range(MAX_REPLACEMENTS_PER_CHUNK):
        assert runner.replaces_ranks_after(lost, "sft", 15)
    with pytest.raises(StallRepeats, match=r"^sft: rank 1 was lost at step 12 on 4 tries in a row, each on new "
                                           r"ranks \(they ran \d+ s, \d+ s, \d+ s, \d+ s\): .* lower "
                                           r"--micro_train_batch_size"):
        runner.replaces_ranks_after(lost, "sft", 15)


@pytest.mark.parametrize("fourth", [hung_at(8), hung_at(7, "TrainWorker.write_snapshot (rank/worker.py:300)"),
                                    WorkerLost("rank 0 was lost mid-chunk at step 7", FailedAt(0, 7)),
                                    RankHung("rank 0 made no progress")])
def test_failures_at_other_places_go_to_prefects_retries_as_before(tmp_path, fourth):
    """A failure after the 3 replacements at another step, in another frame, of another kind, or at a place not
    known: not the same stall, so the chunk's Prefect retries take it, as before."""
    runner = StageRunner(make_run(tmp_path))
    for _ in range(MAX_REPLACEMENTS_PER_CHUNK):
        assert runner.replaces_ranks_after(hung_at(7), "sft", 10)
    assert not runner.replaces_ranks_after(fourth, "sft", 10)


def test_a_hang_and_a_loss_keep_where_they_happened_through_pickling():
    for error in (hung_at(7), WorkerLost("lost", FailedAt(1, 3))):
        copy = pickle.loads(pickle.dumps(error))
        assert (type(copy), str(copy), copy.where) == (type(error), str(error), error.where)
