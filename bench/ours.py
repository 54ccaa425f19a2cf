"""Our side of the suite: the project's own code paths, timed in this process (a local Ray, real DeepSpeed).

- `step_seconds`: a worker group of one rank trains step by step (`WorkerGroup.train_until(s)`), each
  step timed from the driver; the suite takes the median after warm-up. Per-step medians resist the
  noise of a shared machine, and no checkpoint or evaluation falls inside the steps (the RM evaluates
  at every checkpoint step, which TRL's defaults never do).
- `stall_and_commit`, `copy_rank_tensors`: a chunk's checkpoint timers, and the in-memory copy of a rank's
  tensors its stall is held against (the `ckpt` section, `ckpt_costs.py`, uses them).
- `chunk_boundaries`: the `rlhf` Prefect flow in this process, with `WorkerGroup.train_until` wrapped to
  record when each chunk's training is collected: the period between two chunks, less the ranks' own
  step-loop seconds ("step_loop", else "train"), is everything a warm chunk costs outside training
  (snapshot, commit, Prefect's task, cache and result, planning).
- `startup_seconds`: the `rlhf train sft` command in a subprocess, until its first step has trained; `rows_file`
  its 1,000 rows, `running_ray_head` the cluster a warm command joins.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Iterator

BATCH = 8
MAX_LEN = 64
LEARNING_RATE = 1e-4
TOY_SAMPLES = 256  # per toy data set (rlhf_core.toy.make_datasets)


def stage_config(stage: str, toy: dict[str, str], model_dir: str, out_dir: str, num_steps: int, save_steps: int,
                 param_dtype: str = "fp32", grpo: dict | None = None):
    """One stage's settings, matching trl_side.py's: batch BATCH in one micro-batch, max length MAX_LEN."""
    from rlhf_core.stages.ppo import PPOConfig
    from rlhf_core.stages.rm import RMConfig
    from rlhf_core.stages.sft import SFTConfig

    common = {"pretrain": model_dir, "learning_rate": LEARNING_RATE, "save_steps": save_steps,
              "param_dtype": param_dtype, "save_path": out_dir}
    if stage == "sft":  # past one pass over the 256 toy samples, more epochs
        num_epochs = -(-num_steps * BATCH // TOY_SAMPLES)
        return SFTConfig(dataset=toy["sft"], input_key="prompt", output_key="response", max_len=MAX_LEN,
                         input_template=None,  # the prompts as written, as the TRL side trains on them
                         train_batch_size=BATCH, micro_train_batch_size=BATCH, max_epochs=num_epochs,
                         max_samples=num_steps * BATCH if num_epochs == 1 else None, **common)
    if stage == "rm":
        # No pair held out (OpenRLHF's default): num_steps batches of pairs fill num_steps.
        return RMConfig(dataset=toy["prefs"], prompt_key="prompt", max_len=MAX_LEN, train_batch_size=BATCH,
                        micro_train_batch_size=BATCH, max_samples=num_steps * BATCH, **common)
    samples = grpo["prompts"] * grpo["generations"]
    return PPOConfig(prompt_data=toy["prompts"], input_key="prompt", reward_fn="rlhf_core.toy:gold_reward",
                     advantage_estimator="group_norm", n_samples_per_prompt=grpo["generations"],
                     rollout_batch_size=grpo["prompts"], micro_rollout_batch_size=samples, train_batch_size=samples,
                     micro_train_batch_size=samples, max_new_tokens=grpo["max_new_tokens"], temperature=1.0,
                     init_kl_coef=0.0, max_samples=num_steps * grpo["prompts"], **common)


def stage_run(workdir: str, name: str, stage: str, cfg, **extra):
    from rlhf_core.driver.plan import resolve_paths
    from rlhf_core.config import RunConfig

    return resolve_paths(RunConfig(run_name=name, stages=[stage], ckpt_path=os.path.join(workdir, "ckpt"),
                                   num_workers=1, **{stage: cfg}, **extra))


def step_seconds(run, stage: str, num_steps: int) -> list[float]:
    """Seconds of each of `num_steps` optimizer steps (PPO steps for ppo), one rank, timed from the driver."""
    from rlhf_core.driver.plan import plan_stage
    from rlhf_core.driver.engine import WorkerGroup

    plan = plan_stage(run, stage)
    group = WorkerGroup(run)
    try:
        group.setup(run, stage, plan.targets)
        seconds = []
        for step in range(1, min(num_steps, plan.total_steps) + 1):
            started = time.perf_counter()
            group.train_until(step)
            seconds.append(time.perf_counter() - started)
        return seconds
    finally:
        group.shutdown()


def stall_and_commit(seconds: dict[str, float]) -> tuple[float, float]:
    """(training stall, save-to-commit wall) of one chunk from its own timers: with asynchronous
    checkpoints "stall" + "commit", else the synchronous "save_and_commit" is both."""
    if "stall" in seconds:
        return seconds["stall"], seconds["stall"] + seconds.get("commit", 0.0)
    return seconds["save_and_commit"], seconds["save_and_commit"]


def copy_rank_tensors(worker, repeat: int) -> dict:
    """Runs inside a rank (`__ray_call__`): seconds to clone, once, every tensor a checkpoint holds (the
    models' weights, the optimizer's parameters, e.g. ZeRO's fp32 partitions, and its state); median of
    `repeat`. The reference an in-memory snapshot is held against."""
    import torch

    tensors: dict[int, torch.Tensor] = {}
    for engine in worker.trainer.engines.values():
        tensors.update((t.data_ptr(), t) for t in engine.module.state_dict().values())
        optimizer = engine.optimizer
        while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer
        tensors.update((p.data_ptr(), p) for group in optimizer.param_groups for p in group["params"])
        tensors.update((v.data_ptr(), v) for state in optimizer.state.values() for v in state.values()
                       if torch.is_tensor(v) and v.dim() > 0)
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        copies = [tensor.detach().clone() for tensor in tensors.values()]
        seconds.append(time.perf_counter() - started)
        del copies
    return {"seconds": statistics.median(seconds),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def interim_stalls(worker, repeat: int) -> dict:
    """Runs inside a rank (`__ray_call__`): the training stall of a snapshot between commits
    (`rlhf_core.rank.interim`), taken `repeat` + 2 times at the rank's step; the first two fill the two slots' pages
    (reported apart as `first`), the median of the rest is what every later one costs. `interval`: K as the rank then
    chooses it from its step times."""
    interim, trainer = worker._interim, worker.trainer
    seconds = []
    for index in range(repeat + 2):
        interim.take(trainer.step + 1 + index, trainer.engines.values(), trainer.save_state, [])
        seconds.append(interim.stall_seconds)
    return {"seconds": statistics.median(seconds[2:]), "first": seconds[0], "interval": interim.interval,
            "step_seconds": interim.median_step_seconds()}


def local_path(uri: str) -> str:
    return uri[len("file://"):] if uri.startswith("file://") else uri


def wait_committed(step_dir: str, timeout_s: float = 300.0) -> None:
    """Asynchronous commits may still be writing when the chunk returns: wait for the manifest."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(os.path.join(step_dir, "MANIFEST.json")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{step_dir} was not committed within {timeout_s:.0f} s")
        time.sleep(0.2)


@contextlib.contextmanager
def recorded_training_spans():
    """Wrap `WorkerGroup.train_until` (the driver's call that trains a chunk) to record (start, end) of each."""
    from rlhf_core.driver.engine import WorkerGroup

    spans: list[tuple[float, float]] = []
    original = WorkerGroup.train_until

    def timed(self, target_step):
        started = time.perf_counter()
        try:
            return original(self, target_step)
        finally:
            spans.append((started, time.perf_counter()))

    WorkerGroup.train_until = timed
    try:
        yield spans
    finally:
        WorkerGroup.train_until = original


def chunk_boundaries(run) -> dict:
    """The `rlhf` flow over `run`'s chunks; (start, end) of every chunk's training and the flow's summary."""
    from flows.pipeline import rlhf

    with recorded_training_spans() as spans:
        started = time.perf_counter()
        summary = rlhf(config=run)
        wall = time.perf_counter() - started
    return {"spans": list(spans), "started": started, "wall": wall, "chunks": summary["sft"].get("chunks", [])}


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_prefect_server(env: dict[str, str], timeout_s: float = 120.0) -> Iterator[str]:
    """`prefect server start` on a free port, as users with the Prefect UI run it; yields its API URL."""
    import urllib.request

    port = _free_port()
    prefect = os.path.join(os.path.dirname(sys.executable), "prefect")
    server = subprocess.Popen([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    api_url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{api_url}/health", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"prefect server start did not answer on {api_url}") from None
                time.sleep(0.5)
        yield api_url
    finally:
        server.terminate()
        server.wait(timeout=30)


def startup_seconds(workdir: str, toy: dict[str, str], model_dir: str, env: dict[str, str],
                    state: str | None = None) -> float:
    """`rlhf train sft` over `toy["sft"]` in a subprocess: seconds from launch to the end of step 1.
    The end of step 1 is when the rank reaches the test hook `train_step@2` (RLHF_FAULT_INJECT with a
    no-op sleep): with RLHF_FAULT_STATE set, the hook touches a marker file, whose mtime we read. `state`: that
    folder, the same for a series of commands (the fault variables are part of what a spare rank process is kept
    for: `rlhf_core/driver/lingering.py`)."""
    state = state or tempfile.mkdtemp(prefix="bench-startup-state-", dir=workdir)
    marker = os.path.join(state, "train_step@2")
    if os.path.exists(marker):
        os.remove(marker)
    out = tempfile.mkdtemp(prefix="bench-startup-run-", dir=workdir)
    command = [os.path.join(os.path.dirname(sys.executable), "rlhf"), "train", "sft", "--pretrain", model_dir,
               "--dataset", toy["sft"], "--input_key", "prompt", "--output_key", "response",
               "--max_len", str(MAX_LEN), "--train_batch_size", str(BATCH), "--micro_train_batch_size", str(BATCH),
               "--learning_rate", str(LEARNING_RATE), "--max_epochs", "1", "--input_template", "{}",
               "--ckpt_path", os.path.join(out, "ckpt"), "--save_path", os.path.join(out, "out")]
    child_env = {**env, "RLHF_FAULT_INJECT": "train_step@2=sleep:0", "RLHF_FAULT_STATE": state}
    launched = time.time()
    subprocess.run(command, env=child_env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return os.stat(marker).st_mtime - launched


def rows_file(source: str, num_rows: int, path: str) -> str:
    """A JSONL file of `num_rows` rows, `source`'s rows over and over."""
    with open(source) as handle:
        rows = [line for line in handle if line.strip()]
    with open(path, "w") as handle:
        handle.writelines(rows[index % len(rows)] for index in range(num_rows))
    return path


@contextlib.contextmanager
def running_ray_head(timeout_s: float = 120.0) -> Iterator[str]:
    """`ray start --head` on a free loopback port (2 CPUs), as a user's cluster runs; yields its address."""
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="rlhf-bench-ray-")
    log_path = os.path.join(temp_dir, "head.log")
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    with open(log_path, "w") as log:
        head = subprocess.Popen([ray, "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                                 "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started." not in open(log_path).read():
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start --head did not start: {log_path}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        time.sleep(3)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)
