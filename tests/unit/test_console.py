"""The quiet console (rlhf_core.ops.console): what reaches the console, what only the log file, and when the file
is written. In-process, with a stand-in for Prefect's console handler; the real `rlhf train` is checked in
tests/integration/test_console.py."""

from __future__ import annotations

import io
import logging
import warnings

import pytest

from flows.stage_report import progress_line  # imports prefect, which sets up logging: before the fixtures
from rlhf_core.ops import console, ray_output
from rlhf_core.ops.run_log import RunLogHandler, log_file_for
from rlhf_core.ops.progress import render_live_bar


class _Terminal(io.StringIO):
    """A console that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def quiet(tmp_path):
    """A console handler on the root logger (as Prefect's is), then the quiet console on top; undone after."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    import ray  # noqa: F401 - Ray's own console handler exists; ours beside it, so what Ray prints is seen

    ray_handler = logging.StreamHandler(stream)
    logging.getLogger("ray").addHandler(ray_handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    log_file = tmp_path / "run" / "logs" / "driver.log"

    def setup(verbose: bool = False, terminal: bool = False):
        shown = _Terminal() if terminal else io.StringIO()
        for console_handler in (handler, ray_handler):
            console_handler.setStream(shown)
        console.configure_console(str(log_file), verbose)
        return shown, log_file

    yield setup
    console.reset_console()
    root.removeHandler(handler)
    logging.getLogger("ray").removeHandler(ray_handler)
    root.setLevel(old_level)


def test_log_file_is_in_a_local_run_folder_and_local_for_an_object_store(tmp_path, monkeypatch):
    assert log_file_for(str(tmp_path / "ckpt" / "run1"), "run1") == \
        str(tmp_path / "ckpt" / "run1" / "logs" / "driver.log")
    monkeypatch.chdir(tmp_path)
    assert log_file_for("s3://bucket/ckpt/run1", "run1") == str(tmp_path / "rlhf-logs" / "run1.log")


def test_library_and_prefect_noise_go_to_the_file_only_and_errors_to_both(quiet):
    stream, log_file = quiet()
    logging.getLogger("prefect").info("Starting temporary server on http://127.0.0.1:8000")
    logging.getLogger("prefect.task_runs").info("Finished in state Completed()")
    logging.getLogger("flows.pipeline").info("sft [#---] 1/4 chunks  step 5/20  loss 2.7")
    logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU.")
    logging.getLogger("ray._private.authentication").warning("Token authentication is enabled")
    logging.getLogger("ray._private.worker").error("a worker died")
    for _ in range(2):
        logging.getLogger("rlhf_core.driver.resume").warning("set aside step_10")
    console.open_log_file()
    shown = stream.getvalue()
    assert "chunks  step 5/20" in shown and "a worker died" in shown
    assert shown.count("set aside step_10") == 1, "a warning shows once"
    for noise in ("temporary server", "Finished in state", "Setting accelerator", "Token authentication"):
        assert noise not in shown
    written = log_file.read_text()
    for line in ("temporary server", "Finished in state", "chunks  step 5/20", "Setting accelerator to CPU",
                 "Token authentication", "a worker died"):
        assert line in written
    assert written.count("set aside step_10") == 2, "the file keeps every record"


def test_an_alert_is_one_bare_rlhf_warning_line_on_the_console_and_a_record_in_the_file(quiet):
    """An alert's record (rlhf_core.ops.alerts.announce) on the console is the line itself, not the console handler's
    format around it; other records keep that format, and undoing the console gives the handler its formatter."""
    from rlhf_core.ops.alerts import ALERT_REWARD_STAGNANT, Alert, announce

    handler = [h for h in logging.getLogger().handlers if type(h) is logging.StreamHandler][-1]  # the fixture's
    prefect_like = logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s")
    handler.setFormatter(prefect_like)
    stream, log_file = quiet()
    announce(Alert(ALERT_REWARD_STAGNANT, "exp1", "ppo", 6, "ppo reward has not improved for 3 committed checkpoints."))
    logging.getLogger("rlhf_core.driver.resume").warning("set aside step_10")
    console.open_log_file()
    lines = stream.getvalue().splitlines()
    assert "rlhf: warning: ppo reward has not improved for 3 committed checkpoints. (rlhf.alert.reward-stagnant)" \
        in lines, lines
    assert any(line.endswith("| WARNING | rlhf_core.driver.resume - set aside step_10") for line in lines), lines
    assert "WARNING rlhf_core.ops.alerts - rlhf: warning: ppo reward has not improved" in log_file.read_text()
    console.reset_console()
    assert handler.formatter is prefect_like


def test_a_stop_is_one_line_on_the_console_and_prefects_cancelled_states_stay_in_the_file(quiet):
    """The stop sentence is the CLI's last line; Prefect's task, subflow and flow runs each log their Cancelled
    state with it (the task's at ERROR): those go to the log file (and Prefect's API) only. Other Cancelled
    states and errors stay on the console."""
    import signal

    from prefect.states import Cancelled

    from rlhf_core.driver.stop import StoppedBySignal

    stream, log_file = quiet()
    cancelled = f"Finished in state {Cancelled(message=str(StoppedBySignal(signal.SIGINT, 'sft', 8, '/c/sft')))}"
    # Straight to the root's handlers: Prefect's API handler, outside a run, would complain of no run context.
    root = logging.getLogger()
    root.handle(_record("prefect.task_runs", cancelled, logging.ERROR))
    for _ in range(2):  # the stage's subflow run, then the flow run
        root.handle(_record("prefect.flow_runs", cancelled, logging.INFO))
    root.handle(_record("prefect.flow_runs", "Finished in state Cancelled('cancelled from the UI')", logging.INFO))
    console.open_log_file()
    shown = stream.getvalue()
    assert "stopped by SIGINT" not in shown, shown
    assert "cancelled from the UI" in shown
    assert log_file.read_text().count("stopped by SIGINT at step 8; committed step_8 in /c/sft") == 3


def test_verbose_shows_everything(quiet):
    stream, _ = quiet(verbose=True)
    logging.getLogger("prefect").info("Starting temporary server on http://127.0.0.1:8000")
    logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU.")
    logging.getLogger("ray._private.authentication").warning("Token authentication is enabled")
    shown = stream.getvalue()
    assert "temporary server" in shown and "Token authentication" in shown
    # DeepSpeed's own handler prints it (not the root's), when deepspeed is imported; here: it was not gated.
    assert not any(isinstance(f, console._CopyToFileThenGate) and not f.filter(_record("DeepSpeed"))
                   for f in logging.getLogger("DeepSpeed").filters)


def _record(name: str, message: str = "message", level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_the_file_is_written_only_once_the_run_is_real(quiet):
    _, log_file = quiet()
    logging.getLogger("rlhf_core.driver.preflight").warning("before preflight passed")
    assert not log_file.exists()
    console.discard_log_file()  # a run refused by preflight (UserError)
    assert not log_file.exists()
    logging.getLogger("rlhf_core.driver.chunk").warning("training")
    console.open_log_file()
    written = log_file.read_text()
    assert "training" in written and "before preflight passed" not in written


def test_ray_actor_and_raylet_output_goes_to_the_file_only(quiet, capsys):
    _, log_file = quiet()
    console.open_log_file()
    actor = {"pid": 123, "ip": "10.0.0.1", "actor_name": "TrainWorker", "is_err": True,
             "lines": ["[WARNING] Setting accelerator to CPU.", "Loading weights: 100%"]}
    raylet = {"pid": "raylet", "ip": "10.0.0.1", "is_err": True, "lines": ["Task killed due to the node running "
                                                                           "low on memory."]}
    for batch in (actor, raylet):
        ray_output._write_worker_batch(batch)
        ray_output._print_cluster_lines(batch)
    err = capsys.readouterr().err
    assert "Task killed" not in err  # the run's own line says it (rlhf_core.driver.engine)
    assert "TrainWorker" not in err and "Loading weights" not in err
    written = log_file.read_text()
    assert "(TrainWorker pid=123, ip=10.0.0.1) [WARNING] Setting accelerator to CPU." in written
    assert "Loading weights: 100%" in written and "(pid=raylet, ip=10.0.0.1) Task killed" in written


def test_python_warnings_once_and_library_deprecations_in_the_file_only(quiet, capsys):
    _, log_file = quiet()
    console.open_log_file()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = console._show_warning  # catch_warnings restored the pytest-time one
        for _ in range(2):
            warnings.warn("a setting was ignored", UserWarning)
            warnings.warn("`foo` is deprecated", FutureWarning)
    err = capsys.readouterr().err
    assert err.count("UserWarning: a setting was ignored") == 1
    assert "deprecated" not in err
    assert log_file.read_text().count("FutureWarning: `foo` is deprecated") == 2


def test_without_configure_console_nothing_changes():
    console.reset_console()
    assert console.configured_log_file() is None
    assert ray_output.ray_init_options() == {"log_to_driver": True, "logging_level": logging.WARNING}
    ray_output.route_ray_worker_output()  # a deployment run's worker: no-op
    console.open_log_file()


def test_autoscaler_status_tables_are_left_out_without_breaking_rays_log_thread(quiet, capsys):
    """Ray prints only the autoscaler's events, not its status table every 5 s; here Ray is not initialized,
    so Ray's filter cannot even run: nothing is written and nothing raises (it runs in Ray's log thread)."""
    _, log_file = quiet()
    console.open_log_file()
    batch = {"pid": "autoscaler", "ip": "10.0.0.1", "is_err": False,
             "lines": ["======== Autoscaler status: 2026-11-30 ========", "Node status"]}
    ray_output._write_worker_batch(batch)
    ray_output._print_cluster_lines(batch)
    assert "Autoscaler status" not in capsys.readouterr().err
    assert "Autoscaler status" not in log_file.read_text()


# --- progress bars -------------------------------------------------------------------------------------


def _chunk_line(stage, num_done, num_chunks, step, total_steps, loss):
    """The flow's real chunk line, so that a change of its format shows here."""
    return progress_line(stage, (num_done, num_chunks), (step, total_steps), {"loss": loss}, f"trained {step} steps")


def test_live_bar_rendering_follows_the_steps_and_names_the_chunks():
    assert render_live_bar("sft", 32, 64, "4/8", "  loss 2.97") == \
        "sft [###############---------------] 4/8 chunks  step 32/64  loss 2.97"
    assert render_live_bar("ppo", 0, 3) == "ppo [------------------------------] step 0/3"
    assert render_live_bar("rm", 7, 7, "2/2", width=4) == "rm [####] 2/2 chunks  step 7/7"


def test_on_a_terminal_each_stage_is_one_bar_redrawn_in_place_per_chunk_and_step(quiet, monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("COLUMNS", "200")
    terminal, log_file = quiet(terminal=True)
    assert console.live_progress()
    logger = logging.getLogger("prefect.flow_runs")
    logger.info(_chunk_line("sft", 1, 2, 4, 8, 2.5))
    console.show_step("sft", 5, 8, {"loss": 2.4, "lr": 1e-3})
    console.show_step("sft", 6, 8, {"loss": 2.3})
    logger.info(_chunk_line("sft", 2, 2, 8, 8, 2.1))  # the stage's last chunk: the bar ends its line
    console.show_step("rm", 1, 4, {"loss": 0.69})
    logging.getLogger("rlhf_core.driver.resume").warning("set aside step_2")  # another line ends the bar first
    console.show_step("rm", 2, 4, {"loss": 0.6})
    shown = terminal.getvalue()
    lines = shown.split("\n")
    assert lines[0].split("\r")[1:] == [
        "sft [###############---------------] 1/2 chunks  step 4/8: trained 4 steps  loss 2.5\x1b[K",
        "sft [###################-----------] 1/2 chunks  step 5/8  loss 2.4\x1b[K",
        "sft [######################--------] 1/2 chunks  step 6/8  loss 2.3\x1b[K",
        "sft [##############################] 2/2 chunks  step 8/8: trained 8 steps  loss 2.1\x1b[K"]
    assert lines[1] == "\rrm [########----------------------] step 1/4  loss 0.69\x1b[K"
    assert lines[2] == "set aside step_2"
    assert lines[3] == "\rrm [###############---------------] step 2/4  loss 0.6\x1b[K"  # drawn again, open
    assert "chunks  step" not in "".join(line for line in lines if "\r" not in line)  # no plain chunk line
    console.open_log_file()
    assert "1/2 chunks  step 4/8" in log_file.read_text(), "the log file keeps every chunk line"
    assert terminal.getvalue().endswith("\x1b[K\nfull log (Ray actors, DeepSpeed, Prefect) in " + str(log_file) + "\n")
    console.show_step("rm", 3, 4, {"loss": 0.5})
    console.reset_console()  # the end of the run ends the open bar's line
    assert terminal.getvalue().endswith("step 3/4  loss 0.5\x1b[K\n")


def test_not_on_a_terminal_or_verbose_the_chunk_lines_stay_lines(quiet):
    for terminal, verbose in ((False, False), (True, True)):
        stream, _ = quiet(verbose=verbose, terminal=terminal)
        assert not console.live_progress()
        logging.getLogger("prefect.flow_runs").info(_chunk_line("sft", 1, 2, 4, 8, 2.5))
        console.show_step("sft", 5, 8, {"loss": 2.4})
        assert stream.getvalue() == "sft [#####-----] 1/2 chunks  step 4/8: trained 4 steps  loss 2.5\n"


def test_the_bar_is_cut_to_the_terminal_width_since_a_wrapped_line_cannot_be_redrawn(quiet, monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("COLUMNS", "40")
    terminal, _ = quiet(terminal=True)
    console.show_step("sft", 5, 8, {"loss": 2.4})
    assert terminal.getvalue() == "\r" + "sft [###################-----------] step 5/8  loss 2.4"[:39] + "\x1b[K"


def test_a_rank_warning_or_a_python_warning_ends_the_bar_line_first(quiet, monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("COLUMNS", "200")
    terminal, _ = quiet(terminal=True)
    console.show_step("ppo", 1, 4, {"reward": 0.5})
    monkeypatch.setattr(console.sys, "stderr", terminal)  # where rank warnings and Python warnings print
    ray_output._print_cluster_lines({"pid": 7, "lines": [console.RANK_WARNING_PREFIX + "flag has no effect"]})
    console._show_warning(UserWarning("odd"), UserWarning, "x.py", 1)
    console.show_step("ppo", 2, 4, {"reward": 0.6})
    lines = terminal.getvalue().split("\n")
    assert lines[0] == "\rppo [########----------------------] step 1/4  reward 0.5\x1b[K"
    assert lines[1] == console.RANK_WARNING_PREFIX + "flag has no effect"
    assert lines[2].endswith("UserWarning: odd")
    assert lines[3].startswith("\rppo [###############")


def test_a_log_file_on_a_full_disk_is_one_warning_and_no_traceback(capfd):
    """/dev/full fails every write with ENOSPC, as a log folder on a full disk does: the run's log handler says so
    once and stops writing; logging goes on, and no logging traceback reaches the console."""
    handler = RunLogHandler("/dev/full")
    logger = logging.getLogger("rlhf_core.test_full_log")
    logger.addHandler(handler)
    try:
        logger.warning("held until the run is real")
        handler.open()
        for index in range(50):
            logger.warning("record %d", index)
    finally:
        logger.removeHandler(handler)
        handler.close()
    errors = capfd.readouterr().err
    assert errors.count("rlhf: warning: cannot write the run's log file /dev/full (No space left on device)") == 1
    assert "Traceback" not in errors and "Logging error" not in errors, errors[-2000:]
