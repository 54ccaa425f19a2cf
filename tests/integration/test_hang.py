"""A hung rank is caught: the rank SIGSTOPs itself inside the second chunk (`train_step@8=hang`, as a stuck
collective or a dead mount would leave it), the driver sees its progress stand still past --hang_timeout_s, saves
its stacks, says so in one line, records the alert and the lost time, replaces the ranks in place (no Prefect retry)
from the newest snapshot between commits, and the chunk, trained on, ends the run bit-exact.
Before hang detection this run waited in `ray.get` for ever.
Long work that reports its pieces is no hang, and a stall that comes back at the same step in the same frame on new
ranks stops the run after 3 replacements, with one sentence and no retry."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import run_rlhf
from tests.integration.conftest import AFTER_THE_STEP_5_COMMIT, train_sft_args

pytestmark = pytest.mark.slow

HANG_TIMEOUT_S = 20  # above a toy step's worst on a loaded 2-core machine, set-up included


def test_a_hung_rank_is_caught_its_stacks_saved_and_the_run_ends_exact(toy_assets, rlhf_env, reference_sft_weights,
                                                                        tmp_path):
    (tmp_path / "faults").mkdir()
    env = {**rlhf_env, "RLHF_FAULT_INJECT": f"{AFTER_THE_STEP_5_COMMIT},train_step@8=hang",
           "RLHF_FAULT_STATE": str(tmp_path / "faults")}
    args = train_sft_args(toy_assets, tmp_path / "ckpt", tmp_path / "out") + ["--hang_timeout_s", str(HANG_TIMEOUT_S),
                                                                              "--snapshot_steps", "2"]
    run = run_rlhf(args, env, timeout=900)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert (tmp_path / "faults" / "train_step@8").exists(), "the fault never fired"

    lines = [line for line in log.splitlines() if "made no progress" in line]
    assert len(lines) == 1, log[-4000:]
    assert "Replaced the ranks in" in lines[0], lines[0]  # in place, no Prefect retry: one console line for the hang
    # Back to the newest snapshot between commits (one every 2 steps: 2, 4, 6), not to the step-5 commit.
    assert "training again from step 6 (a snapshot between commits, taken every 2 steps)." in lines[0], lines[0]
    assert "Retry 1/2" not in log, log[-4000:]
    assert re.search(r"rank 0 on node .* made no progress for \d+ s \(not answering; --hang_timeout_s 20\) at step "
                     r"\d+, stuck in \S+ \(\S+\.py:\d+\)", lines[0]), lines[0]  # where SIGSTOP found the training thread
    stacks = Path(re.search(r"stacks and the driver's are in (\S+)\. Replaced", lines[0]).group(1))
    text = stacks.read_text()
    assert "==== rank 0 ====" in text and "TrainWorker.train_until" in text and "the driver's threads" in text

    alerts = [json.loads(line) for line in (tmp_path / "ckpt" / "rlhf" / "alerts.jsonl").read_text().splitlines()]
    assert [(alert["name"], alert["stage"], alert["details"]["rank"]) for alert in alerts] == \
        [("rlhf.alert.hang", "sft", 0)]

    goodput = run_rlhf(["goodput", str(tmp_path / "ckpt" / "rlhf")], rlhf_env)
    seconds = float(re.search(r"lost to hangs: ([\d.]+) s", goodput.stdout).group(1))
    assert seconds >= HANG_TIMEOUT_S, goodput.stdout
    assert "ranks replaced in place: 1 time(s)" in goodput.stdout, goodput.stdout

    actual = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, tensor in reference_sft_weights.items():
        assert actual[name].equal(tensor), f"{name} differs from the uninterrupted run"


STALL_TIMEOUT_S = 4  # short, so the four tries of the stall cost little; a toy step takes well under a second


def test_long_work_in_pieces_is_no_hang_and_a_stall_at_the_same_step_stops_the_run(toy_assets, rlhf_env, tmp_path):
    """Step 3 works for twice --hang_timeout_s, telling its pieces as a long evaluation does (`slow`): no hang.
    Step 7 stalls on every try, still answering heartbeats (`sleep`, as a loop or a lock would): after 3
    replacements the run stops Failed with one sentence (the step, the frame, each try's time, the flag to raise),
    and no Prefect retry starts it again."""
    env = {**rlhf_env, "RLHF_FAULT_INJECT": f"train_step@3=slow:{2 * STALL_TIMEOUT_S},train_step@7=sleep:3600"}
    args = train_sft_args(toy_assets, tmp_path / "ckpt", tmp_path / "out") + ["--hang_timeout_s", str(STALL_TIMEOUT_S)]
    run = run_rlhf(args, env, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 1, log[-4000:]

    hangs = [line for line in log.splitlines() if "made no progress" in line and "Replaced the ranks in" in line]
    assert len(hangs) == 3 and all(" at step 7, stuck in _act (faults.py:" in line for line in hangs), log[-4000:]
    assert "at step 3" not in log, log[-4000:]  # the slow step moved: no hang
    stop = re.search(r"rlhf: error: sft stalled at step 7 in _act \(faults\.py:\d+\) on 4 tries in a row, each on new "
                     r"ranks \(they ran (\d+) s, (\d+) s, (\d+) s, (\d+) s\): new ranks, retries and restarts do not cure "
                     rf"it, so the run stops here\. If that work is only slow, raise --hang_timeout_s above {STALL_TIMEOUT_S} s "
                     r"and run the same command again; its stacks are in \S+\.txt\.\n", log)
    assert stop, log[-4000:]
    assert all(int(seconds) >= STALL_TIMEOUT_S for seconds in stop.groups()), stop.group(0)
    assert "Retry 1/2" not in log and "Traceback" not in run.stderr, log[-4000:]  # one sentence, no Prefect retry
    alerts = (tmp_path / "ckpt" / "rlhf" / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in alerts] == [7, 7, 7, 7]
