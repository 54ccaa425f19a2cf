"""When a chunk replaces its ranks in place (`StageRunner.replaces_ranks_after`), what the ledger keeps of it
(`goodput.replace_ranks`), what `rlhf goodput` prints, and where the raylet's ten lines about a dead worker go.
The replacement itself, on real Ray ranks, is in tests/integration/test_chunk_retry.py and test_hang.py."""

from __future__ import annotations

import json
import signal

import pytest

from rlhf_core.config import RunConfig
from rlhf_core.driver.runner import MAX_REPLACEMENTS_PER_CHUNK, StageRunner
from rlhf_core.driver.spares import num_spares
from rlhf_core.errors import PlacementFailed, RankHung, TransientStoreError, UserError, WorkerLost
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
    runner = StageRunner(make_run(tmp_path))
    announced = []
    runner.announce = announced.append
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
