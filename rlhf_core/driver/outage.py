"""A store outage waited out: a commit that cannot reach the checkpoint store is tried again, with backoff, until it
is back or --store_outage_s has passed. The ranks keep the snapshot in memory meanwhile (`TrainWorker.write_snapshot`
keeps it after a TransientStoreError) and train on to the next chunk's end; the next chunk does not start before this
one has committed, so at most one commit is pending and memory stays bounded. docs/design-notes.md ("A store
outage") has the rest.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from rlhf_core.errors import StoreUnreachable, TransientStoreError
from rlhf_core.storage.locate import connection_error

logger = logging.getLogger(__name__)
T = TypeVar("T")
MAX_BACKOFF_S = 15.0  # between tries once the store has been away a while: a 2-minute outage costs at most this


def is_outage(error: BaseException) -> bool:
    """Whether `error` says the store could not be reached (or failed in a way that passes)."""
    return isinstance(error, TransientStoreError) or connection_error(error) is not None


def wait_out_outages(attempt: Callable[[], T], store_url: str, waiting: str, lost: str, limit_s: float,
                     sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                     meanwhile: str = "", waited: Callable[[float], None] | None = None) -> T:
    """`attempt()`, tried again while it fails on an outage (`is_outage`): after 1 s, doubling to MAX_BACKOFF_S,
    for at most `limit_s` from the first failure; one warning line when the outage begins, saying that `waiting`
    (`the commit of step 8`) waits, and what goes on `meanwhile`. Past the limit, StoreUnreachable (retryable: the
    run stops, and resumes from the last commit once the store is back), saying what was `lost` (`step 8 was not
    committed`). `waited(seconds)` is told how long an outage that passed was waited out (the goodput ledger)."""
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
                               waiting, limit_s, f", and {meanwhile}" if meanwhile else "")
            if now - began >= limit_s:
                raise StoreUnreachable(
                    f"--ckpt_path {store_url}: the store has been unreachable for {now - began:.0f} s "
                    f"(--store_outage_s {limit_s:g}); {lost} and earlier checkpoints are intact; the run resumes "
                    "from the last commit once the store is back.") from error
            sleep(min(delay, max(0.0, began + limit_s - now)))
            delay = min(2 * delay, MAX_BACKOFF_S)
            continue
        if began is not None:
            outage_s = clock() - began
            logger.info("--ckpt_path %s: the store is back after %.0f s; %s goes on", store_url, outage_s, waiting)
            if waited is not None:
                waited(outage_s)
        return result
