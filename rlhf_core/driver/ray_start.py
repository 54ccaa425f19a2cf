"""Connecting the driver to Ray: `ensure_ray` (an existing cluster, a Ray client, or a local one started here),
and what the rank actors take from the driver's environment (`forwarded_environment`, `threads_asked`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import ray

from rlhf_core.driver.stop import StopSignals
from rlhf_core.errors import UserError
from rlhf_core.faults import HOOK_PREFIX

logger = logging.getLogger(__name__)
_joined: dict[str, bool] = {}  # "running": whether this process joined a cluster it did not start (ensure_ray)


def forwarded_environment() -> dict[str, str]:
    """The driver's variables the ranks need and would not have: workers of an existing cluster inherit
    the cluster's environment, not the driver's. The ranks read and write the store themselves, so the
    standard AWS_* variables (credentials, endpoint, region) travel with them, as the test fault hooks
    (RLHF_FAULT_*) and the writer's settings (RLHF_WRITER_SCHEDULING, RLHF_WRITER_DIRECT_IO) do. Ray keeps a
    runtime env in its GCS, visible on its dashboard: give the nodes their own credentials (an instance role) and
    leave them out of the driver's environment where that matters."""
    forwarded = (HOOK_PREFIX, "RLHF_WRITER_", "AWS_")
    return {name: value for name, value in os.environ.items() if name.startswith(forwarded)}


def threads_asked() -> int | None:
    """OMP_NUM_THREADS from the driver's environment, or None. The ranks cannot read it themselves: Ray sets
    their own to the CPUs they reserved when the cluster's environment has none."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"OMP_NUM_THREADS={value!r}: expected a whole number of threads, 1 or more.")
    return int(value)


def ensure_ray(ray_address: str | None, signals: StopSignals | None = None) -> None:
    """Connect to `ray_address` (or RAY_ADDRESS; `ray://` as a Ray client), else start a local cluster,
    once per process."""
    if ray.is_initialized():
        return
    from rlhf_core.ops import ray_output  # the CLI's quiet console: actors' output to the run's log file

    address = ray_address or os.environ.get("RAY_ADDRESS") or None
    _joined["running"] = bool(address)
    obeying = signals is not None and signals.is_obeying()
    with _ray_keeps_off_sigterm(obeying):
        if address and address.startswith("ray://"):
            _connect_client(address, ray_output.ray_init_options(client=True))
        else:
            ray.init(address=address, include_dashboard=False, configure_logging=True, **ray_output.ray_init_options())
    if signals is not None:
        signals.reclaim()
    ray_output.route_ray_worker_output()


def joined_running_cluster() -> bool:
    """Whether this process's Ray is a cluster it joined (`--ray_address`, RAY_ADDRESS), which outlives the command,
    rather than one it started; False before `ensure_ray`."""
    return _joined.get("running", False)


@contextlib.contextmanager
def _ray_keeps_off_sigterm(obeying: bool):
    """`ray.init` first installs a SIGTERM handler that exits with code 15 (in the middle of its own start,
    leaving its processes behind); inside a stop-obeying run (rlhf_core.driver.stop) it is kept from doing so, through
    the private function it calls. Should that name move, `StopSignals.reclaim` after the start still holds."""
    from ray._private import utils as ray_utils

    original = getattr(ray_utils, "set_sigterm_handler", None)
    if original is None or not obeying:
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


def _connect_client(address: str, options: dict, num_attempts: int = 3) -> None:
    """`ray.init` as a Ray client, tried again on a connection error: a cluster's first client connection can
    fail while its proxy starts the client server ("Starting Ray client server failed")."""
    for attempt in range(1, num_attempts + 1):
        try:
            ray.init(address=address, **options)
            return
        except ConnectionError as error:  # ConnectionAbortedError on a failed server start
            if attempt == num_attempts:
                raise
            logger.warning("connecting to %s failed (%s); trying again", address, str(error).splitlines()[0])
            time.sleep(2.0 * attempt)
