"""Ranks that outlive their command on a running Ray cluster (`rlhf_core.driver.lingering`), end to end: toy SFT
commands on a Ray head of this module's own (so no other module's spares are there), two ranks each. The resets
themselves are tested one by one in tests/unit/test_rank_reuse.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import RLHF, run_rlhf
from tests.integration.conftest import ray_head

pytestmark = pytest.mark.slow

CLAIMED = re.compile(r"placed \d+ of \d+ ranks .*; (\d+) from spare processes of an earlier command")
RANK_PID = re.compile(r"\(TrainWorker pid=(\d+)")
# A command's warm spares (driver/spares.py) start once its group is 30 s old: on a loaded machine these toy commands
# reach that, and the spares' pids would join the ranks' in the log. The ranks are what outlive a command here.
NO_WARM_SPARES = ["--num_spare_workers", "0"]


@pytest.fixture(scope="module")
def head_env(rlhf_env, tmp_path_factory):
    with ray_head(rlhf_env, tmp_path_factory.mktemp("lingering-ray") / "head.log") as address:
        yield {**rlhf_env, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"}


def sft(toy: dict[str, str], folder: Path, *extra: str) -> list[str]:
    return ["train", "sft", "--pretrain", toy["model"], "--dataset", toy["sft"], "--input_key", "prompt",
            "--output_key", "response", "--max_len", "64", "--max_samples", "32", "--train_batch_size", "8",
            "--micro_train_batch_size", "4", "--max_epochs", "1", "--learning_rate", "1e-3", "--save_steps", "2",
            "--ckpt_path", str(folder / "ckpt"), "--save_path", str(folder / "model"), "--seed", "42",
            "--num_workers", "2", "--num_cpus_per_worker", "1", *NO_WARM_SPARES, *extra]


def ran(args: list[str], env: dict[str, str]) -> tuple[str, set[int]]:
    """The command's driver log, and the pids of the ranks that trained it (their output, in that log)."""
    result = run_rlhf(args, env)
    log = (Path(args[args.index("--ckpt_path") + 1]) / "rlhf" / "logs" / "driver.log").read_text()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return log, {int(pid) for pid in RANK_PID.findall(log)}


def claimed(log: str) -> int:
    found = CLAIMED.search(log)
    return int(found.group(1)) if found else 0


def weights(folder: Path) -> dict:
    return {name: tensor for path in sorted((folder / "model").glob("*.safetensors"))
            for name, tensor in load_file(path).items()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def wait_until_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s  # a guard against waiting for ever, not a speed check
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return {pid for pid in pids if alive(pid)}


def test_the_next_command_trains_on_the_last_ones_ranks_bit_exactly_and_only_with_its_environment(
        head_env, toy_assets, tmp_path):
    _, first_pids = ran(sft(toy_assets, tmp_path / "first"), head_env)
    assert len(first_pids) == 2

    # Test fault hooks are no part of the environment: the spares take this command's, and its rule fires in them.
    (tmp_path / "faults").mkdir()
    hooked = {**head_env, "RLHF_FAULT_INJECT": "train_step@2=sleep:0", "RLHF_FAULT_STATE": str(tmp_path / "faults")}
    again_log, again_pids = ran(sft(toy_assets, tmp_path / "again"), hooked)
    assert claimed(again_log) == 2 and again_pids == first_pids, again_log[-3000:]
    assert (tmp_path / "faults" / "train_step@2").exists()
    expected, actual = weights(tmp_path / "first"), weights(tmp_path / "again")
    assert expected.keys() == actual.keys() and all((expected[name] == actual[name]).all() for name in expected)

    # Other credentials: a job never runs in a process another job's credentials started.
    other = {**head_env, "AWS_ACCESS_KEY_ID": "another-team", "AWS_SECRET_ACCESS_KEY": "their-secret"}
    other_log, other_pids = ran(sft(toy_assets, tmp_path / "other"), other)
    assert claimed(other_log) == 0 and not other_pids & first_pids
    # At most one process per CPU of the node (2): the spares idle longest, the first environment's, end.
    left = wait_until_gone(first_pids, 30)
    assert left == set() and all(alive(pid) for pid in other_pids), \
        (left, {pid: alive(pid) for pid in other_pids}, other_log[-3000:])


def test_spares_end_after_their_idle_time_and_ranks_end_with_a_killed_command(head_env, toy_assets, tmp_path):
    log, pids = ran(sft(toy_assets, tmp_path / "short", "--spare_idle_s", "2"), head_env)
    assert len(pids) == 2 and all(alive(pid) for pid in pids)  # spares now
    assert wait_until_gone(pids, 60) == set()

    # A command killed mid-chunk: its ranks (detached actors, which Ray would keep) end themselves.
    faults = tmp_path / "faults"
    faults.mkdir()
    env = {**head_env, "RLHF_FAULT_INJECT": "train_step@3=sleep:600", "RLHF_FAULT_STATE": str(faults),
           "RLHF_FAULT_TRACE": str(faults / "trace")}
    killed = subprocess.Popen([RLHF, *sft(toy_assets, tmp_path / "killed", "--hang_timeout_s", "3600")], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (faults / "train_step@3").exists():
            assert killed.poll() is None and time.monotonic() < deadline, "the paused step was never reached"
            time.sleep(0.2)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    ranks = {int(line.split()[1]) for line in (faults / "trace").read_text().splitlines() if " train_step@" in line}
    assert len(ranks) == 2 and wait_until_gone(ranks, 60) == set()


def test_ranks_of_a_command_killed_then_stopped_mid_chunk_serve_the_same_command_run_again(head_env, toy_assets,
                                                                                          tmp_path):
    """The driver alone SIGKILLed (as the OOM killer would) while a rank pauses in step 4, then, run again, stopped by
    SIGTERM (a preemption: it commits and leaves) while a rank pauses in step 6: each time its ranks stop at the next
    step they agree on and reset, and the same command run again at once (a flow run started again by its
    supervisor, or rescheduled) trains on them, waiting for their reset rather than starting new processes. The
    commands share one log file: each is read from where the last one ended."""
    args = sft(toy_assets, tmp_path / "run")
    args[args.index("--max_samples") + 1] = "64"  # 8 steps
    log_path = tmp_path / "run" / "ckpt" / "rlhf" / "logs" / "driver.log"
    first = interrupted(args, head_env, tmp_path / "faults-kill", "train_step@4=sleep:3", signal.SIGKILL)
    read = log_path.read_text()
    second = interrupted([*args, "--load_checkpoint"], head_env, tmp_path / "faults-stop", "train_step@6=sleep:3",
                         signal.SIGTERM)
    stopped_log = log_path.read_text()[len(read):]
    assert len(first) == 2 and claimed(stopped_log) == 2 and second == first, stopped_log[-3000:]
    assert "stopped by SIGTERM at step 6" in stopped_log, stopped_log[-3000:]
    read = log_path.read_text()
    ran([*args, "--load_checkpoint"], head_env)
    last_log = log_path.read_text()[len(read):]
    assert claimed(last_log) == 2 and {int(pid) for pid in RANK_PID.findall(last_log)} <= first, last_log[-3000:]


def interrupted(args: list[str], env: dict[str, str], faults: Path, rule: str, stop: int) -> set[int]:
    """Run `args` with the fault `rule`, send the driver alone `stop` once the rule fired, wait for it to end; the
    pids of the ranks that trained."""
    faults.mkdir()
    env = {**env, "RLHF_FAULT_INJECT": rule, "RLHF_FAULT_STATE": str(faults), "RLHF_FAULT_TRACE": str(faults / "trace")}
    marker = faults / rule.split("=", 1)[0]
    driver = subprocess.Popen([RLHF, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # a hang guard, not a speed check
        while not marker.exists():
            assert driver.poll() is None and time.monotonic() < deadline, f"{marker.name} was never reached"
            time.sleep(0.1)
    finally:
        driver.send_signal(stop)  # the driver, not its group: the ranks are Ray's processes anyway
        driver.wait(timeout=120)
    return {int(line.split()[1]) for line in (faults / "trace").read_text().splitlines() if " train_step@" in line}
