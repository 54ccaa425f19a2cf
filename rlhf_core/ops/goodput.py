"""The goodput ledger of a run (`{ckpt_path}/{run_name}/goodput.json`): where each attempt's wall time went
(useful, stall, start-up, load, plan, lost, other; down time between attempts apart), per stage and in total,
across every attempt of the run. The chunk code and the flow call its hooks; one small JSON document is
rewritten whole (atomic, durable), and recording is best effort. docs/design-notes.md ("Goodput") defines each
category and why the ledger is kept this way; `rlhf_core.ops.goodput_categories` names the categories and the chunk's
timers, and `rlhf_core.ops.goodput_summary` reads the ledger.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from dataclasses import asdict
from typing import Any, Callable, Mapping

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from rlhf_core.ops.goodput_categories import Category, CommittedChunk, category_shares
from rlhf_core.storage import durable
from rlhf_core.errors import UserError

GOODPUT_FILE_NAME = "goodput.json"
LEDGER_FORMAT = 1
LEASE_HEARTBEAT_S = 10.0  # rlhf_core.storage.lease.RunLease's default renewal period: bounds a crashed attempt's end
RUNNING, FINISHED, CRASHED = "running", "finished", "crashed"

MAX_REPLACEMENTS_KEPT = 50  # per stage: each in-place replacement of the ranks, for `rlhf goodput` and the bench

logger = logging.getLogger(__name__)


def process_start_time() -> float:
    """When this process was created: a command's attempt starts there, so start-up counts the interpreter and
    the imports too (`GoodputLedger`'s `command_started`)."""
    import psutil

    return psutil.Process().create_time()


def _new_stage() -> dict[str, Any]:
    return {"chunks": 0, "steps": 0, "lost_chunks": 0, "lost_steps": 0, "attempts": 0, "wall_s": 0.0,
            **{category.value: 0.0 for category in Category}, "seconds": {}, "lost_to": {}}


def empty_ledger() -> dict[str, Any]:
    return {"format": LEDGER_FORMAT, "attempts": [], "pending": [], "stages": {}, "outside_stages_s": 0.0,
            "down_s": 0.0, "ahead": {}}


# --------------------------------------------------------------------------- transitions (pure)
# Each takes the ledger document and the time now, and changes the document in place.


def _stage(doc: dict, stage: str) -> dict:
    record = doc["stages"].setdefault(stage, _new_stage())
    for name, value in _new_stage().items():  # a ledger written by an older version lacks newer fields
        record.setdefault(name, value)
    return record


def _attempt(doc: dict, attempt_id: str) -> dict | None:
    return next((attempt for attempt in doc["attempts"] if attempt["id"] == attempt_id), None)


def _tick(doc: dict, attempt: dict, stage: str | None, now: float) -> None:
    """Attribute the attempt's wall time since its last record to `stage` (None: outside any stage)."""
    elapsed = max(0.0, now - attempt["last_seen"])
    if stage is None:
        doc["outside_stages_s"] += elapsed
    else:
        _stage(doc, stage)["wall_s"] += elapsed
    attempt["last_seen"] = max(attempt["last_seen"], now)


def _lose(doc: dict, chunks: list[dict], until: float) -> None:
    """`chunks` (pending records) never committed: their steps count as lost, and per stage the time from the
    earliest one's start to `until` (chunks in flight together overlap; the union is what was lost)."""
    for stage in {chunk["stage"] for chunk in chunks}:
        mine = [chunk for chunk in chunks if chunk["stage"] == stage]
        record = _stage(doc, stage)
        record["lost_chunks"] += len(mine)
        record["lost_steps"] += sum(chunk["to_step"] - chunk["from_step"] for chunk in mine)
        record[Category.LOST] += max(0.0, until - min(chunk["started"] for chunk in mine))
        for cause in {chunk["lost_to"] for chunk in mine if chunk.get("lost_to")}:  # a hang, a lost rank...
            caused = [chunk for chunk in mine if chunk.get("lost_to") == cause]
            record["lost_to"][cause] = record["lost_to"].get(cause, 0.0) + max(
                0.0, until - min(chunk["started"] for chunk in caused))
    doc["pending"] = [chunk for chunk in doc["pending"] if chunk not in chunks]


def begin_attempt(doc: dict, attempt_id: str, now: float, started: float | None = None,
                  lease_holder: Mapping[str, Any] | None = None,
                  is_committed: Callable[[str, int], bool] = lambda stage, step: False) -> dict:
    """A new attempt starting at `started` (default now); closes every attempt still marked running (it
    crashed: this process would not start otherwise) and settles its pending chunks. `lease_holder` is the
    run lease's record as found before this attempt takes it ({host, pid, heartbeat, released})."""
    started = now if started is None else min(started, now)
    for old in [attempt for attempt in doc["attempts"] if attempt["state"] == RUNNING]:
        _close_crashed(doc, old, started, lease_holder, is_committed)
    attempt = {"id": attempt_id, "host": socket.gethostname(), "pid": os.getpid(), "started": started,
               "last_seen": started, "end": None, "state": RUNNING, "chunks_started": 0}
    doc["attempts"].append(attempt)
    return attempt


def _close_crashed(doc: dict, old: dict, next_started: float, lease_holder: Mapping[str, Any] | None,
                   is_committed: Callable[[str, int], bool]) -> None:
    holder: Mapping[str, Any] = lease_holder or {}
    holder_is_old = bool(holder) and holder.get("host") == old["host"] \
        and holder.get("pid") == old["pid"] and holder.get("heartbeat", 0) >= old["started"]
    if holder_is_old and holder.get("released"):  # it ended cleanly, without recording its end
        end, state = max(old["last_seen"], holder["heartbeat"]), FINISHED
    elif holder_is_old:
        end, state = min(next_started, max(old["last_seen"], holder["heartbeat"]) + LEASE_HEARTBEAT_S), CRASHED
    else:
        end, state = max(old["last_seen"], next_started), CRASHED
    pending = [chunk for chunk in doc["pending"] if chunk["attempt"] == old["id"]]
    committed = [chunk for chunk in pending if is_committed(chunk["stage"], chunk["to_step"])]
    lost = [chunk for chunk in pending if chunk not in committed]
    first_pending = min(pending, key=lambda chunk: chunk["started"], default=None)
    _tick(doc, old, first_pending["stage"] if first_pending else _ahead_stage(doc, old), end)
    for chunk in committed:  # died after the commit, before recording it: the chunk's whole time counts as useful
        record = _stage(doc, chunk["stage"])
        record["chunks"] += 1
        record["steps"] += chunk["to_step"] - chunk["from_step"]
        record[Category.USEFUL] += max(0.0, end - chunk["started"])
    doc["pending"] = [chunk for chunk in doc["pending"] if chunk not in committed]
    for chunk in lost if state == CRASHED else []:  # the process died: its chunk's time is lost to the restart
        chunk.setdefault("lost_to", "restarts")
    _lose(doc, lost, end)
    _lose_ahead(doc, old, end)
    old["end"], old["state"] = end, state
    doc["down_s"] += max(0.0, next_started - end)


def start_chunk(doc: dict, attempt: dict, stage: str, from_step: int, to_step: int, now: float) -> None:
    """A chunk of `stage` starts training at `from_step` toward `to_step`. A chunk of the stage still pending
    with an end above `from_step` never committed (this one trains its steps again): it is lost. One that ends
    at or below `from_step` may still be committing in the background: it stays pending."""
    record = _stage(doc, stage)
    if attempt["chunks_started"] == 0:
        record[Category.STARTUP] += max(0.0, now - attempt["started"])
    if stage not in attempt.setdefault("stages", []):  # restarts per stage, for the restart cost R
        attempt["stages"].append(stage)
        record["attempts"] += 1
    _tick(doc, attempt, stage, now)
    attempt["chunks_started"] += 1
    _lose(doc, [chunk for chunk in doc["pending"] if chunk["stage"] == stage and chunk["to_step"] > from_step], now)
    ahead = _ahead(doc).pop(stage, None)
    started = now
    if ahead and ahead["attempt"] == attempt["id"] and ahead["after_step"] == from_step:
        started = min(now, ahead["since"])  # its first steps trained while the previous chunk committed
    doc["pending"].append({"stage": stage, "from_step": int(from_step), "to_step": int(to_step), "started": started,
                           "attempt": attempt["id"]})


def fail_chunk(doc: dict, attempt: dict, stage: str, cause: str) -> None:
    """The attempt's pending chunks of `stage` failed for `cause` ("hangs", "lost ranks"): when they count as lost
    (`_lose`), their time is also counted under that cause."""
    for chunk in doc["pending"]:
        if chunk["stage"] == stage and chunk["attempt"] == attempt["id"]:
            chunk["lost_to"] = cause


def commit_chunk(doc: dict, attempt: dict, chunk: CommittedChunk, now: float) -> None:
    """`chunk` committed at `now`. The ranks have been training the next chunk ahead for the last
    `chunk.trained_ahead_s` seconds: that chunk's record starts then (`start_chunk`), and if none starts, that
    time is lost (`_lose_ahead`)."""
    stage, step = chunk.stage, chunk.step
    _tick(doc, attempt, stage, now)
    _ahead(doc).pop(stage, None)
    if chunk.trained_ahead_s > 0:
        _ahead(doc)[stage] = {"after_step": int(step), "since": now - chunk.trained_ahead_s, "attempt": attempt["id"]}
    record = _stage(doc, stage)
    # An emergency checkpoint (rlhf_core.driver.stop) commits its chunk short of the chunk's end.
    match = next((pending for pending in doc["pending"]
                  if pending["stage"] == stage and pending["from_step"] < step <= pending["to_step"]), None)
    num_steps = chunk.num_steps
    if match is not None:
        doc["pending"].remove(match)
        num_steps = match["to_step"] - match["from_step"] if num_steps is None else num_steps
    record["chunks"] += 1
    record["steps"] += int(num_steps or 0)
    for name, value in chunk.seconds.items():
        record["seconds"][name] = record["seconds"].get(name, 0.0) + float(value)
    for category, share in category_shares(chunk.seconds):
        record[category] += share


def replace_ranks(doc: dict, stage: str, cause: str, seen_at: float, ready_at: float, first_step_s: float) -> None:
    """A chunk of `stage` replaced its ranks in place after a `cause` ("lost ranks", "hangs") seen at `seen_at`;
    the new ranks held the start state at `ready_at` and took `first_step_s` for their first step. The newest
    MAX_REPLACEMENTS_KEPT are kept, with the count of all."""
    record = _stage(doc, stage)
    record["num_replacements"] = record.get("num_replacements", 0) + 1
    kept = record.setdefault("replacements", [])
    kept.append({"cause": cause, "seen_at": seen_at, "ready_at": ready_at, "first_step_s": first_step_s,
                 "recovery_s": max(0.0, ready_at - seen_at) + first_step_s})
    del kept[:-MAX_REPLACEMENTS_KEPT]


def _add_outage(doc: dict, stage: str, seconds: float) -> None:
    record = _stage(doc, stage)
    record[Category.OUTAGE] = record.get(Category.OUTAGE, 0.0) + seconds


def finish_attempt(doc: dict, attempt: dict, now: float) -> None:
    """The attempt ends cleanly; chunks it left pending never committed (a failed stage)."""
    _tick(doc, attempt, _ahead_stage(doc, attempt), now)
    _lose(doc, [chunk for chunk in doc["pending"] if chunk["attempt"] == attempt["id"]], now)
    _lose_ahead(doc, attempt, now)
    attempt["end"], attempt["state"] = now, FINISHED


def _lose_ahead(doc: dict, attempt: dict, until: float) -> None:
    """Training ahead that `attempt` began after a commit and no chunk record took over (the process died, or
    the run stopped at that boundary): trained, never committed, so lost until `until`. Its steps are not
    known here; its time is."""
    for stage, ahead in list(_ahead(doc).items()):
        if ahead["attempt"] == attempt["id"]:
            _stage(doc, stage)[Category.LOST] += max(0.0, until - ahead["since"])
            del _ahead(doc)[stage]


def _ahead_stage(doc: dict, attempt: dict) -> str | None:
    """The stage `attempt` was training ahead in after its last commit, if any."""
    return next((stage for stage, ahead in _ahead(doc).items() if ahead["attempt"] == attempt["id"]), None)


def _ahead(doc: dict) -> dict[str, dict]:
    """Per stage, the training ahead begun after its last commit that no chunk record took over yet (a ledger
    written by an older version has none)."""
    return doc.setdefault("ahead", {})


# --------------------------------------------------------------------------- the file


def _best_effort(method):
    """A ledger write that fails costs a warning, never the chunk that records it."""

    @functools.wraps(method)
    def recording(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - the ledger is a view of training, not part of it
            logger.warning("could not record goodput in %s: %s", self.url, error)
            return None

    return recording


class GoodputLedger:
    """`{run_url}/goodput.json`: the hooks the chunk code and the flow call, and `summary()` for readers."""

    def __init__(self, run_url: str, storage_options: Mapping[str, Any] | None = None,
                 clock: Callable[[], float] = time.time, command_started: float | None = None):
        """One ledger object is one process's view: the attempt it begins is its own (`command_started`: when the
        command began, the start of its first attempt; default: when that attempt is begun)."""
        self.run_url = run_url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, root = url_to_fs(self.run_url, **self.storage_options)
        self.root = root.rstrip("/")
        self.path = posixpath.join(self.root, GOODPUT_FILE_NAME) if self.root else GOODPUT_FILE_NAME
        self.url = f"{self.run_url}/{GOODPUT_FILE_NAME}"
        self.clock = clock
        self._command_started = command_started
        self._attempt_id = ""  # of the attempt this object began
        self._mutex = threading.RLock()  # the hooks run from the flow's and the chunks' threads

    # ---- reading and writing

    def read(self) -> dict[str, Any]:
        """The ledger document; an empty one when the run has none yet. A file that is not a ledger (never
        written by us: the writes cannot tear) raises ValueError."""
        try:
            payload = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return empty_ledger()
        doc = json.loads(payload)
        if not isinstance(doc, dict) or doc.get("format") != LEDGER_FORMAT:
            raise ValueError(f"{self.url} is not a goodput ledger of format {LEDGER_FORMAT}")
        return doc

    def exists(self) -> bool:
        return self.fs.exists(self.path)

    def _write(self, doc: dict) -> None:
        payload = json.dumps(doc, sort_keys=True, allow_nan=False).encode()
        if not isinstance(self.fs, LocalFileSystem):
            self.fs.pipe_file(self.path, payload)  # one PUT: the object is replaced whole or not at all
            return
        durable.replace_durably(self.path, payload)

    def _update(self, change: Callable[[dict, dict], None], start_new: bool = False) -> None:
        """Read, apply `change(doc, this process's attempt)`, write; begins an attempt when none runs here
        (`start_new`: always, ending this process's previous one)."""
        with self._mutex:
            doc = self._read_or_restart()
            attempt = _attempt(doc, self._attempt_id)
            if start_new and attempt is not None and attempt["state"] == RUNNING:
                finish_attempt(doc, attempt, self.clock())
            if start_new or attempt is None or attempt["state"] != RUNNING:
                attempt = self._begin(doc)
            change(doc, attempt)
            self._write(doc)

    def _read_or_restart(self) -> dict:
        """The ledger, or a new one when the file is not a ledger (e.g. emptied by a power loss between the
        write and the rename reaching the disk): the old file is kept beside it as goodput.json.corrupt."""
        try:
            return self.read()
        except ValueError as error:
            self.fs.mv(self.path, f"{self.path}.corrupt")
            logger.warning("%s is not a goodput ledger (%s): kept as %s.corrupt; recording starts again", self.url,
                           error, GOODPUT_FILE_NAME)
            return empty_ledger()

    def _begin(self, doc: dict) -> dict:
        attempt_id = uuid.uuid4().hex[:12]
        attempt = begin_attempt(doc, attempt_id, self.clock(), self._command_started, self._lease_holder(),
                                self._is_committed)
        self._command_started = None  # a second attempt of this object starts when it is asked for
        self._attempt_id = attempt_id
        return attempt

    def _lease(self):
        from rlhf_core.storage.lease import RunLease

        return RunLease(self.run_url, self.storage_options)

    def _lease_holder(self) -> dict | None:
        try:
            holder = self._lease().read()
        except (OSError, ValueError):
            return None
        return None if holder is None else asdict(holder)

    def _is_committed(self, stage: str, step: int) -> bool:
        from rlhf_core.storage.manifest import MANIFEST_NAME, step_dir_name

        return self.fs.exists(f"{self.root}/{stage}/{step_dir_name(step)}/{MANIFEST_NAME}")

    # ---- hooks

    @_best_effort
    def attempt_started(self) -> None:
        """Call before taking the run lease (the lease still names the previous attempt's process). Does
        nothing while another live process holds the lease: this attempt is about to be refused, and the
        other one is not dead."""
        try:
            self._lease().check_available()
        except UserError:
            return
        self._update(lambda doc, attempt: None, start_new=True)

    @_best_effort
    def chunk_started(self, stage: str, from_step: int, to_step: int) -> None:
        self._update(lambda doc, attempt: start_chunk(doc, attempt, stage, from_step, to_step, self.clock()))

    @_best_effort
    def chunk_committed(self, stage: str, step: int, seconds: Mapping[str, float] | None = None,
                        num_steps: int | None = None, trained_ahead_s: float = 0.0) -> None:
        chunk = CommittedChunk(stage, step, seconds or {}, num_steps, trained_ahead_s)
        self._update(lambda doc, attempt: commit_chunk(doc, attempt, chunk, self.clock()))

    @_best_effort
    def chunk_failed(self, stage: str, cause: str | None) -> None:
        """A chunk of `stage` failed; `cause` (the error's `lost_to`) names what its time was lost to."""
        if cause:
            self._update(lambda doc, attempt: fail_chunk(doc, attempt, stage, cause))

    @_best_effort
    def ranks_replaced(self, stage: str, cause: str, seen_at: float, ready_at: float, first_step_s: float) -> None:
        self._update(lambda doc, attempt: replace_ranks(doc, stage, cause, seen_at, ready_at, first_step_s))

    @_best_effort
    def outage_waited(self, stage: str, seconds: float) -> None:
        """A chunk of `stage` waited `seconds` for the store to come back (rlhf_core.driver.outage): no work lost,
        the time is inside the chunk's stall (a commit) or other (a chunk's start)."""
        self._update(lambda doc, attempt: _add_outage(doc, stage, seconds))

    @_best_effort
    def attempt_finished(self) -> None:
        with self._mutex:
            doc = self.read()
            attempt, self._attempt_id = _attempt(doc, self._attempt_id), ""
            if attempt is not None and attempt["state"] == RUNNING:
                finish_attempt(doc, attempt, self.clock())
                self._write(doc)
