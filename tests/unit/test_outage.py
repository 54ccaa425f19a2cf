"""`wait_out_outages` without a store: what it retries, how long, and what it says (the real outage, moto stopped
mid-run, is tests/integration/test_store_outage.py)."""

from __future__ import annotations

import logging

import pytest

from rlhf_core.driver.outage import MAX_BACKOFF_S, OutageWait, wait_out_outages
from rlhf_core.errors import StoreFull, StoreUnreachable, TransientStoreError


class EndpointConnectionError(Exception):
    """botocore's, by name: what s3fs raises while the endpoint does not answer (no OSError)."""


class Clock:
    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


COMMIT_8 = ("the commit of step 8", "step 8 was not committed")  # what waits, and what a too-long outage lost


def failing(times: int, error: Exception):
    calls = []

    def attempt():
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "committed"

    return attempt, calls


@pytest.mark.parametrize("error", [EndpointConnectionError("Could not connect"), TransientStoreError("503")])
def test_an_outage_is_waited_out_with_backoff_and_one_warning(error, caplog):
    clock = Clock()
    attempt, calls = failing(8, error)
    waited = []
    with caplog.at_level(logging.INFO, logger="rlhf_core.driver.outage"):
        assert wait_out_outages(attempt, OutageWait("s3://b/run/sft", *COMMIT_8, 600, waited=waited.append,
                                                       sleep=clock.sleep, clock=clock)) == "committed"
    assert waited == [75]  # for the goodput ledger
    assert len(calls) == 9 and clock.sleeps == [1, 2, 4, 8, MAX_BACKOFF_S, MAX_BACKOFF_S, MAX_BACKOFF_S, MAX_BACKOFF_S]
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the store is unreachable" in warnings[0] and "--store_outage_s 600" in warnings[0]
    assert "the commit of step 8 waits for it" in warnings[0]
    assert any("the store is back after 75 s" in record.getMessage() for record in caplog.records)


def test_past_store_outage_s_the_run_stops_with_one_retryable_sentence():
    clock = Clock()
    attempt, _ = failing(10**6, EndpointConnectionError("Could not connect"))
    with pytest.raises(StoreUnreachable, match=r"unreachable for 120 s \(--store_outage_s 120\); step 8 was not "
                                               r"committed and earlier checkpoints are intact") as raised:
        wait_out_outages(attempt, OutageWait("s3://b/run/sft", *COMMIT_8, 120, sleep=clock.sleep, clock=clock))
    assert raised.value.retryable and clock.now == 120


def test_anything_else_is_not_waited_for():
    clock = Clock()
    attempt, calls = failing(1, StoreFull("disk full"))
    with pytest.raises(StoreFull):
        wait_out_outages(attempt, OutageWait("/ckpt/run/sft", *COMMIT_8, 600, sleep=clock.sleep, clock=clock))
    assert len(calls) == 1 and clock.sleeps == []


def test_an_outage_when_a_chunk_starts_is_waited_out_too(tmp_path, monkeypatch, caplog):
    """The chunk's first listing of the store (preflight reached it, so this is an outage, not a bad endpoint):
    the soak's S3 leg met an outage that began between two chunks, and the run failed with a user error."""
    from types import SimpleNamespace

    from rlhf_core.config import RunConfig
    from rlhf_core.driver.chunk import ensure_checkpoint
    from rlhf_core.stages.sft import SFTConfig
    from rlhf_core.storage.checkpoint import CheckpointStore
    from rlhf_core.storage.manifest import STATUS_COMMITTED, CheckpointInfo

    later = CheckpointInfo(16, "step_16", "/ckpt/run/sft/step_16", STATUS_COMMITTED, 1)
    attempt, calls = failing(1, EndpointConnectionError("Could not connect"))
    monkeypatch.setattr(CheckpointStore, "list", lambda self, verify=False: attempt() and [later])
    run = RunConfig(sft=SFTConfig(pretrain="m", dataset="d.jsonl"), ckpt_path=str(tmp_path / "ckpt"))
    waited = []
    runner = SimpleNamespace(run=run, plan=lambda stage: SimpleNamespace(total_steps=32), identity=lambda stage: None,
                             ledger=SimpleNamespace(outage_waited=lambda stage, seconds: waited.append(stage)))
    with caplog.at_level(logging.WARNING, logger="rlhf_core.driver.outage"):
        result = ensure_checkpoint(runner, "sft", 8)
    assert len(calls) == 2 and (result.step, result.uri) == (8, later.uri)  # retention kept the later commit
    assert "the chunk to step 8 waits for it" in caplog.text and waited == ["sft"]
