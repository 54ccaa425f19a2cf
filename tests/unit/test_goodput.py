"""The goodput ledger (rlhf_core/ops/goodput.py): what it records across attempts, crashes and retries, how its file
is written, `rlhf goodput` and `rlhf plan`, and the planner's arithmetic against a case computed by hand."""

from __future__ import annotations

import json
import math
import os

import pytest

from flows.cli import main
from rlhf_core.ops.goodput import (CRASHED, FINISHED, LEASE_HEARTBEAT_S, CommittedChunk, GoodputLedger, begin_attempt,
                                   commit_chunk, empty_ledger, finish_attempt, start_chunk)
from rlhf_core.ops.step_time import writer_slowdown
from rlhf_core.ops.goodput_summary import expected_goodput, format_summary, measured_costs, plan_interval, summarize


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


# --------------------------------------------------------------------------- the planner, by hand


def test_young_interval_and_expected_goodput_match_a_hand_computed_case():
    """C = 2 s per checkpoint, MTBF M = 1 h = 3600 s, 0.5 s per step, restart R = 30 s.
    Young: T = sqrt(2 * C * M) = sqrt(2 * 2 * 3600) = sqrt(14400) = 120 s of work -> 120 / 0.5 = 240 steps.
    Expected goodput = 1 - C/T - (T/2 + R)/M = 1 - 2/120 - (60 + 30)/3600 = 1 - 1/60 - 1/40 = 1 - 5/120
    = 0.958333...  At save_steps 50 (T = 25 s): 1 - 2/25 - (12.5 + 30)/3600 = 1 - 0.08 - 0.0118055... = 0.9081944..."""
    plan = plan_interval(checkpoint_seconds=2.0, step_seconds=0.5, mtbf_seconds=3600.0, restart_seconds=30.0)
    assert plan.interval_seconds == 120.0
    assert plan.save_steps == 240
    assert plan.expected_goodput == pytest.approx(1 - 5 / 120, abs=1e-12)
    assert expected_goodput(25.0, 2.0, 3600.0, 30.0) == pytest.approx(0.9081944444, abs=1e-9)
    # At Young's T, the checkpoint term equals the rework term: C/T = T/(2M) = sqrt(C/(2M)).
    assert 2.0 / plan.interval_seconds == pytest.approx(plan.interval_seconds / (2 * 3600.0))
    # Young's interval is the best one to first order: a step either way expects less.
    for steps in (plan.save_steps - 40, plan.save_steps + 40):
        assert expected_goodput(steps * 0.5, 2.0, 3600.0, 30.0) < plan.expected_goodput


def test_planner_never_suggests_less_than_one_step_and_refuses_nonsense():
    assert plan_interval(0.0, 1.0, 3600.0).save_steps == 1  # free checkpoints: every step
    with pytest.raises(ValueError):
        plan_interval(1.0, 0.0, 3600.0)
    with pytest.raises(ValueError):
        expected_goodput(0.0, 1.0, 3600.0)


# --------------------------------------------------------------------------- recording (pure transitions)


def _chunk(doc, attempt, clock, stage, start, end, train, stall=0.5, load=0.0):
    start_chunk(doc, attempt, stage, start, end, clock.advance(0.25))
    clock.advance(load + train + stall)
    seconds = {"plan": 0.0, "workers_and_load": load, "train": train, "save_and_commit": stall}
    commit_chunk(doc, attempt, CommittedChunk(stage, end, seconds), clock.now)


def test_one_clean_attempt_accounts_for_every_second():
    clock, doc = Clock(), empty_ledger()
    attempt = begin_attempt(doc, "a", clock.now, started=clock.now - 4.0)  # the command started 4 s earlier
    _chunk(doc, attempt, clock, "sft", 0, 10, train=10.0, load=2.0)
    _chunk(doc, attempt, clock, "sft", 10, 20, train=10.0)
    finish_attempt(doc, attempt, clock.advance(1.0))
    summary = summarize(doc)
    sft = summary.stages[0]
    assert (sft.chunks, sft.steps, sft.lost_steps) == (2, 20, 0)
    assert sft.useful_s == 20.0 and sft.stall_s == 1.0 and sft.load_s == 2.0
    assert sft.startup_s == 4.25  # command start -> first chunk start
    assert sft.wall_s == pytest.approx(4.25 + 12.5 + 0.25 + 10.5)
    assert sft.other_s == pytest.approx(0.25)  # the gap between the two chunks
    assert summary.total.wall_s == pytest.approx(sft.wall_s + 1.0)  # + after the last chunk (export)
    assert summary.total.goodput == pytest.approx(20.0 / 28.5)
    assert summary.num_attempts == 1 and summary.num_crashed == 0 and not summary.running
    assert measured_costs(sft) == pytest.approx(((1.0 + 0.25) / 2, 1.0, 4.25 + 2.0))


def test_a_crash_loses_the_uncommitted_chunk_and_the_next_attempt_settles_it():
    clock, doc = Clock(), empty_ledger()
    first = begin_attempt(doc, "a", clock.now)
    _chunk(doc, first, clock, "sft", 0, 10, train=10.0)
    start_chunk(doc, first, "sft", 10, 20, clock.advance(0.25))
    chunk_started = clock.now
    # SIGKILL 6 s into the chunk; the lease's last heartbeat was 3 s before that; restart 100 s later.
    holder = {"host": first["host"], "pid": first["pid"], "heartbeat": chunk_started + 3.0, "released": False}
    second = begin_attempt(doc, "b", clock.advance(106.0), lease_holder=holder)
    assert first["state"] == CRASHED and first["end"] == chunk_started + 3.0 + LEASE_HEARTBEAT_S
    sft = summarize(doc).stages[0]
    assert (sft.lost_chunks, sft.lost_steps) == (1, 10)
    assert sft.lost_s == pytest.approx(3.0 + LEASE_HEARTBEAT_S)
    assert sft.lost_to == {"restarts": pytest.approx(3.0 + LEASE_HEARTBEAT_S)}  # `rlhf goodput`: lost to restarts
    assert summarize(doc).down_s == pytest.approx(106.0 - 3.0 - LEASE_HEARTBEAT_S)
    assert not doc["pending"]
    _chunk(doc, second, clock, "sft", 10, 20, train=10.0, load=3.0)
    finish_attempt(doc, second, clock.now)
    summary = summarize(doc)
    sft = summary.stages[0]
    assert (sft.chunks, sft.steps, sft.attempts) == (2, 20, 2)
    assert summary.num_crashed == 1 and summary.num_attempts == 2
    assert sft.wall_s + summary.down_s == pytest.approx(clock.now - 1000.0)  # every second is somewhere
    assert summary.total.goodput == pytest.approx(20.0 / sft.wall_s)


def test_without_the_lease_record_a_crashed_attempt_runs_until_the_next_one_starts():
    clock, doc = Clock(), empty_ledger()
    first = begin_attempt(doc, "a", clock.now)
    start_chunk(doc, first, "rm", 0, 8, clock.advance(1.0))
    begin_attempt(doc, "b", clock.advance(50.0), lease_holder=None)
    assert first["end"] == clock.now
    assert summarize(doc).down_s == 0.0 and summarize(doc).stages[0].lost_s == 50.0


def test_a_process_that_died_after_its_commit_but_before_recording_it_loses_nothing():
    clock, doc = Clock(), empty_ledger()
    first = begin_attempt(doc, "a", clock.now)
    start_chunk(doc, first, "sft", 0, 10, clock.advance(1.0))
    clock.advance(12.0)
    begin_attempt(doc, "b", clock.now, is_committed=lambda stage, step: (stage, step) == ("sft", 10))
    sft = summarize(doc).stages[0]
    assert (sft.chunks, sft.steps, sft.lost_steps, sft.useful_s) == (1, 10, 0, 12.0)


def test_a_chunk_retried_in_the_same_process_counts_its_failed_try_as_lost():
    clock, doc = Clock(), empty_ledger()
    attempt = begin_attempt(doc, "a", clock.now)
    _chunk(doc, attempt, clock, "sft", 0, 5, train=5.0)
    start_chunk(doc, attempt, "sft", 5, 10, clock.advance(0.1))
    failed_at = clock.now
    clock.advance(7.0)  # trained a while, failed, Prefect waited before the retry
    _chunk(doc, attempt, clock, "sft", 5, 10, train=5.0)
    sft = summarize(doc).stages[0]
    assert (sft.chunks, sft.steps, sft.lost_chunks, sft.lost_steps) == (2, 10, 1, 5)
    assert sft.lost_s == pytest.approx(clock.now - failed_at - 5.0 - 0.5 - 0.0)


def test_a_chunk_committing_in_the_background_while_the_next_trains_is_not_lost():
    clock, doc = Clock(), empty_ledger()
    attempt = begin_attempt(doc, "a", clock.now)
    start_chunk(doc, attempt, "sft", 0, 10, clock.advance(0.1))
    start_chunk(doc, attempt, "sft", 10, 20, clock.advance(10.0))  # chunk 1's writer still running
    commit_chunk(doc, attempt, CommittedChunk("sft", 10, {"train": 10.0, "stall": 0.2, "save_and_commit": 0.3,
                                                          "commit": 4.0}), clock.advance(4.0))
    commit_chunk(doc, attempt, CommittedChunk("sft", 20, {"train": 10.0, "stall": 0.2, "commit": 4.0}),
                 clock.advance(10.0))
    sft = summarize(doc).stages[0]
    assert (sft.chunks, sft.steps, sft.lost_chunks) == (2, 20, 0)
    assert sft.stall_s == pytest.approx(0.4)  # save_and_commit is not the stall when a stall is given
    assert sft.commit_s == 8.0 and sft.useful_s == 20.0


def test_the_ranks_step_loop_seconds_are_the_useful_time_when_the_chunk_reports_them():
    clock, doc = Clock(), empty_ledger()
    attempt = begin_attempt(doc, "a", clock.now)
    start_chunk(doc, attempt, "sft", 0, 10, clock.advance(0.1))
    commit_chunk(doc, attempt, CommittedChunk("sft", 10, {"train": 3.0, "step_loop": 9.5, "stall": 0.2}),
                 clock.advance(4.0))
    assert summarize(doc).stages[0].useful_s == 9.5


def test_the_step_loops_slowdown_beside_the_writer_is_stall_not_useful_time():
    clock, doc = Clock(), empty_ledger()
    attempt = begin_attempt(doc, "a", clock.now)
    start_chunk(doc, attempt, "sft", 0, 10, clock.advance(0.1))
    commit_chunk(doc, attempt, CommittedChunk("sft", 10, {"step_loop": 9.5, "writer_slowdown": 0.7, "stall": 0.2}),
                 clock.advance(10.0))
    sft = summarize(doc).stages[0]
    assert sft.useful_s == pytest.approx(8.8) and sft.stall_s == pytest.approx(0.9)
    assert sft.useful_s + sft.stall_s == pytest.approx(9.7)  # moved, not added: the wall time is unchanged


def test_an_evaluation_inside_the_step_loop_has_its_own_line_not_useful_time():
    clock, doc = Clock(), empty_ledger()
    attempt = begin_attempt(doc, "a", clock.now)
    start_chunk(doc, attempt, "rm", 0, 10, clock.advance(0.1))
    commit_chunk(doc, attempt, CommittedChunk("rm", 10, {"step_loop": 60.0, "eval": 57.0, "stall": 0.2}),
                 clock.advance(61.0))
    summary = summarize(doc)
    rm = summary.stages[0]
    assert rm.useful_s == pytest.approx(3.0) and rm.eval_s == pytest.approx(57.0)
    assert "evaluation: 57.0 s (rm 57.0 s; not in useful)" in format_summary(summary, "file:///run")


def test_writer_slowdown_is_what_steps_beside_a_write_took_beyond_the_median_clean_step():
    # Steps of 1.0 s, 1.2 s, 0.8 s, 1.0 s with nothing beside them (median 1.0); two beside a write: 1.5 and 1.3.
    steps = [(1.5, True), (1.3, True), (1.0, False), (1.2, False), (0.8, False), (1.0, False)]
    slowdown, clean = writer_slowdown(steps)
    assert clean == pytest.approx(1.0) and slowdown == pytest.approx(0.8)
    # A chunk whose every step ran beside a write uses the median an earlier chunk measured.
    assert writer_slowdown([(1.4, True), (1.1, True)], clean) == (pytest.approx(0.5), clean)
    # Nothing to compare against: nothing can be told apart.
    assert writer_slowdown([(1.4, True)]) == (0.0, None)
    # A write that cost nothing (noise below the median) is 0, never negative.
    assert writer_slowdown([(0.9, True), (1.0, False)])[0] == 0.0


def _chunk_then_train_ahead(doc, attempt, clock, commit_s: float) -> None:
    """Steps 0-10 of sft: 10 s of steps, a 0.2 s snapshot, then the ranks train ahead during the commit."""
    start_chunk(doc, attempt, "sft", 0, 10, clock.advance(0.1))
    commit_chunk(doc, attempt, CommittedChunk("sft", 10, {"step_loop": 10.0, "stall": 0.2, "commit": commit_s},
                                              trained_ahead_s=commit_s), clock.advance(10.2 + commit_s))


def test_a_chunk_killed_after_training_ahead_loses_the_steps_it_trained_during_the_previous_commit():
    clock, doc = Clock(), empty_ledger()
    first = begin_attempt(doc, "a", clock.now)
    _chunk_then_train_ahead(doc, first, clock, commit_s=4.0)
    start_chunk(doc, first, "sft", 10, 20, clock.advance(0.1))
    clock.advance(5.0)  # killed 5 s into the chunk, with no lease record: lost until the next attempt starts
    begin_attempt(doc, "b", clock.now)
    sft = summarize(doc).stages[0]
    assert (sft.lost_chunks, sft.lost_steps) == (1, 10)
    assert sft.lost_s == pytest.approx(4.0 + 0.1 + 5.0)
    assert sft.other_s == pytest.approx(0.0), "every second is accounted for"


def test_training_ahead_that_no_chunk_took_over_is_lost_at_a_crash_or_a_stop():
    clock, doc = Clock(), empty_ledger()
    first = begin_attempt(doc, "a", clock.now)
    _chunk_then_train_ahead(doc, first, clock, commit_s=3.0)
    clock.advance(2.0)  # killed before the next chunk's record
    second = begin_attempt(doc, "b", clock.now)
    sft = summarize(doc).stages[0]
    assert sft.lost_s == pytest.approx(5.0) and sft.lost_chunks == 0 and not doc["ahead"]
    assert sft.other_s == pytest.approx(0.0), "every second is accounted for"
    start_chunk(doc, second, "sft", 10, 20, clock.advance(1.0))
    commit_chunk(doc, second, CommittedChunk("sft", 20, {"step_loop": 10.0, "stall": 0.2, "commit": 3.0},
                                             trained_ahead_s=1.0), clock.advance(13.0))
    finish_attempt(doc, second, clock.advance(0.5))  # stopped by a run budget at that boundary
    assert summarize(doc).stages[0].lost_s == pytest.approx(5.0 + 1.5)


def test_an_attempt_that_ends_with_a_chunk_pending_lost_it():
    clock, doc = Clock(), empty_ledger()
    attempt = begin_attempt(doc, "a", clock.now)
    start_chunk(doc, attempt, "ppo", 0, 4, clock.advance(1.0))
    finish_attempt(doc, attempt, clock.advance(3.0))
    assert attempt["state"] == FINISHED
    assert summarize(doc).stages[0].lost_steps == 4 and not doc["pending"]


# --------------------------------------------------------------------------- the file


@pytest.mark.parametrize("memory", [False, True])
def test_ledger_file_is_written_whole_and_read_back_across_ledger_objects(tmp_path, memory):
    url = f"memory://goodput-{os.getpid()}/{tmp_path.name}/run" if memory else str(tmp_path / "run")
    clock = Clock()
    ledger = GoodputLedger(url, clock=clock)
    ledger.attempt_started()
    ledger.chunk_started("sft", 0, 5)
    clock.advance(6.0)
    ledger.chunk_committed("sft", 5, {"train": 5.0, "save_and_commit": 1.0})
    ledger.attempt_finished()
    doc = json.loads(ledger.fs.cat_file(ledger.path))
    assert doc["format"] == 1 and doc["attempts"][0]["state"] == FINISHED
    sft = summarize(GoodputLedger(url).read()).stages[0]
    assert (sft.chunks, sft.steps, sft.useful_s, sft.stall_s) == (1, 5, 5.0, 1.0)
    if not memory:
        assert sorted(os.listdir(tmp_path / "run")) == ["goodput.json"]  # no temporary file left behind


def test_a_second_attempt_in_a_new_process_finds_the_first_crashed(tmp_path):
    url, clock = str(tmp_path / "run"), Clock()
    GoodputLedger(url, clock=clock).chunk_started("sft", 0, 5)  # begins an attempt without being asked
    clock.advance(30.0)
    GoodputLedger(url, clock=clock).attempt_started()  # a new process's ledger: no attempt of its own yet
    summary = summarize(GoodputLedger(url).read())
    assert summary.num_crashed == 1 and summary.stages[0].lost_steps == 5 and summary.running


def test_a_new_attempt_in_the_same_process_ends_the_previous_one_cleanly(tmp_path):
    url, clock = str(tmp_path / "run"), Clock()
    ledger = GoodputLedger(url, clock=clock)
    ledger.chunk_started("sft", 0, 5)
    clock.advance(2.0)
    ledger.attempt_started()  # e.g. train_stage for the next stage
    summary = summarize(GoodputLedger(url).read())
    assert summary.num_attempts == 2 and summary.num_crashed == 0 and summary.stages[0].lost_steps == 5


def test_attempt_started_leaves_the_ledger_alone_while_another_live_run_holds_the_lease(tmp_path):
    from rlhf_core.storage.lease import RunLease

    url, clock = str(tmp_path / "run"), Clock()
    with RunLease(url):
        GoodputLedger(url, clock=clock).chunk_started("sft", 0, 5)
        GoodputLedger(url, clock=clock).attempt_started()  # a second process, about to be refused the lease
        summary = summarize(GoodputLedger(url).read())
        assert summary.num_attempts == 1 and summary.num_crashed == 0 and summary.pending


def test_recording_never_fails_the_chunk(tmp_path, caplog, monkeypatch):
    ledger = GoodputLedger(str(tmp_path / "run"))
    monkeypatch.setattr(ledger, "_write", lambda doc: (_ for _ in ()).throw(OSError("disk full")))
    ledger.chunk_started("sft", 0, 5)  # warns, does not raise
    assert "could not record goodput" in caplog.text and "disk full" in caplog.text


def test_a_file_that_is_not_a_ledger_is_kept_aside_and_recording_starts_again(tmp_path, caplog):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "goodput.json").write_text("")  # a power loss before the rename reached the disk
    GoodputLedger(str(tmp_path / "run")).chunk_started("sft", 0, 5)
    assert (tmp_path / "run" / "goodput.json.corrupt").read_text() == ""
    assert GoodputLedger(str(tmp_path / "run")).read()["pending"][0]["to_step"] == 5
    assert "kept as goodput.json.corrupt" in caplog.text


# --------------------------------------------------------------------------- rlhf goodput, rlhf plan


def _recorded_run(tmp_path) -> str:
    clock, url = Clock(), str(tmp_path / "ckpt" / "exp")
    ledger = GoodputLedger(url, clock=clock)
    ledger.attempt_started()
    for start in range(0, 40, 10):
        ledger.chunk_started("sft", start, start + 10)
        clock.advance(6.0)  # 5 s of steps, 1 s of checkpoint
        ledger.chunk_committed("sft", start + 10, {"train": 5.0, "save_and_commit": 1.0})
    ledger.attempt_finished()
    return url


def test_rlhf_goodput_prints_a_few_lines_and_json(tmp_path, capsys):
    url = _recorded_run(tmp_path)
    assert main(["goodput", url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"goodput 83.3% of run {url}")  # 20 s useful of 24 s
    assert len(out.splitlines()) <= 6 and "sft" in out and "total" in out
    assert main(["goodput", url, "--json"]) == 0
    total = json.loads(capsys.readouterr().out)["total"]
    assert total["steps"] == 40 and total["goodput"] == pytest.approx(20 / 24)


def test_a_store_outage_waited_out_is_its_own_line_of_rlhf_goodput(tmp_path, capsys):
    clock, url = Clock(), str(tmp_path / "ckpt" / "exp")
    ledger = GoodputLedger(url, clock=clock)
    ledger.attempt_started()
    ledger.chunk_started("sft", 0, 10)
    clock.advance(126.0)
    ledger.outage_waited("sft", 120.0)  # the commit waited 120 s for the store (rlhf_core.driver.outage)
    ledger.chunk_committed("sft", 10, {"train": 5.0, "save_and_commit": 121.0})
    ledger.attempt_finished()
    assert main(["goodput", url]) == 0
    assert "lost to store outages: 120.0 s waited out" in capsys.readouterr().out
    assert summarize(ledger.read()).total.outage_s == 120.0


@pytest.mark.parametrize("where, message", [("missing", "is not a folder"), ("empty", "has no goodput.json"),
                                            ("empty/sft", "sft is a stage folder: give its parent")])
def test_rlhf_goodput_of_a_wrong_folder_is_one_sentence_and_exit_2(tmp_path, capsys, where, message):
    (tmp_path / "empty" / "sft").mkdir(parents=True)
    assert main(["goodput", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_rlhf_plan_uses_the_measured_costs_and_takes_overrides(tmp_path, capsys):
    _recorded_run(tmp_path)
    assert main(["plan", "--ckpt_path", str(tmp_path / "ckpt"), "--run_name", "exp", "--mtbf_hours", "1"]) == 0
    out = capsys.readouterr().out
    # Measured: C = 1 s per chunk, 0.5 s per step, R = 0 s. T = sqrt(2 * 1 * 3600) = 84.85 s -> 170 steps.
    assert "sft: C 1 s per checkpoint (measured), step 0.5 s (measured)" in out
    assert "now:       --save_steps 10 (5 s of work per checkpoint)" in out
    assert "suggested: --save_steps 170 " in out
    expected = 100 * (1 - 1 / 85 - 42.5 / 3600)
    assert f"expected goodput {expected:.2f}%" in out
    assert "snapshots between commits" not in out  # no commit in the store to size them by

    # With a commit of 2 ranks: their DeepSpeed state (not the HF copy) twice over, shared by the ranks.
    from rlhf_core.storage.checkpoint import CheckpointStore

    local = tmp_path / "step-40"
    for name, size in (("actor_model/ds/mp_rank_00_model_states.pt", 3_000_000),
                       ("actor_model/ds/zero_pp_rank_1_mp_rank_00_optim_states.pt", 1_000_000),
                       ("actor_model/hf/model.safetensors", 5_000_000)):
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(b"x" * size)
    CheckpointStore(str(tmp_path / "ckpt" / "exp" / "sft")).commit(40, str(local), {"stage": "sft", "step": 40,
                                                                                     "world_size": 2})
    assert main(["plan", "--ckpt_path", str(tmp_path / "ckpt"), "--run_name", "exp", "--mtbf_hours", "1"]) == 0
    assert ("snapshots between commits (--snapshot_steps): at most 2 per rank in its node's tmpfs, 4.00 MB per rank "
            "on average (8.00 MB for all 2: 2x the DeepSpeed state of step_40)") in capsys.readouterr().out
    assert main(["plan", "--ckpt_path", str(tmp_path / "nothing"), "--mtbf_hours", "1", "--checkpoint_seconds", "2",
                 "--step_seconds", "0.5", "--restart_seconds", "30"]) == 0
    assert "suggested: --save_steps 240 (T = sqrt(2*C*MTBF) = 120 s of work): expected goodput 95.83%" \
        in capsys.readouterr().out


def test_rlhf_plan_without_a_ledger_or_with_bad_numbers_is_exit_2(tmp_path, capsys):
    assert main(["plan", "--ckpt_path", str(tmp_path), "--mtbf_hours", "1"]) == 2
    assert "give --checkpoint_seconds and --step_seconds" in capsys.readouterr().err
    assert main(["plan", "--ckpt_path", str(tmp_path), "--mtbf_hours", "0", "--checkpoint_seconds", "1",
                 "--step_seconds", "1"]) == 2
    assert "--mtbf_hours 0.0 must be a positive number of hours" in capsys.readouterr().err
    assert math.isfinite(plan_interval(1.0, 1.0, 1.0).expected_goodput)


def test_the_stage_report_publishes_the_ledger_as_markdown_and_updates_it_in_place(tmp_path, monkeypatch):
    """flows/stage_report.py: one `{run}-goodput` artifact, created once, then updated."""
    from types import SimpleNamespace

    from flows import stage_report

    url = _recorded_run(tmp_path)
    created, updated = [], []
    monkeypatch.setattr(stage_report, "create_markdown_artifact",
                        lambda **kwargs: created.append(kwargs) or "artifact-id")
    report = stage_report.StageReport.__new__(stage_report.StageReport)  # without Prefect's progress artifact
    report.run = SimpleNamespace(run_name="exp", storage_options={}, run_url=lambda: url)
    report.stage, report._artifact_ids = "sft", {}
    monkeypatch.setattr(report, "_publish", lambda what, data, create: (
        updated.append(data) if what in report._artifact_ids else report._artifact_ids.setdefault(what, create())))
    report.publish_goodput()
    report.publish_goodput()
    assert [kwargs["key"] for kwargs in created] == ["exp-goodput"] and len(updated) == 1
    markdown = created[0]["markdown"]
    assert "**83.3%**" in markdown and "| sft | 83.3% | 40 | 4 |" in markdown and url in markdown
