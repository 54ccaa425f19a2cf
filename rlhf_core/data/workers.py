"""A preparation's batches spread over worker processes: a stage's `job` (records -> columns) runs in one process
per core, the batches handed out and their columns taken back in the file's order, at most a few batches in
flight. The workers start from a fork server (`multiprocessing`'s forkserver), not from a fork of the driver,
which holds Prefect's and Ray's threads. A small dataset is done in this process: a worker's start costs seconds.
What a batch warns and raises comes back to this process as it would have come here (one sentence naming the row).
docs/design-notes.md ("Prepared data") has the design.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import types
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Iterator

from rlhf_core.data.columns import Columns, FlatColumns, flatten
from rlhf_core.data.records import Record, TableBlock
from rlhf_core.data.stream import LineBlock
from rlhf_core.errors import PreparationWorkerDied
from rlhf_core.faults import fault_point
from rlhf_core.processes import process_exists

Job = Callable[[list[Record]], Columns]  # a batch of records -> its prepared rows
IN_PROCESS_BATCHES = 2  # a dataset this small is done before worker processes (seconds to start) could help
IN_FLIGHT_PER_WORKER = 2  # batches handed out ahead per worker: enough to keep it busy, few to hold
WATCH_S = 0.5  # how often a worker looks whether the process it works for is still there
WORKERS_ENV_VAR = "RLHF_PREPARE_WORKERS"  # the number of worker processes (default: the cores, at most MAX_WORKERS)
MAX_WORKERS = 8  # the default's cap: each worker holds a tokenizer and its batches, so a 64-core head node's
# memory stays bounded (OpenRLHF's datasets.map uses num_proc=8 too); RLHF_PREPARE_WORKERS goes past it

logger = logging.getLogger(__name__)


def num_workers() -> int:
    """The worker processes a large preparation uses: RLHF_PREPARE_WORKERS, else one per core this process may
    run on, at most MAX_WORKERS; 1 means none (the batches run in this process)."""
    if os.environ.get(WORKERS_ENV_VAR):
        return max(1, int(os.environ[WORKERS_ENV_VAR]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, MAX_WORKERS)


def map_batches(batches: Iterable[list[Record] | LineBlock | TableBlock], url: str, job: Job,
                kinds: dict[str, str]) -> Iterator[FlatColumns]:
    """`job` of each batch, flattened, in order. The first IN_PROCESS_BATCHES run in this process; a dataset
    with more goes on over `num_workers()` worker processes. A batch's error is raised here when its turn comes,
    after every batch before it, as it would be in one process."""
    batches = iter(batches)
    for _ in range(IN_PROCESS_BATCHES):
        batch = next(batches, None)
        if batch is None:
            return
        yield flatten(job(_records(batch, url)), kinds)
    workers = num_workers()
    if workers <= 1:
        for batch in batches:
            yield flatten(job(_records(batch, url)), kinds)
        return
    with _worker_pool(workers, job, url, kinds) as pool:
        pending: deque[Future] = deque()
        try:
            for number, batch in enumerate(batches, start=IN_PROCESS_BATCHES + 1):
                with _without_main() if len(pending) < workers else contextlib.nullcontext():
                    pending.append(pool.submit(_run_batch, batch, number))  # the first `workers` start them
                if len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                    yield _result(pending.popleft(), url)
            while pending:
                yield _result(pending.popleft(), url)
        finally:
            for future in pending:
                future.cancel()


def _worker_pool(workers: int, job: Job, url: str, kinds: dict[str, str]) -> ProcessPoolExecutor:
    """Processes forked from multiprocessing's fork server, which has imported this module and transformers once
    (a tokenizer's class), so that each starts in a fraction of a second."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, "transformers.tokenization_utils_fast"])
    return ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                               initargs=(job, url, kinds, os.getpid()))


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """Start worker processes without this process's __main__ (the `rlhf` script, Prefect's engine, a user's
    script without an `if __name__ == "__main__":` guard): multiprocessing runs it again in each new process,
    and the workers need only this module."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _records(batch: list[Record] | LineBlock | TableBlock, url: str) -> list[Record]:
    return batch if isinstance(batch, list) else batch.records(url)


def _result(future: Future, url: str) -> FlatColumns:
    """A batch's columns, its warnings logged here (each once per key, as `warn_once` would here)."""
    try:
        columns, warnings = future.result()
    except BrokenProcessPool:
        raise PreparationWorkerDied(f"a worker process preparing {url} died (the kernel's OOM killer ends processes this way "
                         f"when memory runs short); run again, or set {WORKERS_ENV_VAR}=1 to prepare it in this "
                         "process alone.") from None
    for name, level, message, once in warnings:
        logging.getLogger(name).log(level, message, extra={"rlhf_once": once} if once else None)
    return columns


class _Captured(logging.Handler):
    """A worker's warnings, kept to go back with its batch's columns."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[str, int, str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage(), getattr(record, "rlhf_once", None)))


# A worker process's job, set once by the pool's initializer: the tokenizer in it is too large to send per batch.
_WORKER: dict[str, Any] = {}


def _start_worker(job: Job, url: str, kinds: dict[str, str], driver_pid: int) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already: no threads inside each
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; a worker ends with it
    threading.Thread(target=_end_with, args=(driver_pid,), daemon=True, name="end-with-driver").start()
    captured = _Captured()
    root = logging.getLogger("rlhf_core")
    root.addHandler(captured)
    root.setLevel(logging.WARNING)
    root.propagate = False
    _WORKER.update(job=job, url=url, kinds=kinds, captured=captured)


def _end_with(driver_pid: int) -> None:
    """End this worker once the process it prepares for is gone (SIGKILLed, say). Nothing else would: a worker
    holds both ends of its task queue, and the fork server waits for its workers before it ends."""
    while process_exists(driver_pid):
        time.sleep(WATCH_S)
    os._exit(1)


def _run_batch(batch: list[Record] | LineBlock | TableBlock, number: int) -> tuple[FlatColumns, list]:
    fault_point("prepare_worker", number)
    captured: _Captured = _WORKER["captured"]
    captured.records = []
    columns = flatten(_WORKER["job"](_records(batch, _WORKER["url"])), _WORKER["kinds"])
    return columns, captured.records
