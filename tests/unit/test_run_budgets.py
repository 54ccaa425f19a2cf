"""Whether a chunk is the last one a run budget allows (then it commits without training the next one ahead)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from flows.pipeline import _last_chunk_allowed


def test_the_chunk_budget_s_last_chunk_is_the_last():
    assert _last_chunk_allowed(1, None, 0.0)
    assert not _last_chunk_allowed(2, None, 0.0)
    assert not _last_chunk_allowed(None, None, 1e9)


def test_a_chunk_that_would_end_past_the_time_budget_at_the_previous_chunk_s_pace_is_the_last():
    in_100_s = datetime.now(timezone.utc) + timedelta(seconds=100)
    assert not _last_chunk_allowed(None, in_100_s, 10.0)
    assert _last_chunk_allowed(None, in_100_s, 200.0)
    assert not _last_chunk_allowed(5, in_100_s, 0.0), "before any chunk, only a budget already spent counts"
    assert _last_chunk_allowed(5, datetime.now(timezone.utc) - timedelta(seconds=1), 0.0)
