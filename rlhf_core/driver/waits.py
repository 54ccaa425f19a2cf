"""Waiting on the ranks' calls (`gather`): `ray.get` that watches the stop deadline and the hang watch while it
waits, and re-raises a rank's named failure as itself."""

from __future__ import annotations

from typing import Callable

import ray

from rlhf_core.driver.stop import StopSignals
from rlhf_core.errors import RLHFError

# How often a wait on the ranks looks at the stop deadline (and the hang watch).
STOP_POLL_S = 0.5


def gather(refs, signals: StopSignals | None = None, on_wait: Callable[[], None] | None = None):
    """`ray.get(refs)`, re-raising a rank's named failure (`rlhf_core.errors`) as itself (Ray wraps it in a
    RayTaskError), so the retry policy and the CLI see its class. Once a stop signal has arrived, waits only until
    `signals`' emergency checkpoint deadline (`rlhf_core.driver.stop.GraceExpired`); calls `on_wait` every
    STOP_POLL_S while it waits (the hang watch)."""
    pending = list(refs) if isinstance(refs, list) else [refs]
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=STOP_POLL_S)
        if pending:
            if signals is not None:
                signals.check_deadline()
            if on_wait is not None:
                on_wait()
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, RLHFError):
            raise cause from None
        raise
