"""The lease race: 20 rounds of two processes starting on one run at the same instant; exactly one wins
every round, on a local path and on S3 (moto).

Two long-lived racer processes are started once per backend. Each says it is ready, is then told a
start instant t0, and in round i, on the fresh run `race-{i}`, waits until t0 + i * ROUND_SPACING_S and
calls `acquire()`. Even rounds race for an absent lease (the atomic create); odd rounds race for a
released one left in place beforehand (the compare-and-swap). Winners keep their leases until both
racers have finished every round, so a late loser cannot win a lease its rival already gave back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import make_bucket, s3_environment

NUM_ROUNDS = 20
ROUND_SPACING_S = 0.3
PROJECT_DIR = Path(__file__).resolve().parents[2]

RACER = """
import json, sys, time
from rlhf_core.errors import UserError
from rlhf_core.storage.lease import RunLease

base_url = sys.argv[1]
print("ready", flush=True)
t0 = float(sys.stdin.readline())
held = []
for i in range(int(sys.argv[2])):
    lease = RunLease(f"{base_url}/race-{i}", heartbeat_s=3600)
    start = t0 + i * float(sys.argv[3])
    time.sleep(max(0.0, start - time.time() - 0.01))
    while time.time() < start:
        pass  # the last few ms spinning: both racers leave the line within microseconds of each other
    try:
        lease.acquire()
        held.append(lease)
        print(json.dumps({"round": i, "won": True, "token": lease.token}), flush=True)
    except UserError as error:
        print(json.dumps({"round": i, "won": False, "why": str(error)}), flush=True)
sys.stdin.readline()  # hold every lease won until the rival has finished too
"""


def race(base_url: str, env: dict[str, str]) -> list[list[dict]]:
    """Run NUM_ROUNDS rounds between two racer processes; return each racer's per-round outcomes."""
    racers = [
        subprocess.Popen([sys.executable, "-c", RACER, base_url, str(NUM_ROUNDS), str(ROUND_SPACING_S)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=PROJECT_DIR)
        for _ in range(2)
    ]
    try:
        for racer in racers:
            assert racer.stdout.readline().strip() == "ready"
        t0 = time.time() + 0.5  # both are ready: only the pipe write and a wake-up stand between them and t0
        for racer in racers:
            racer.stdin.write(f"{t0}\n")
            racer.stdin.flush()
        outcomes = [[json.loads(racer.stdout.readline()) for _ in range(NUM_ROUNDS)] for racer in racers]
        for racer in racers:
            racer.stdin.close()
            assert racer.wait() == 0
        return outcomes
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
                racer.wait()


def assert_one_winner_per_round(outcomes: list[list[dict]]) -> None:
    for round_index, pair in enumerate(zip(*outcomes)):
        assert [outcome["round"] for outcome in pair] == [round_index, round_index]
        winners = [outcome for outcome in pair if outcome["won"]]
        assert len(winners) == 1, f"round {round_index}: {pair}"
        loser = next(outcome for outcome in pair if not outcome["won"])
        assert "was taken by another run starting at the same time" in loser["why"] or \
            "is held by another run" in loser["why"], loser["why"]
        expected_generation = 1 if round_index % 2 == 0 else 2  # odd rounds: one released tenure before
        assert winners[0]["token"].startswith(f"{expected_generation}-"), winners[0]
    num_close_races = sum("starting at the same time" in outcome.get("why", "") for racer in outcomes for outcome in racer)
    print(f"{num_close_races} of {NUM_ROUNDS} rounds were decided by the atomic write itself (both saw the lease free)")


def leave_released_leases(base_url: str, env: dict[str, str]) -> None:
    """Odd rounds race for a lease that exists but is released: the take is a compare-and-swap."""
    code = ("import sys; from rlhf_core.storage.lease import RunLease\n"
            "for i in range(1, int(sys.argv[2]), 2):\n"
            "    with RunLease(f'{sys.argv[1]}/race-{i}'): pass\n")
    subprocess.run([sys.executable, "-c", code, base_url, str(NUM_ROUNDS)], env=env, cwd=PROJECT_DIR, check=True)


@pytest.mark.slow
def test_two_processes_racing_for_a_local_lease_one_wins_every_round(tmp_path):
    base_url = str(tmp_path / "ckpt")
    env = dict(os.environ)
    leave_released_leases(base_url, env)
    assert_one_winner_per_round(race(base_url, env))


@pytest.mark.slow
def test_two_processes_racing_for_an_s3_lease_one_wins_every_round(s3_endpoint):
    bucket = f"lease-race-{uuid.uuid4().hex[:8]}"
    make_bucket(s3_endpoint, bucket)
    base_url = f"s3://{bucket}/ckpt"
    env = {**os.environ, **s3_environment(s3_endpoint)}
    leave_released_leases(base_url, env)
    assert_one_winner_per_round(race(base_url, env))
