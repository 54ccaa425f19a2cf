"""SIGTERM and Ctrl-C stop `rlhf train sft` cleanly: the step in progress commits, the run exits with one line,
Prefect calls it Cancelled and retries nothing, nothing of the run is left running, and the same command
resumes bit-exact.

Real process trees: the CLI, Prefect (a real server for the SIGTERM test, whose run states it then reads;
the CLI's ephemeral server for the Ctrl-C tests, which is what dies of a terminal's Ctrl-C when nothing shields
it), a local Ray cluster and DeepSpeed. Ctrl-C is a real one: the run's terminal is a pty whose foreground
process group is the run's, and the test types ^C into it. A fault hook pauses rank 0 before step 8 (steps
1-5 are committed; the chunk being trained ends at 10), so the signal lands mid-chunk deterministically.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import subprocess
import termios
import time
import urllib.request
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import RLHF, run_rlhf
from tests.integration.conftest import PAUSED_ON_PURPOSE, _processes, train_sft_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rlhf_env(ephemeral_rlhf_env) -> dict[str, str]:
    """Ctrl-C reaches the ephemeral server a terminal shares with the CLI: tested on that path."""
    return ephemeral_rlhf_env

PAUSED = "train_step@8"
HANG_GUARD_S = 300  # not a speed check: a run that never exits fails instead of hanging the suite


def _paused_env(env: dict[str, str], faults: Path, seconds: float) -> dict[str, str]:
    faults.mkdir(exist_ok=True)
    return {**env, "RLHF_FAULT_INJECT": f"{PAUSED}=sleep:{seconds:g}", "RLHF_FAULT_STATE": str(faults),
            "TERM": "xterm"}


def _wait_until_paused(ckpt: Path, faults: Path, process: subprocess.Popen, read=lambda: None) -> None:
    """Until rank 0 sleeps before step 8 and step 5 is committed."""
    manifest = ckpt / "rlhf" / "sft" / "step_5" / "MANIFEST.json"
    deadline = time.monotonic() + HANG_GUARD_S
    while not ((faults / PAUSED).exists() and manifest.exists()):
        assert process.poll() is None, f"the run ended (rc {process.returncode}) before it reached step 8"
        assert time.monotonic() < deadline, "the run never reached step 8"
        read()
        time.sleep(0.1)


def _session_left(session_id: int) -> list[int]:
    """Processes still alive in the run's session: the ranks (their own process groups under Ray's raylet),
    Ray's and Prefect's servers all stay in the session of the command that started them."""
    deadline = time.monotonic() + 15  # SIGKILLed processes take a moment to be reaped
    while True:
        left = [pid for pid, (_, _, sid) in _processes().items() if sid == session_id]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _committed_steps(ckpt: Path) -> list[int]:
    listing = subprocess.run([RLHF, "ckpt", "verify", str(ckpt / "rlhf" / "sft"), "--json"], capture_output=True,
                             text=True)
    assert listing.returncode == 0, listing.stdout + listing.stderr
    return [row["step"] for row in json.loads(listing.stdout) if row["status"] == "committed"]


def _api(api_url: str, path: str) -> list[dict]:
    request = urllib.request.Request(f"{api_url}/{path}", data=b"{}", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


class Terminal:
    """A command whose controlling terminal is a pty (as in a terminal emulator): ^C typed into it is a SIGINT
    to the foreground process group, the command's."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.master, slave = pty.openpty()

        def become_session_leader_with_this_terminal() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.process = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env,
                                        preexec_fn=become_session_leader_with_this_terminal)
        os.close(slave)
        self.output = bytearray()

    def read(self, seconds: float = 0.0) -> None:
        end = time.monotonic() + seconds
        while True:
            ready, _, _ = select.select([self.master], [], [], max(0.0, min(0.1, end - time.monotonic())))
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # the other side closed
                    return
                if not chunk:
                    return
                self.output.extend(chunk)
            elif time.monotonic() >= end:
                return

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + HANG_GUARD_S
        while text not in self.text:
            assert self.process.poll() is None, f"exited (rc {self.process.returncode}) before {text!r}:\n{self.text}"
            assert time.monotonic() < deadline, f"{text!r} never appeared:\n{self.text[-3000:]}"
            self.read(0.1)

    def wait_exit(self) -> tuple[int, float]:
        """The exit code, and seconds from now to the exit."""
        started = time.monotonic()
        while self.process.poll() is None:
            assert time.monotonic() - started < HANG_GUARD_S, f"the run did not exit:\n{self.text[-3000:]}"
            self.read(0.1)
        exited = time.monotonic() - started
        self.read(0.5)
        os.close(self.master)
        return self.process.returncode, exited

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")


def test_sigterm_commits_the_step_in_progress_and_the_same_command_resumes_bit_exact(
        toy_assets, rlhf_env, prefect_server, tmp_path, reference_sft_weights):
    ckpt, out, faults = tmp_path / "ckpt", tmp_path / "out", tmp_path / "faults"
    command = [RLHF, *train_sft_args(toy_assets, ckpt, out), *PAUSED_ON_PURPOSE]
    env = {**rlhf_env, "PREFECT_API_URL": prefect_server.api_url}
    # The server is the module's: other tests' runs may be on it (and under pytest-xdist, in flight right now).
    earlier_flow_runs = {flow_run["id"] for flow_run in _api(prefect_server.api_url, "flow_runs/filter")}
    earlier_task_runs = {task_run["id"] for task_run in _api(prefect_server.api_url, "task_runs/filter")}
    run = subprocess.Popen(command, env=_paused_env(env, faults, 3), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    _wait_until_paused(ckpt, faults, run)
    signalled = time.monotonic()
    run.send_signal(signal.SIGTERM)
    output = run.communicate(timeout=HANG_GUARD_S)[0]
    seconds_to_exit = time.monotonic() - signalled
    print(f"SIGTERM to exit: {seconds_to_exit:.1f} s (rank 0 slept up to 3 s of it before step 8)")

    assert run.returncode == 143, output[-3000:]
    line = (f"rlhf: stopped by SIGTERM at step 8; committed step_8 in {ckpt / 'rlhf' / 'sft'}; "
            "run the same command to continue")
    assert output.rstrip().endswith(line), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert _session_left(run.pid) == [], "processes of the stopped run are still alive"
    assert _committed_steps(ckpt) == [5, 8]  # 8 is off the chunk boundaries (5, 10): the emergency commit

    flow_runs = [flow_run for flow_run in _api(prefect_server.api_url, "flow_runs/filter")
                 if flow_run["id"] not in earlier_flow_runs]
    assert sorted(flow_run["state_type"] for flow_run in flow_runs) == ["CANCELLED", "CANCELLED"]
    chunks = {task_run["name"]: task_run for task_run in _api(prefect_server.api_url, "task_runs/filter")
              if task_run["id"] not in earlier_task_runs}
    assert chunks["sft-to-step-10"]["state_type"] == "CANCELLED"
    assert all(task_run["run_count"] <= 1 for task_run in chunks.values()), "Prefect retried a chunk"

    resumed = run_rlhf(train_sft_args(toy_assets, ckpt, out), env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "sft [###" in resumed.stderr and "step 10/32: trained 2 steps" in resumed.stderr, resumed.stderr[-3000:]
    weights = load_file(str(out / "model.safetensors"))
    assert weights.keys() == reference_sft_weights.keys()
    for name, tensor in reference_sft_weights.items():
        assert (weights[name] - tensor).abs().max().item() == 0.0, name
    ledger = json.loads((ckpt / "rlhf" / "goodput.json").read_text())["stages"]["sft"]
    assert (ledger["steps"], ledger["lost_steps"]) == (32, 0), "the emergency commit's steps must count as saved"


def test_ctrl_c_in_a_terminal_commits_the_step_in_progress_and_exits(toy_assets, rlhf_env, tmp_path):
    ckpt, out, faults = tmp_path / "ckpt", tmp_path / "out", tmp_path / "faults"
    terminal = Terminal([RLHF, *train_sft_args(toy_assets, ckpt, out), *PAUSED_ON_PURPOSE],
                        _paused_env(rlhf_env, faults, 3))
    _wait_until_paused(ckpt, faults, terminal.process, terminal.read)
    terminal.ctrl_c()
    rc, seconds_to_exit = terminal.wait_exit()
    print(f"Ctrl-C to exit: {seconds_to_exit:.1f} s")
    assert rc == 130, terminal.text[-3000:]
    assert "SIGINT received: stopping after the current step" in terminal.text
    sentence = (f"stopped by SIGINT at step 8; committed step_8 in {ckpt / 'rlhf' / 'sft'}; run the same "
                "command to continue")
    assert f"rlhf: {sentence}" in terminal.text
    # One line per event: the task's, the stage's and the flow's Cancelled states say it in the log file only.
    # (Counted across white space: Prefect's console handler wraps its lines at the terminal's width.)
    assert len(re.findall(r"stopped\s+by\s+SIGINT\s+at\s+step\s+8", _plain(terminal.text))) == 1, terminal.text[-3000:]
    # Prefect's ephemeral server outlived the Ctrl-C, so the run's end is recorded as Cancelled:
    driver_log = (ckpt / "rlhf" / "logs" / "driver.log").read_text()
    assert driver_log.count(f"prefect.flow_runs - Finished in state Cancelled('{sentence}')") == 2, driver_log[-3000:]
    assert "Traceback" not in terminal.text
    assert _session_left(terminal.process.pid) == []
    assert _committed_steps(ckpt) == [5, 8]


def test_a_second_ctrl_c_leaves_at_once_with_the_last_commit_standing(toy_assets, rlhf_env, tmp_path):
    ckpt, out, faults = tmp_path / "ckpt", tmp_path / "out", tmp_path / "faults"
    terminal = Terminal([RLHF, *train_sft_args(toy_assets, ckpt, out), *PAUSED_ON_PURPOSE],
                        _paused_env(rlhf_env, faults, 600))
    _wait_until_paused(ckpt, faults, terminal.process, terminal.read)
    terminal.ctrl_c()
    terminal.wait_for("Ctrl-C again to leave at once")
    terminal.ctrl_c()
    rc, seconds_to_exit = terminal.wait_exit()  # rank 0 still sleeps: only leaving at once ends the run
    print(f"second Ctrl-C to exit: {seconds_to_exit:.1f} s")
    assert rc == 130, terminal.text[-3000:]
    assert (f"rlhf: stopped by SIGINT (a second stop signal): leaving now; the last commit, step_5 in "
            f"{ckpt / 'rlhf' / 'sft'}, stands; run the same command to continue") in terminal.text
    assert "Traceback" not in terminal.text
    assert _session_left(terminal.process.pid) == [], "the ranks, Ray or Prefect's server outlived the run"
    assert _committed_steps(ckpt) == [5]


def test_a_step_that_cannot_commit_within_the_grace_period_is_abandoned(toy_assets, rlhf_env, tmp_path):
    ckpt, out, faults = tmp_path / "ckpt", tmp_path / "out", tmp_path / "faults"
    command = [RLHF, *train_sft_args(toy_assets, ckpt, out), *PAUSED_ON_PURPOSE, "--stop_grace_s", "8"]
    run = subprocess.Popen(command, env=_paused_env(rlhf_env, faults, 600), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _wait_until_paused(ckpt, faults, run)
    run.send_signal(signal.SIGTERM)
    output = run.communicate(timeout=HANG_GUARD_S)[0]
    assert run.returncode == 143, output[-3000:]
    assert ("its emergency checkpoint did not fit in --stop_grace_s 8, so the last commit, step_5 in "
            f"{ckpt / 'rlhf' / 'sft'}, stands; run the same command to continue") in output, output[-3000:]
    assert "Traceback" not in output
    assert _session_left(run.pid) == []
    assert _committed_steps(ckpt) == [5]
    assert not list((ckpt / "rlhf" / "sft").glob(".tmp_*")), "the abandoned step's staging was left behind"


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)


def test_sigterm_while_the_run_starts_stops_it_before_training_with_nothing_left(toy_assets, rlhf_env, tmp_path):
    """SIGTERM as soon as the console says the run is real: it lands while Prefect's server and Ray start
    (ray.init installs a SIGTERM handler of its own that exited mid-start with code 15, leaving gcs_server)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    run = subprocess.Popen([RLHF, *train_sft_args(toy_assets, ckpt, out)], env=rlhf_env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in run.stdout:
        lines.append(line)
        if "full log (Ray actors" in line:
            run.send_signal(signal.SIGTERM)
            break
    output = "".join(lines) + run.communicate(timeout=HANG_GUARD_S)[0]
    assert run.returncode == 143, output[-3000:]
    assert output.rstrip().endswith("rlhf: stopped by SIGTERM before any step of sft was committed; run the same "
                                    "command to start"), output[-3000:]
    assert "Traceback" not in output
    assert _session_left(run.pid) == []


def test_ctrl_c_during_a_long_evaluation_stops_it_and_commits_the_steps_trained(toy_assets, rlhf_env, tmp_path):
    """An evaluation of 40,000 rows at step 7 (its batch 2 paused, so the ^C lands inside it): its progress shows
    as a bar, and the ^C ends it at the next batch, so the step commits within --stop_grace_s 10 (the whole
    evaluation takes longer than that here; without the stop inside it the step is abandoned)."""
    ckpt, out, faults = tmp_path / "ckpt", tmp_path / "out", tmp_path / "faults"
    rows = Path(toy_assets["sft"]).read_text().splitlines(keepends=True)
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text("".join(rows[index % len(rows)] for index in range(40_000)))
    faults.mkdir()
    env = {**rlhf_env, "RLHF_FAULT_INJECT": "eval_batch@2=sleep:3", "RLHF_FAULT_STATE": str(faults), "TERM": "xterm"}
    terminal = Terminal([RLHF, *train_sft_args(toy_assets, ckpt, out), *PAUSED_ON_PURPOSE, "--eval_dataset",
                         str(eval_data), "--eval_steps", "7", "--stop_grace_s", "10"], env)
    deadline = time.monotonic() + HANG_GUARD_S
    while not (faults / "eval_batch@2").exists():
        assert terminal.process.poll() is None, f"the run ended before its evaluation:\n{terminal.text[-3000:]}"
        assert time.monotonic() < deadline, "the run never evaluated"
        terminal.read(0.1)
    terminal.wait_for("sft evaluating [")
    terminal.ctrl_c()
    rc, seconds_to_exit = terminal.wait_exit()
    print(f"Ctrl-C during the evaluation to exit: {seconds_to_exit:.1f} s")
    assert rc == 130, terminal.text[-3000:]
    assert (f"rlhf: stopped by SIGINT at step 7; committed step_7 in {ckpt / 'rlhf' / 'sft'}; run the same "
            "command to continue") in terminal.text, terminal.text[-3000:]
    assert "Traceback" not in terminal.text
    assert _committed_steps(ckpt) == [5, 7]
