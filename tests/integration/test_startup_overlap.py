"""A long data preparation has Ray start beside it (flows.startup), and a refusal found late in it leaves nothing
started: in-process, on real data (the toy's SFT rows repeated past PREPARATION_ALONE_S) and a real Ray."""

from __future__ import annotations

import json
import os
import time

import pytest
import ray

from flows import startup
from rlhf_core.config import RunConfig
from rlhf_core.driver import preflight
from rlhf_core.errors import UserError
from rlhf_core.stages.sft import SFTConfig

pytestmark = pytest.mark.slow
NUM_ROWS = 40_000  # prepared in ~1.5 s here: well past PREPARATION_ALONE_S
RAY_START_WAIT_S = 60.0


@pytest.fixture
def ray_starts(monkeypatch) -> list[str | None]:
    """The address of each `ensure_ray` call (None: a local Ray of this process's own). Ray starts disconnected in
    this process: an earlier test on the same xdist worker may have left it connected, and a connected Ray is not
    started again (`startup._start_ray`), which failed this module's first test in two suite runs."""
    from rlhf_core.driver import ray_start

    ray.shutdown()
    calls: list[str | None] = []
    ensure_ray = ray_start.ensure_ray

    def watched(address, signals=None):
        calls.append(address or os.environ.get("RAY_ADDRESS"))
        return ensure_ray(address, signals)

    monkeypatch.setattr(ray_start, "ensure_ray", watched)
    return calls


@pytest.fixture
def ray_seen_at_the_end_of_counting(monkeypatch) -> list[bool]:
    """Whether Ray was connected when `preflight.count` ended, each time it did (with its result or its error).
    Each count waits for Ray (at most RAY_START_WAIT_S) before it ends, so that how fast Ray starts against how fast
    the rows are prepared on this machine decides nothing (a loaded CI machine joined the head after the 40,000
    rows were counted, once): Ray starting beside the preparation is connected within the wait; Ray started only
    after preflight is not, whatever the wait."""
    seen: list[bool] = []
    count = preflight.count

    def watched(*args, **kwargs):
        try:
            return count(*args, **kwargs)
        finally:
            deadline = time.monotonic() + RAY_START_WAIT_S
            while not ray.is_initialized() and time.monotonic() < deadline:
                time.sleep(0.05)
            seen.append(ray.is_initialized())

    monkeypatch.setattr(preflight, "count", watched)
    return seen


def sft_run(toy: dict[str, str], tmp_path, rows: list[dict]) -> RunConfig:
    tmp_path.mkdir()
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return RunConfig(ckpt_path=str(tmp_path / "ckpt"), sft=SFTConfig(
        pretrain=toy["model"], dataset=str(data), input_key="prompt", output_key="response", max_len=64,
        train_batch_size=8, micro_train_batch_size=8, save_path=str(tmp_path / "out")))


def toy_rows(toy: dict[str, str], num_rows: int) -> list[dict]:
    with open(toy["sft"]) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [rows[index % len(rows)] for index in range(num_rows)]


def test_ray_starts_beside_a_long_preparation_and_a_late_refusal_stops_it(
        toy_assets, tmp_path, rlhf_env, monkeypatch, ray_starts, ray_seen_at_the_end_of_counting):
    """Joining the worker's head (RAY_ADDRESS), then a local Ray of this process's own: a bad last row is refused
    with its one sentence, after the Ray started beside it is stopped."""
    monkeypatch.setenv("RAY_ADDRESS", rlhf_env["RAY_ADDRESS"])
    good = sft_run(toy_assets, tmp_path / "good", toy_rows(toy_assets, NUM_ROWS))
    try:
        checked = startup.checked_while_ray_starts(good, None)
        assert checked.plans["sft"].num_samples == NUM_ROWS
        assert ray_seen_at_the_end_of_counting == [True]  # connected before the preparation ended
        assert ray_starts == [rlhf_env["RAY_ADDRESS"]]
    finally:
        ray.shutdown()

    monkeypatch.delenv("RAY_ADDRESS")
    bad = sft_run(toy_assets, tmp_path / "bad", toy_rows(toy_assets, NUM_ROWS) + [{"prompt": "no response"}])
    with pytest.raises(UserError, match=rf"rows.jsonl line {NUM_ROWS + 1}: no key 'response'"):
        startup.checked_while_ray_starts(bad, None)
    assert ray_starts[1:] == [None] and ray_seen_at_the_end_of_counting[1:] == [True]  # a local Ray started beside
    # the preparation...
    assert not ray.is_initialized()  # ...and stopped after the refusal
