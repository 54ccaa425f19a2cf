"""The fault hook (`rlhf_core.faults`): rules fire once, and never in a rank whose job is already dead; an action a
process registers (a rank's `nan`) fires at its point as the built-in ones do."""

from __future__ import annotations

import os
import subprocess
import sys

from rlhf_core import faults


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_rule_fires_once_per_state_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "train_step@3=sleep:0")
    monkeypatch.setenv(faults.STATE_ENV_VAR, str(tmp_path))
    faults.fault_point("train_step", 2)
    assert not (tmp_path / "train_step@3").exists()
    faults.fault_point("train_step", 3)
    assert (tmp_path / "train_step@3").exists()


def test_a_rank_of_a_dead_job_fires_nothing_and_leaves_the_rule_for_the_next_run(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "train_step@8=kill")  # would SIGKILL this process if it fired
    monkeypatch.setenv(faults.STATE_ENV_VAR, str(tmp_path))
    monkeypatch.setenv(faults.JOB_PID_ENV_VAR, str(dead_pid()))
    faults.fault_point("train_step", 8)
    assert not (tmp_path / "train_step@8").exists()
    monkeypatch.setenv(faults.JOB_PID_ENV_VAR, str(os.getpid()))  # the job itself: not orphaned
    monkeypatch.setenv(faults.ENV_VAR, "train_step@8=sleep:0")
    faults.fault_point("train_step", 8)
    assert (tmp_path / "train_step@8").exists()


def test_after_waits_for_another_processs_point_to_fire(tmp_path, monkeypatch):
    import threading
    import time

    monkeypatch.setenv(faults.ENV_VAR, "after_commit@5=sleep:0,train_step@6=after:after_commit@5")
    monkeypatch.setenv(faults.STATE_ENV_VAR, str(tmp_path))
    waiter = threading.Thread(target=faults.fault_point, args=("train_step", 6))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # the driver's commit has not happened: the rank waits at its step
    faults.fault_point("after_commit", 5)
    waiter.join(timeout=10)
    assert not waiter.is_alive()

    monkeypatch.delenv(faults.STATE_ENV_VAR)  # no rule leaves a marker then: nothing to wait for
    unmarked = threading.Thread(target=faults.fault_point, args=("train_step", 6))
    unmarked.start()
    unmarked.join(timeout=10)  # a guard against MARKER_WAIT_S, not a speed check
    assert not unmarked.is_alive()


def test_the_trace_names_every_point_reached_with_its_process_without_any_rule(tmp_path, monkeypatch):
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    monkeypatch.setenv(faults.TRACE_ENV_VAR, str(tmp_path / "trace"))
    faults.fault_point("train_step", 1, tag="sft")
    faults.fault_point("collective", 1)
    lines = [line.split() for line in (tmp_path / "trace").read_text().splitlines()]
    assert [line[1:] for line in lines] == [[str(os.getpid()), "train_step@1", "sft"],
                                            [str(os.getpid()), "collective@1", "-"]]
    assert all(float(line[0]) > 0 for line in lines)


def test_an_armed_action_fires_once_at_the_next_point_of_its_process_only(tmp_path, monkeypatch):
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    monkeypatch.setenv(faults.STATE_ENV_VAR, str(tmp_path))
    (tmp_path / f"armed-{os.getpid() + 1}").write_text("kill")  # another process's: would SIGKILL this one
    (tmp_path / f"armed-{os.getpid()}").write_text("sleep:0")
    faults.fault_point("train_step", 3)
    assert not (tmp_path / f"armed-{os.getpid()}").exists() and (tmp_path / f"armed-{os.getpid() + 1}").exists()


def test_an_armed_oom_is_killed_by_the_kernel_under_a_memory_limit(tmp_path):
    """What the soak's `oom` fault does to a rank: a limit on its cgroup, then its next step allocates."""
    import pytest

    from tests.soak.kinds import _memory_cgroup

    group = _memory_cgroup(os.getpid()) / f"rlhf-test-oom-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"no memory cgroup to make here: {error}")
    try:
        limit = "memory.max" if (group / "memory.max").exists() else "memory.limit_in_bytes"
        (group / limit).write_text(str(16 << 20))
        child = subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stdin.readline()\n"
                                  "from rlhf_core.faults import fault_point\nfault_point('train_step', 1)\n"
                                  "print('survived')"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 env={**os.environ, faults.STATE_ENV_VAR: str(tmp_path)}, text=True)
        (group / "cgroup.procs").write_text(str(child.pid))
        (tmp_path / f"armed-{child.pid}").write_text("oom")
        output, _ = child.communicate("go\n", timeout=60)
        assert child.returncode == -9 and "survived" not in output  # SIGKILL: the kernel's OOM killer
    finally:
        group.rmdir()


class HeardPieces:
    def __init__(self):
        self.pieces: list[tuple[str, int, int]] = []

    def work_done(self, phase: str, done: int, total: int) -> None:
        self.pieces.append((phase, done, total))


def test_slow_work_tells_its_pieces_to_the_trainers_signals(monkeypatch):
    """`slow:S`: S seconds of work that moves, in pieces of SLOW_PIECE_S told as a long evaluation tells its
    batches (the hang watch's progress); `sleep:S` is a stall that tells nothing."""
    monkeypatch.setenv(faults.ENV_VAR, "train_step@3=slow:0.2,train_step@4=sleep:0")
    monkeypatch.setattr(faults, "SLOW_PIECE_S", 0.05)
    heard = HeardPieces()
    faults.fault_point("train_step", 3, signals=heard)
    assert heard.pieces == [("eval", done, 4) for done in range(1, 5)]
    faults.fault_point("train_step", 4, signals=heard)
    assert len(heard.pieces) == 4


def test_a_registered_action_fires_at_its_point_once(tmp_path, monkeypatch):
    monkeypatch.setattr(faults, "_REGISTERED", {})
    monkeypatch.setenv(faults.ENV_VAR, "train_step@3=nan")
    monkeypatch.setenv(faults.STATE_ENV_VAR, str(tmp_path))
    fired: list[int] = []
    faults.register_action("nan", lambda: fired.append(1))
    faults.fault_point("train_step", 2)
    faults.fault_point("collective", 3)
    assert fired == []
    faults.fault_point("train_step", 3)
    faults.fault_point("train_step", 3)
    assert fired == [1]


def test_the_ranks_nan_action_makes_the_next_loss_non_finite():
    """What `train_step@8=nan` does in a rank (registered by `TrainWorker.setup`): the step's loss, computed as
    before by the stage's own loss code, comes out non-finite; the commit then refuses the chunk and alerts
    (tests/integration/test_alerts_pipeline.py)."""
    import torch

    from rlhf_core.rank.worker import poison_weights

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    tokens = torch.tensor([[1, 2, 3]])

    def loss() -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())

    assert torch.isfinite(loss())
    poison_weights([model])
    assert not torch.isfinite(loss())
