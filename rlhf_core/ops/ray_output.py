"""Ray's output on the quiet console (`rlhf_core.ops.console`): the actors' output and the raylet's error lines go to
the run's log file; the console keeps the autoscaler's events and the ranks' own rlhf_core warnings, once each.
docs/design-notes.md ("The quiet console") has how each is hooked (private Ray API, each with a fallback).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from rlhf_core.ops.console import (RANK_WARNING_PREFIX, WORKER_OUTPUT_LOGGER, gate_library_logger, current_console,
                                   end_live_line, stdstream_dispatcher)


def ray_init_options(client: bool = False) -> dict[str, Any]:
    """Extra `ray.init` arguments for the console: whether the actors' output comes to the driver at all, and
    Ray's driver log level (INFO when the log file takes it)."""
    console = current_console()
    if console is None:
        return {"log_to_driver": True, "logging_level": logging.WARNING}
    routable = not client and stdstream_dispatcher() is not None
    return {"log_to_driver": console.verbose or routable, "logging_level": logging.INFO}


def route_ray_worker_output() -> None:
    """After `ray.init`: the actors' output and the raylet's lines go to the log file; on the console only when
    verbose (and the autoscaler's events, a node lost or added, always)."""
    console = current_console()
    if console is None:
        return
    dispatcher = stdstream_dispatcher()
    if dispatcher is None:
        return
    gate_library_logger("ray", console.file_handler)
    try:
        from ray._private.worker import _global_node

        console.file_handler.handle(logging.LogRecord(
            __name__, logging.INFO, __file__, 0, "Ray session logs (every actor's output, per node): %s",
            # ray declares `_global_node = None` unannotated (ray.init sets it; None is the AttributeError below)
            (_global_node.get_logs_dir_path(),), None))  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        pass
    dispatcher.remove_handler("rlhf_log_file")
    dispatcher.add_handler("rlhf_log_file", _write_worker_batch)
    if not console.verbose:
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("ray_print_logs", _print_cluster_lines)
        _raylet_errors_to_the_file()


def _raylet_errors_to_the_file() -> None:
    """The raylet's error messages (a worker died: ten lines) reach the driver by another path than the actors'
    output: Ray's error thread prints them with `print_to_stdstream`, looked up in its module at each call. In
    quiet mode they go to the log file instead (private API: where the name moves, they stay on the console)."""
    from ray._private import worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "rlhf_routed", False):
        return

    def print_to_stdstream(data, ignore_prefix: bool):
        if data.get("pid") == "raylet" and current_console() is not None:
            _write_worker_batch(data)
            return
        original(data, ignore_prefix)

    print_to_stdstream.rlhf_routed = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream


def _worker_prefix(batch: dict) -> str:
    name = batch.get("actor_name") or batch.get("task_name") or ""
    return f"({name} pid={batch.get('pid')}, ip={batch.get('ip')})".replace("( pid", "(pid")


def _write_worker_batch(batch: dict) -> None:
    console = current_console()
    if console is None:
        return
    level = logging.WARNING if batch.get("is_err") else logging.INFO
    prefix = _worker_prefix(batch)
    for line in _cluster_lines(batch) if batch.get("pid") == "autoscaler" else batch.get("lines", []):
        record = logging.LogRecord(WORKER_OUTPUT_LOGGER, level, __file__, 0, f"{prefix} {line}", None, None)
        console.file_handler.handle(record)


def _cluster_lines(batch: dict) -> list[str]:
    """The autoscaler's events in a batch, as Ray's own printer picks them (not its status table every 5 s)."""
    try:
        from ray._private.worker import filter_autoscaler_events

        return list(filter_autoscaler_events(batch.get("lines", [])))
    except Exception:  # noqa: BLE001 - raising here would stop Ray's log thread; Ray's own needs the GCS client
        return []


def _print_cluster_lines(batch: dict) -> None:
    """Quiet mode's stand-in for Ray's printer: the autoscaler's events (a node lost or added), as Ray would
    print them, and the ranks' own rlhf_core warnings once each; no other actor output, and none of the raylet's
    (a dead worker's: the chunk's own line names the rank, its node and the cause, `rlhf_core.driver.engine`)."""
    console = current_console()
    source, lines = batch.get("pid"), batch.get("lines", [])
    if source == "autoscaler":
        lines = _cluster_lines(batch)
    else:
        for line in lines:
            if line.startswith(RANK_WARNING_PREFIX) and console is not None and console.first_time(line):
                end_live_line()
                sys.stderr.write(line + "\n")
        return
    for line in lines:
        end_live_line()
        sys.stderr.write(f"({source}) {line}\n")


_adopted_pids: set[str] = set()  # rank processes another job started that serve this command


def adopt_worker_output(pids: list[int]) -> None:
    """Show these processes' output as this job's own: ranks that outlived an earlier command
    (`rlhf_core.driver.lingering`) still belong to the job that started them, and Ray sends a process's output to
    its own job's driver only. Private API (the driver's job filter, the dispatcher's emit): where either has moved,
    their output stays in Ray's session logs."""
    from ray._private import worker as ray_worker

    dispatcher, global_worker = stdstream_dispatcher(), ray_worker.global_worker
    if dispatcher is None or not hasattr(global_worker, "_filter_logs_by_job") or not hasattr(dispatcher, "emit"):
        return
    if not _adopted_pids:
        own_job, emit = global_worker.current_job_id.hex(), dispatcher.emit

        def emit_this_commands(data: dict) -> None:
            if not data.get("job") or data["job"] == own_job or str(data.get("pid")) in _adopted_pids:
                emit(data)

        dispatcher.emit = emit_this_commands
        global_worker._filter_logs_by_job = False
    _adopted_pids.update(str(pid) for pid in pids)
