"""The quiet console (rlhf_core.console): what reaches the console, what only the log file, and when the file
is written. In-process, with a stand-in for Prefect's console handler; the real `rlhf train` is checked in
tests/integration/test_console.py."""

from __future__ import annotations

import io
import logging
import warnings

import pytest

from rlhf_core import console


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

    def setup(verbose: bool = False):
        console.configure_console(str(log_file), verbose)
        return stream, log_file

    yield setup
    console.reset_console()
    root.removeHandler(handler)
    logging.getLogger("ray").removeHandler(ray_handler)
    root.setLevel(old_level)


def test_log_file_is_in_a_local_run_folder_and_local_for_an_object_store(tmp_path, monkeypatch):
    assert console.log_file_for(str(tmp_path / "ckpt" / "run1"), "run1") == \
        str(tmp_path / "ckpt" / "run1" / "logs" / "driver.log")
    monkeypatch.chdir(tmp_path)
    assert console.log_file_for("s3://bucket/ckpt/run1", "run1") == str(tmp_path / "rlhf-logs" / "run1.log")


def test_library_and_prefect_noise_go_to_the_file_only_and_errors_to_both(quiet):
    stream, log_file = quiet()
    logging.getLogger("prefect").info("Starting temporary server on http://127.0.0.1:8000")
    logging.getLogger("prefect.task_runs").info("Finished in state Completed()")
    logging.getLogger("flows.pipeline").info("sft [#---] 1/4 chunks  step 5/20  loss 2.7")
    logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU.")
    logging.getLogger("ray._private.authentication").warning("Token authentication is enabled")
    logging.getLogger("ray._private.worker").error("a worker died")
    for _ in range(2):
        logging.getLogger("rlhf_core.resume").warning("set aside step_10")
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


def _record(name: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, "message", None, None)


def test_the_file_is_written_only_once_the_run_is_real(quiet):
    _, log_file = quiet()
    logging.getLogger("rlhf_core.preflight").warning("before preflight passed")
    assert not log_file.exists()
    console.discard_log_file()  # a run refused by preflight (UserError)
    assert not log_file.exists()
    logging.getLogger("rlhf_core.chunk").warning("training")
    console.open_log_file()
    written = log_file.read_text()
    assert "training" in written and "before preflight passed" not in written


def test_ray_actor_output_goes_to_the_file_and_cluster_lines_to_the_console(quiet, capsys):
    _, log_file = quiet()
    console.open_log_file()
    actor = {"pid": 123, "ip": "10.0.0.1", "actor_name": "TrainWorker", "is_err": True,
             "lines": ["[WARNING] Setting accelerator to CPU.", "Loading weights: 100%"]}
    raylet = {"pid": "raylet", "ip": "10.0.0.1", "is_err": True, "lines": ["Task killed due to the node running "
                                                                           "low on memory."]}
    for batch in (actor, raylet):
        console._write_worker_batch(batch)
        console._print_cluster_lines(batch)
    err = capsys.readouterr().err
    assert "(raylet) Task killed" in err
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
    assert console.ray_init_options() == {"log_to_driver": True, "logging_level": logging.WARNING}
    console.route_ray_worker_output()  # a deployment run's worker: no-op
    console.open_log_file()


def test_autoscaler_status_tables_are_left_out_without_breaking_rays_log_thread(quiet, capsys):
    """Ray prints only the autoscaler's events, not its status table every 5 s; here Ray is not initialized,
    so Ray's filter cannot even run: nothing is written and nothing raises (it runs in Ray's log thread)."""
    _, log_file = quiet()
    console.open_log_file()
    batch = {"pid": "autoscaler", "ip": "10.0.0.1", "is_err": False,
             "lines": ["======== Autoscaler status: 2026-11-30 ========", "Node status"]}
    console._write_worker_batch(batch)
    console._print_cluster_lines(batch)
    assert "Autoscaler status" not in capsys.readouterr().err
    assert "Autoscaler status" not in log_file.read_text()
