"""A command's start-up before its flow: preflight's data half (`count`: reading, tokenizing and storing the data)
while Ray starts, then Prefect's ephemeral server while the first training stage's ranks start, before the flow
needs them. docs/design-notes.md ("Preflight checks") says when each starts.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

from rlhf_core.config import RunConfig
from rlhf_core.driver import preflight
from rlhf_core.driver.plan import Checked
from rlhf_core.driver.runner import StageRunner
from rlhf_core.driver.stop import StopSignals
from rlhf_core.stages import STAGES

logger = logging.getLogger(__name__)
# A preparation that ends sooner (data already prepared, a few thousand rows, a bad first row) is waited for
# before anything starts, so that a refusal starts nothing; a longer one has Ray start beside it.
PREPARATION_ALONE_S = 0.5


def checked_while_ray_starts(run: RunConfig, signals: StopSignals | None) -> Checked:
    """Preflight: `check`, then `count` in a thread of its own; once `count` has taken PREPARATION_ALONE_S, Ray
    starts beside it (here: `ray.init` wants the main thread). A refusal in `count` stops the Ray started here,
    then raises. Prefect's ephemeral server starts later, beside the ranks' start: its 1.4 s of imports in this
    process, beside the preparation, slowed it more than the overlap won (design-notes, "Preflight checks")."""
    resolved, to_count = preflight.check(run)
    with ThreadPoolExecutor(1, thread_name_prefix="rlhf-preparation") as pool:
        counting: Future[Checked] = pool.submit(preflight.count, resolved, to_count)
        if wait([counting], timeout=PREPARATION_ALONE_S).done:
            return counting.result()
        logger.debug("the data's preparation goes on while Ray starts")
        started_ray = False
        try:
            started_ray = _start_ray(resolved, signals)
            return counting.result()
        except BaseException:
            if started_ray:  # nothing of a refused run's start outlives it (a local Ray stopped, a cluster left)
                import ray

                ray.shutdown()
            raise


def _start_ray(run: RunConfig, signals: StopSignals | None) -> bool:
    """Connect Ray for `run` when it trains; returns whether this call did."""
    import ray

    if not _trains(run) or ray.is_initialized():
        return False
    from rlhf_core.driver.ray_start import ensure_ray

    ensure_ray(run.ray_address, signals)
    return True


def _trains(run: RunConfig) -> bool:
    return any(STAGES[stage].kind == "train" for stage in run.stages)


def prestart_first_training_stage(runner: StageRunner) -> None:
    """Connect Ray and start the worker group of the first training stage to train (not one a resuming run finds
    finished: `finished_checkpoint`) in the background (`StageRunner.prestart`), so that the first chunk finds its
    ranks started and imported."""
    from rlhf_core.driver.ray_start import ensure_ray
    from rlhf_core.driver.resume import finished_checkpoint

    run = runner.run
    for stage in (stage for stage in run.stages if STAGES[stage].kind == "train"):
        if finished_checkpoint(run, stage, lambda: runner.plan(stage).total_steps) is None:
            ensure_ray(run.ray_address, runner.signals)
            runner.prestart(stage)
            return


class EphemeralServer:
    """Prefect's ephemeral API server (~4-10 s to start here) started in a thread, so that Ray's start overlaps it;
    nothing when a server is configured (PREFECT_API_URL). A failed start is retried, and reported, by the flow's
    own client."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start it, once; returns at once."""
        from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

        if self._thread is not None or PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
            return
        self._thread = threading.Thread(target=self._start, name="prefect-server-start", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait for the start to be done, whatever its outcome (an exit would wait on a start half done)."""
        if self._thread is not None:
            self._thread.join()

    def _start(self) -> None:
        from prefect.server.api.server import SubprocessASGIServer  # 1.4 s of imports: off the main thread too

        # The server is in the terminal's process group: blocked here, Ctrl-C (SIGINT) stays blocked in it
        # (a signal mask survives fork and exec), as Ray does for its processes, so it outlives the stop that
        # Ctrl-C begins (rlhf_core.driver.stop) and still records it. SubprocessASGIServer.stop sends SIGTERM at exit.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        server = SubprocessASGIServer()
        try:
            server.start()
        except Exception:
            # Prefect 3.9 leaves a server that did not answer within its startup timeout running, and the flow's
            # client then starts another: the first would outlive this process (holding its stdout open).
            process = getattr(server, "server_process", None)
            if process is not None and process.poll() is None:
                process.kill()
            logger.debug("Prefect's ephemeral server did not start here; the flow's client retries", exc_info=True)
