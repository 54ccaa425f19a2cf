"""rlhf_core.driver.hang: the progress deadline of each rank, the rank blamed, and the frame named; the goodput
ledger's time lost to hangs. The hung rank end to end is tests/integration/test_hang.py."""

from __future__ import annotations

import pytest

from rlhf_core.driver import hang
from rlhf_core.ops import goodput
from rlhf_core.ops.goodput_summary import format_summary, summarize


def test_the_deadline_follows_the_slowest_step_once_only_steps_are_in_flight():
    assert hang.deadline_s(hang.RankProgress(phases=("train",), slowest_step_s=0.0), None) == hang.STARTUP_HANG_S
    assert hang.deadline_s(hang.RankProgress(phases=("train",), slowest_step_s=2.0), None) == 60.0
    assert hang.deadline_s(hang.RankProgress(phases=("train",), slowest_step_s=30.0), None) == 150.0
    assert hang.deadline_s(hang.RankProgress(phases=("train", "write"), slowest_step_s=2.0), None) == \
        hang.STARTUP_HANG_S  # an upload of a large checkpoint beside training


def test_steps_the_driver_saw_come_back_count_when_the_rank_stopped_before_telling():
    """Toy steps take 0.1 s: a chunk's steps can return between two heartbeats, and the rank stop before the next
    one answers. The deadline is then the steady one, from the steps' own timings."""
    silent = hang.RankProgress(phases=("setup",), slowest_step_s=0.0)
    assert hang.deadline_s(silent, 20.0) == hang.STARTUP_HANG_S
    assert hang.deadline_s(silent, 20.0, slowest_step_s=0.1) == 20.0
    watch = hang.HangWatch([FakeWorker()], timeout_s=20.0)
    watch.steps_returned([0.1, 0.3, 0.2], reached=5)
    assert watch.slowest_step_s == 0.3
    assert watch.step_of(0) == 5  # a rank that never answered is named at the step its results came back from


def test_the_users_timeout_holds_after_the_first_step_and_never_shortens_the_start_up():
    assert hang.deadline_s(hang.RankProgress(phases=("train", "write"), slowest_step_s=2.0), 7.0) == 7.0
    assert hang.deadline_s(hang.RankProgress(phases=("setup",), slowest_step_s=0.0), 7.0) == hang.STARTUP_HANG_S
    assert hang.deadline_s(hang.RankProgress(phases=("setup",), slowest_step_s=0.0), 5000.0) == 5000.0


class FakeRef:
    def __init__(self, answer):
        self.answer = answer


class FakeWorker:
    """A rank whose heartbeat answers with its count, or never (`stopped`), the pieces of long work in its step
    and the last step it finished."""

    def __init__(self):
        self.count, self.stopped, self.pieces, self.steps_done = 0, False, {}, 0
        self.heartbeat = self

    def remote(self):
        return FakeRef(None if self.stopped else (self.count, ("train",), 1.0, dict(self.pieces), self.steps_done))


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.setattr(hang.ray, "wait", lambda refs, timeout: ([r for r in refs if r.answer is not None], []))
    monkeypatch.setattr(hang.ray, "get", lambda ref: ref.answer)


def test_a_rank_that_stops_answering_is_blamed_not_its_peer_waiting_in_the_collective(fake_ray):
    now = [0.0]
    workers = [FakeWorker(), FakeWorker()]
    watch = hang.HangWatch(workers, timeout_s=10.0, clock=lambda: now[0])
    watch.restart()
    for second in range(1, 9):  # both ranks train (steps of 1 s): their counts move
        now[0] = float(second)
        for worker in workers:
            worker.count += 1
        assert watch.poll() is None
    workers[1].stopped = True  # rank 1 stops; rank 0 waits for it in the next collective, still answering
    for second in range(9, 19):
        now[0] = float(second)
        assert watch.poll() is None, f"taken for hung at {second} s, within the 10 s deadline"
    now[0] = 20.0
    hung = watch.poll()
    assert hung is not None and hung.rank == 1 and hung.stalled_s > 10 and hung.deadline_s == 10.0
    assert not hung.answering and hung.describe() == "made no progress for 11 s (not answering; --hang_timeout_s 10)"


def test_time_the_driver_spent_elsewhere_does_not_count(fake_ray):
    now = [0.0]
    watch = hang.HangWatch([FakeWorker()], timeout_s=10.0, clock=lambda: now[0])
    watch.restart()
    for second in (1.0, 2.0):
        now[0] = second
        assert watch.poll() is None  # asked, then answered: a step of 1 s measured, its count known
    now[0] = 100.0  # the driver committed for 100 s while the rank stood idle
    watch.restart()  # the next wait on the ranks
    now[0] = 105.0
    assert watch.poll() is None


DUMP = """Process 4242: ray::TrainWorker.train_until
Python v3.11.7 (/usr/bin/python3.11)

Thread 4249 (idle): "Thread-4 (io)"
    StoreWrites.upload_tree (/work/rlhf_core/storage/commit.py:141)
    TrainWorker.write_snapshot (/work/rlhf_core/rank/worker.py:280)
Thread 4250 (idle): "Thread-3 (control)"
    heartbeat (/work/rlhf_core/rank/worker.py:121)
    _run (ray/_private/worker.py:900)
Thread 4251 (idle): "Thread-2 (default)"
    wait (torch/distributed/distributed_c10d.py:4100)
    all_reduce (torch/distributed/distributed_c10d.py:2500)
    max_over_ranks (/work/rlhf_core/rank/collectives.py:40)
    _stop_agreed (/work/rlhf_core/rank/worker.py:223)
    TrainWorker.train_until (/work/rlhf_core/rank/worker.py:199)
    _inject_tracing_into_class.<locals>.span_wrapper.<locals>._resume_span (ray/util/tracing/tracing_helper.py:487)
"""


def test_the_frame_named_is_our_innermost_one_in_the_busy_thread():
    assert hang.stuck_frame(DUMP) == "max_over_ranks (rank/collectives.py:40)"
    joining = "Thread 9 (idle): \"Dummy-1\"\n    init_distributed (deepspeed/comm/comm.py:910)\n" \
              "    TrainWorker.join (/w/rlhf_core/rank/worker.py:167)\n"
    assert hang.stuck_frame(joining) == "TrainWorker.join (rank/worker.py:167)"
    assert hang.stuck_frame("py-spy dump --pid 1 failed: no such process") is None


def test_the_time_of_a_chunk_lost_to_a_hang_is_its_own_line_in_rlhf_goodput():
    doc = goodput.empty_ledger()
    attempt = goodput.begin_attempt(doc, "a", 0.0)
    goodput.start_chunk(doc, attempt, "sft", 5, 10, 10.0)
    goodput.fail_chunk(doc, attempt, "sft", "hangs")
    goodput.start_chunk(doc, attempt, "sft", 5, 10, 75.0)  # the retry trains the chunk again
    goodput.commit_chunk(doc, attempt, goodput.CommittedChunk("sft", 10, {"train": 3.0}, num_steps=5), 80.0)
    goodput.finish_attempt(doc, attempt, 81.0)
    summary = summarize(doc)
    assert summary.total.lost_to == {"hangs": 65.0}
    assert "lost to hangs: 65.0 s" in format_summary(summary, "/ckpt/rlhf")


def test_a_rank_working_past_the_timeout_in_pieces_is_not_hung_and_a_hang_names_its_step(fake_ray):
    """An evaluation (or a rollout) of 30 s inside step 5, under a 10-s deadline: each piece it finishes moves the
    rank's count, so it is no hang. When its pieces stop coming, it is, at step 5."""
    now = [0.0]
    worker = FakeWorker()
    watch = hang.HangWatch([worker], timeout_s=10.0, clock=lambda: now[0])
    watch.restart()
    worker.steps_done = 4
    for second in range(1, 31):
        now[0] = float(second)
        worker.count += 1  # a piece (`Progress.piece_done`), no step
        worker.pieces = {"eval": (second, 100)}
        assert watch.poll() is None, f"taken for hung at {second} s while its pieces moved"
    assert watch.pieces() == {"eval": (29, 100)}  # the answer of the second before (a heartbeat's round trip)
    now[0] = 31.0
    assert watch.poll() is None  # its last piece's answer comes in
    now[0] = 42.0
    hung = watch.poll()
    assert hung is not None and hung.step == 5 and hung.answering and watch.step_of(0) == 5


def test_a_rollout_tells_its_token_blocks_and_samples_the_same_tokens(tmp_path):
    """PPO's generation with transformers: every TOKEN_BLOCK new tokens of a micro-batch is a piece of work
    (`GenerationPieces`, phase "generate"), the last one clears it; the samples are those drawn without it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlhf_core.rank import rollout

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=64, n_embd=16, n_layer=1, n_head=2)).eval()
    prompts, heard = [[5, 6, 7], [8, 9]], []

    class Signals:
        def work_done(self, phase, done, total):
            heard.append((phase, done, total))

    def sample(on_tokens=None):
        torch.manual_seed(1)
        return rollout.generate(model, prompts, 0, 39, rollout.SamplingSettings(20, 1.0, 1.0), on_tokens=on_tokens)

    pieces = rollout.GenerationPieces(Signals(), parts=2, tokens_per_part=20)
    with_pieces = sample(pieces.tokens)
    pieces.part_done()
    assert with_pieces == sample() and max(map(len, with_pieces)) == 20  # no EOS (39 is never likelier here)
    assert heard == [("generate", 8, 40), ("generate", 16, 40), ("generate", 20, 40)]
    pieces.tokens(8)
    pieces.part_done()
    assert heard[-2:] == [("generate", 28, 40), ("generate", 40, 40)]  # done == total: the phase ends
