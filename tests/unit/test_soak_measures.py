"""The chaos soak's arithmetic (tests/soak): its schedule, and how a fault's detection, next step, recomputed
steps and lost commit are read from the evidence, on evidence written by hand."""

from __future__ import annotations

import random

from tests.soak.observe import REPLACED, Evidence, LogLine, Mark, Step
from tests.soak.report import FaultRow, build
from tests.soak.soak import FULL, schedule


def test_the_full_schedule_has_every_kind_of_its_leg_once_at_least_and_gaps_around_the_mean():
    disk = FULL[0]
    planned = schedule(disk, random.Random(0))
    assert len(planned) == disk.num_faults >= 12
    assert set(disk.kinds) <= {kind for _, kind in planned} and len(disk.kinds) >= 7
    gaps = [later - earlier for (earlier, _), (later, _) in zip(planned, planned[1:])]
    assert all(0.5 * disk.mean_interval_s <= gap <= 1.5 * disk.mean_interval_s for gap in gaps)
    assert planned == schedule(disk, random.Random(0))  # seeded


def steps(*rows: tuple[float, int, int, str]) -> list[Step]:
    return [Step(time, pid, step, stage) for time, pid, step, stage in rows]


def test_a_killed_rank_is_timed_from_the_replacement_line_and_counts_the_steps_trained_again():
    evidence = Evidence(
        steps((100.0, 1, 30, "sft"), (100.5, 2, 30, "sft"), (101.0, 2, 31, "sft"),  # 2 trains on after the kill
              (109.0, 3, 17, "sft"), (109.0, 4, 17, "sft")),
        [LogLine(108.5, "WARNING", "Lost rank 0. Replaced the ranks in 7.9 s (2 of 2 from warm spares); ...")],
        [], [])
    assert REPLACED.search(evidence.log[0].message)
    row = FaultRow("disk", "rank_kill", "rank pid 1", 0.0, injected_at=100.5, stage="sft", committed_before=16)
    row.measure(evidence)
    assert (row.detect_s, row.next_step_s, row.steps_recomputed, row.resumed_from) == (0.1, 8.5, 13, 16)  # steps 17-29 again
    assert not row.commit_lost and row.snapshot_k is None  # back to the commit


def test_a_rank_replaced_from_a_snapshot_between_commits_reports_its_k():
    evidence = Evidence(
        steps((100.0, 1, 30, "sft"), (104.0, 3, 29, "sft")),
        [LogLine(103.5, "WARNING", "Lost rank 0. Replaced the ranks in 3.0 s (1 of 1 from warm spares); training again "
                 "from step 28 (a snapshot between commits, taken every 2 steps).")], [], [])
    row = FaultRow("disk", "rank_kill", "rank pid 1", 0.0, injected_at=100.2, stage="sft", committed_before=16)
    row.measure(evidence)
    assert (row.snapshot_k, row.steps_recomputed, row.resumed_from) == (2, 1, 28)


def test_a_faults_recovery_is_split_into_restart_load_and_the_steps_trained_again():
    """From the detection to the next step: to the new rank's set-up (restart), its set-up to its checkpoint loaded
    (load); the steps trained again times the median step before the fault (recompute). A rank kept through the
    fault (a store outage) has neither restart nor load."""
    evidence = Evidence(
        steps((100.0, 1, 28, "sft"), (100.2, 1, 29, "sft"), (100.5, 1, 30, "sft"), (101.0, 1, 31, "sft"),
              (112.0, 3, 25, "sft")),
        [LogLine(110.0, "WARNING", "Lost rank 0. Replaced the ranks in 5.0 s (1 of 1 from warm spares); ...")],
        [], [],
        [Mark(95.0, 3, "setup", 0), Mark(107.0, 3, "setup", 0), Mark(109.5, 3, "loaded", 24)])  # 3: a spare's 2nd
    row = FaultRow("disk", "rank_kill", "rank pid 1", 0.0, injected_at=101.2, stage="sft", committed_before=24)
    row.measure(evidence)
    assert (row.detect_s, row.restart_s, row.load_s, row.next_step_s) == (3.8, 2.0, 2.5, 10.8)
    assert (row.steps_recomputed, row.recompute_s) == (6, 1.8)  # steps 25-30 again, at the median 0.3 s
    outage = FaultRow("s3", "store_outage", "", 0.0, injected_at=101.2, stage="sft")
    outage.measure(Evidence(evidence.steps, [LogLine(103.0, "WARNING", "the store is unreachable")], [], [],
                            evidence.marks))
    assert (outage.restart_s, outage.load_s) == (None, None)


def test_a_run_that_comes_back_before_its_newest_commit_lost_it():
    evidence = Evidence(steps((10.0, 1, 20, "sft"), (60.0, 5, 9, "sft")), [],
                        [(11.0, "CRASHED", "Crashed"), (12.0, "SCHEDULED", "AwaitingRetry")], [])
    row = FaultRow("disk", "power_cut", "", 0.0, injected_at=10.5, stage="sft", committed_before=16)
    row.measure(evidence)
    assert (row.detect_s, row.resumed_from, row.commit_lost) == (0.5, 8, True)
    assert build([row], [], ["create 1"], num_runs=1)["commits_lost"] == 1


def test_a_preemption_is_seen_at_its_state_and_a_killed_worker_at_its_restart():
    evidence = Evidence(steps((10.0, 1, 5, "ppo"), (11.0, 1, 6, "ppo"), (40.0, 7, 6, "ppo")), [],
                        [(12.0, "SCHEDULED", "Preempted"), (20.0, "RUNNING", "Running")], [13.0])
    preempted = FaultRow("disk", "preemption", "", 0.0, injected_at=10.5, stage="ppo", committed_before=4)
    preempted.measure(evidence)
    assert (preempted.detect_s, preempted.next_step_s, preempted.steps_recomputed) == (1.5, 29.5, 0)  # step 6 was in progress
    worker = FaultRow("disk", "worker_kill", "", 0.0, injected_at=10.5, stage="ppo")
    worker.measure(evidence)
    assert (worker.detect_s, worker.next_step_s) == (2.5, 29.5)  # the first step after the restart


def test_a_run_that_died_with_its_worker_trains_again_only_with_new_ranks():
    """Ranks of the dead flow run may train a few steps on: they are not the run training again."""
    evidence = Evidence(steps((10.0, 1, 5, "ppo"), (14.0, 1, 6, "ppo"), (40.0, 7, 6, "ppo")), [],
                        [(15.0, "CRASHED", "Crashed"), (30.0, "RUNNING", "Running")], [11.0])
    worker = FaultRow("disk", "worker_kill", "", 0.0, injected_at=10.5, stage="ppo")
    worker.measure(evidence)
    assert (worker.detect_s, worker.next_step_s) == (0.5, 29.5)


def test_a_dead_runs_ranks_that_serve_its_next_attempt_count_from_their_new_set_up():
    """The killed flow run's ranks train on a step (14.0), stop, and set up again as the next attempt's spares
    (30.0): its next step is theirs after that set-up, and its restart is timed to it."""
    evidence = Evidence(steps((10.0, 1, 5, "ppo"), (14.0, 1, 6, "ppo"), (31.5, 1, 6, "ppo")), [],
                        [(15.0, "CRASHED", "Crashed"), (25.0, "RUNNING", "Running")], [11.0],
                        [Mark(2.0, 1, "setup", 0), Mark(30.0, 1, "setup", 0), Mark(31.0, 1, "loaded", 5)])
    row = FaultRow("disk", "flow_run_kill", "", 0.0, injected_at=10.5, stage="ppo")
    row.measure(evidence)
    assert (row.next_step_s, row.restart_s, row.load_s) == (21.0, 30.0 - 10.5 - row.detect_s, 1.0)


def test_a_detection_is_looked_for_only_before_the_next_fault_and_console_lines_are_dated_past_midnight(tmp_path):
    evidence = Evidence(steps((10.0, 1, 5, "sft"), (200.0, 9, 5, "sft")),
                        [LogLine(150.0, "WARNING", "rank 1 hung ... Replaced the ranks in 9.0 s (...)")], [], [])
    lost_lines = FaultRow("disk", "node_loss", "", 0.0, injected_at=20.0, stage="sft")
    lost_lines.measure(evidence, until=100.0)  # its line went with a power cut at 100 s; 150 s is the next fault's
    assert lost_lines.detect_s is None
    log = tmp_path / "worker.log"
    log.write_text("23:59:59.500 | INFO    | prefect - before\n00:00:01.250 | WARNING | rlhf_core.x - after midnight\n")
    from datetime import datetime

    from tests.soak.observe import read_console

    since = datetime(2026, 12, 4, 23, 59, 59).timestamp()
    lines = read_console(log, since)
    assert [(round(line.time - since, 2), line.level, line.message) for line in lines] == [
        (0.5, "INFO", "before"), (2.25, "WARNING", "after midnight")]


def test_the_trace_is_read_as_it_grows_and_a_half_written_line_waits_for_its_end(tmp_path):
    from tests.soak.observe import Trace, read_trace

    path = tmp_path / "trace.txt"
    trace = Trace(path)
    assert trace.read() == []  # not there yet
    path.write_text("1.0 5 train_step@1 sft\n1.5 5 collective@2 -\n2.0 5 train_st")
    assert [step.step for step in trace.read()] == [1]
    with open(path, "a") as more:
        more.write("ep@2 sft\n2.5 6 setup@0 sft\n3.0 6 loaded@16 sft\n")
    assert trace.read() == read_trace(path) and [step.step for step in trace.steps] == [1, 2]
    assert trace.marks == [Mark(2.5, 6, "setup", 0), Mark(3.0, 6, "loaded", 16)]
