"""A rank process reset for the next command (`rlhf_core.rank.reuse`), in this process: each thing the last command
leaves is reset, or the process is refused. The same on a running Ray cluster, end to end:
tests/integration/test_lingering_spares.py."""

from __future__ import annotations

import os
import random
import sys
import threading

import pytest

from rlhf_core.rank import reuse
from rlhf_core.rank.threads import free_port
from rlhf_core.rank.reuse import ProcessBaseline, reset_for_reuse


def test_a_deepspeed_group_trains_again_after_the_reset(monkeypatch):
    """DeepSpeed caches the groups it derives from the process group (`deepspeed.utils.groups`): without the reset
    a second engine fails with "Group ... is not registered"."""
    torch = pytest.importorskip("torch")
    deepspeed = pytest.importorskip("deepspeed")
    baseline = ProcessBaseline.now()

    # The venv's ninja first, as a rank has it (`TrainWorker.join`): another ninja rebuilds DeepSpeed's op (~80 s).
    # torch's AdamW, as a CPU rank's (rank/ds_config.py): DeepSpeed's FusedAdam would JIT-build (~200 s on CI).
    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))

    def train_once(port: int) -> float:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        for name, value in {"MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        deepspeed.init_distributed()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": 2}})
        loss = engine(torch.ones(2, 4)).sum()
        engine.backward(loss)
        engine.step()
        return float(engine(torch.ones(2, 4)).sum())

    try:
        first = train_once(free_port())
        assert reset_for_reuse(baseline, zero_stage=2) == ""
        assert not torch.distributed.is_initialized()
        assert train_once(free_port()) == first  # a new group, the same arithmetic
    finally:
        reuse.end_process_group()


def _wait_for(event: threading.Event, seconds: float) -> None:  # a user's code, run in a thread
    event.wait(seconds)


def test_a_thread_the_last_command_left_running_refuses_the_process():
    baseline = ProcessBaseline.now()
    stop = threading.Event()
    thread = threading.Thread(target=_wait_for, args=(stop, 30), name="users-uploader", daemon=True)
    thread.start()
    try:
        assert reuse.threads_left(baseline, wait_s=0.2) == ["users-uploader"]
        assert "users-uploader" in reset_for_reuse(baseline, zero_stage=0)
    finally:
        stop.set()
        thread.join()
    quick = threading.Thread(target=_wait_for, args=(threading.Event(), 0.2), name="ends-soon")
    quick.start()
    assert reuse.threads_left(baseline, wait_s=2.0) == []  # waited for: it ended


def test_a_librarys_own_process_wide_thread_is_no_commands():
    """tqdm's monitor starts with the first progress bar and lives as long as the process: not the command's."""
    tqdm = pytest.importorskip("tqdm")
    baseline = ProcessBaseline.now()
    monitor = tqdm.tqdm.monitor_interval
    bar = tqdm.tqdm(range(3), disable=False, mininterval=0)
    list(bar)
    try:
        assert all("tqdm" not in name for name in reuse.threads_left(baseline, wait_s=0.1))
    finally:
        tqdm.tqdm.monitor_interval = monitor


def test_a_users_module_is_imported_again_as_edited(tmp_path, monkeypatch):
    module = tmp_path / "my_reward.py"
    module.write_text("BONUS = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    baseline = ProcessBaseline.now()
    import my_reward  # noqa: F401 - the last command's import

    import colorsys  # noqa: F401 - a library module the last command imported: kept
    assert sys.modules["my_reward"].BONUS == 1
    module.write_text("BONUS = 2\n")
    assert reset_for_reuse(baseline, zero_stage=0) == ""
    assert "my_reward" not in sys.modules and "colorsys" in sys.modules
    import my_reward as edited

    assert edited.BONUS == 2


def test_this_live_processs_snapshots_go_and_other_processes_stay(tmp_path, monkeypatch):
    from rlhf_core.rank import snapshot

    monkeypatch.setattr(snapshot, "SHM_ROOT", str(tmp_path))
    own = tmp_path / f"{snapshot.PREFIX}{os.getpid()}-rank0-abc"
    other = tmp_path / f"{snapshot.PREFIX}{os.getppid()}-rank0-def"  # a live process's: not ours to remove
    for folder in (own, other):
        folder.mkdir()
        (folder / "model.pt").write_bytes(b"x")
    assert reset_for_reuse(ProcessBaseline.now(), zero_stage=0) == ""
    assert not own.exists() and other.exists()


def test_a_fault_armed_for_this_process_is_disarmed(tmp_path, monkeypatch):
    from rlhf_core import faults

    monkeypatch.setenv(faults.STATE_ENV_VAR, str(tmp_path))
    (tmp_path / f"armed-{os.getpid()}").write_text("oom")
    (tmp_path / "armed-1").write_text("oom")
    assert reset_for_reuse(ProcessBaseline.now(), zero_stage=0) == ""
    assert not (tmp_path / f"armed-{os.getpid()}").exists() and (tmp_path / "armed-1").exists()


def test_the_random_generators_start_from_one_state_whatever_was_drawn():
    torch = pytest.importorskip("torch")
    numpy = pytest.importorskip("numpy")

    def draws() -> tuple:
        return random.random(), float(numpy.random.rand()), float(torch.rand(1))

    baseline = ProcessBaseline.now()
    random.seed(123)
    torch.manual_seed(123)
    assert reset_for_reuse(baseline, zero_stage=0) == ""
    clean = draws()
    for _ in range(5):
        draws()  # the last command's draws
    assert reset_for_reuse(baseline, zero_stage=0) == ""
    assert draws() == clean


def test_the_working_directory_comes_back(tmp_path):
    baseline = ProcessBaseline.now()
    os.chdir(tmp_path)
    try:
        assert reset_for_reuse(baseline, zero_stage=1) == ""
        assert os.getcwd() == baseline.cwd
    finally:
        os.chdir(baseline.cwd)


def test_zero3_refuses_the_process():
    assert "ZeRO-3" in reset_for_reuse(ProcessBaseline.now(), zero_stage=3)


def test_the_environment_key_changes_with_what_a_rank_inherits(monkeypatch, tmp_path):
    from rlhf_core.driver.lingering import environment_key

    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    key = environment_key()
    assert environment_key() == key
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    with_credentials = environment_key()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "other")
    other_credentials = environment_key()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with_path = environment_key()
    monkeypatch.chdir(tmp_path)
    elsewhere = environment_key()
    assert len({key, with_credentials, other_credentials, with_path, elsewhere}) == 5
    assert "s3cr3t" not in with_credentials and len(with_credentials) == 16
    monkeypatch.setenv("RLHF_FAULT_INJECT", "train_step@3=kill")  # a test's hooks: the claim hands them over
    assert environment_key() == elsewhere


def test_a_claimed_spare_takes_the_claiming_commands_fault_hooks_and_only_them(monkeypatch):
    from rlhf_core import faults

    monkeypatch.setenv("RLHF_FAULT_INJECT", "train_step@3=kill")  # the last command's
    monkeypatch.setenv("RLHF_FAULT_STATE", "/tmp/last-command")
    faults.take_fault_hooks({"RLHF_FAULT_STATE": "/tmp/this-command", "AWS_SECRET_ACCESS_KEY": "not a hook"})
    assert faults.fault_hooks() == {"RLHF_FAULT_STATE": "/tmp/this-command"}
    assert "AWS_SECRET_ACCESS_KEY" not in os.environ or os.environ["AWS_SECRET_ACCESS_KEY"] != "not a hook"
    faults.take_fault_hooks({})  # a command with no hooks: a spare of a fault test injects nothing in it
    assert faults.fault_hooks() == {}


def test_only_cpu_ranks_on_a_running_cluster_outlive_their_command(monkeypatch):
    from rlhf_core.config import RunConfig
    from rlhf_core.driver import lingering, ray_start
    from rlhf_core.stages.sft import SFTConfig

    run = RunConfig(sft=SFTConfig(pretrain="m", dataset="d"))
    bundle = {"CPU": 1.0}
    monkeypatch.setattr(lingering, "placement_bundle", lambda run: bundle)
    monkeypatch.setitem(ray_start._joined, "running", False)
    assert not lingering.lingers(run)  # a cluster this command started ends with it
    monkeypatch.setitem(ray_start._joined, "running", True)
    assert lingering.lingers(run)
    assert not lingering.lingers(run.model_copy(update={"spare_idle_s": 0}))
    bundle["GPU"] = 1
    assert not lingering.lingers(run)
