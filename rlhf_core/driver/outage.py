"""A store outage waited out: a commit that cannot reach the checkpoint store is tried again, with backoff, until it
is back or --store_outage_s has passed. The ranks keep the snapshot in memory meanwhile (`TrainWorker.write_snapshot`
keeps it after a TransientStoreError) and train on to the next chunk's end; the next chunk does not start before this
one has committed, so at most one commit is pending and memory stays bounded. docs/design-notes.md ("A store
outage") has the rest.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from rlhf_core.errors import StoreUnreachable, TransientStoreError
from rlhf_core.storage.locate import connection_error

logger = logging.getLogger(__name__)
T = TypeVar("T")
MAX_BACKOFF_S = 15.0  # between tries once the store has been away a while: a 2-minute outage costs at most this


def is_outage(error: BaseException) -> bool:
    """Whether `error` says the store could not be reached (or failed in a way that passes)."""
    return isinstance(error, TransientStoreError) or connection_error(error) is not None


@dataclass(frozen=True)
class OutageWait:
    """How a store call waits out an outage: the store (`store_url`), what waits (`the commit of step 8`), what a
    too-long outage loses (`step 8 was not committed`), the limit (--store_outage_s), what goes on `meanwhile`,
    and whom to tell how long an outage that passed was waited out (`waited(seconds)`: the goodput ledger)."""

    store_url: str
    waiting: str
    lost: str
    limit_s: float
    meanwhile: str = ""
    waited: Callable[[float], None] | None = None
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic


def wait_out_outages(attempt: Callable[[], T], wait: OutageWait) -> T:
    """`attempt()`, tried again while it fails on an outage (`is_outage`): after 1 s, doubling to MAX_BACKOFF_S,
    for at most `wait.limit_s` from the first failure; one warning line when the outage begins, saying what waits
    and what goes on meanwhile. Past the limit, StoreUnreachable (retryable: the run stops, and resumes from the
    last commit once the store is back), saying what was lost. `wait.waited` is told how long an outage that
    passed was waited out."""
    store_url, waiting, limit_s, clock = wait.store_url, wait.waiting, wait.limit_s, wait.clock
    began: float | None = None
    delay = 1.0
    while True:
        try:
            result = attempt()
        except Exception as error:  # noqa: BLE001 - only outages are retried; the rest re-raised as they are
            if not is_outage(error):
                raise
            now = clock()
            if began is None:
                began = now
                logger.warning("--ckpt_path %s: the store is unreachable (%s); %s waits for it, up to "
                               "--store_outage_s %g%s", store_url, type(connection_error(error) or error).__name__,
                               waiting, limit_s, f", and {wait.meanwhile}" if wait.meanwhile else "")
            if now - began >= limit_s:
                raise StoreUnreachable(
                    f"--ckpt_path {store_url}: the store has been unreachable for {now - began:.0f} s "
                    f"(--store_outage_s {limit_s:g}); {wait.lost} and earlier checkpoints are intact; the run resumes "
                    "from the last commit once the store is back.") from error
            wait.sleep(min(delay, max(0.0, began + limit_s - now)))
            delay = min(2 * delay, MAX_BACKOFF_S)
            continue
        if began is not None:
            outage_s = clock() - began
            logger.info("--ckpt_path %s: the store is back after %.0f s; %s goes on", store_url, outage_s, waiting)
            if wait.waited is not None:
                wait.waited(outage_s)
        return result
