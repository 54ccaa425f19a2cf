"""Issue 33's and 44's scale table: `rlhf train {sft,rm,dpo,ppo,prm}` on each stage's hub-shaped data at 1k and 1M
rows (bench/data_scale_stages.py: a local Hugging Face cache, parquet shards, message lists and
--apply_chat_template where the stage takes them), as a user runs it.

    .venv/bin/python bench/data_scale.py [--stages sft,rm,dpo,ppo,prm] [--rows 1000,1000000] [--workdir DIR]
                                         [--skip_kill]

Each run is a fresh process on Prefect's ephemeral server with a private home, `--save_steps 8`:

- first: a new run name, nothing prepared: command to the end of step 1 (the rank's test hook `train_step@2`
  touches a marker in RLHF_FAULT_STATE; its mtime is the time);
- warm: a new run name again, the data prepared by the first: command to the end of step 1;
- kill: the first run goes on to commit step 8 (`after_commit@8`), is SIGKILLed as a whole (its process group),
  and the same command runs again: command to the end of its first newly trained step (step 9: `train_step@10`).

Peak memory: the highest VmHWM of the driver (the command's process), of the rank (the Ray worker whose command
line names the rank actor) and of each preparation worker (`rlhf_core.data.workers`, forked from multiprocessing's
fork server), read from /proc every 0.2 s. Nothing here asserts a timing; the numbers land in
bench/.cache/data-scale.json and as one table on stdout. The preparation's rows/s against OpenRLHF's datasets.map:
bench/prep_side_by_side.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
CACHE_DIR = os.path.join(BENCH_DIR, ".cache")
sys.path.insert(0, os.path.dirname(BENCH_DIR))
from bench.data_scale_stages import SHAPES, STAGES, command, write_hub_dataset  # noqa: E402
RANK_MARKERS = ("ray::TrainWorker",)  # how a rank's command line reads under Ray
WORKER_MARKER = "multiprocessing.forkserver"  # a preparation's worker processes (and their fork server)


def _read_hwm_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def _is_rank(pid: int) -> bool:
    return any(marker in _command(pid) for marker in RANK_MARKERS)


class Watched:
    """A command in its own process group, its peak memory sampled until it ends or is killed."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: str):
        self.log = open(log_path, "ab")
        self.launched = time.time()
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.driver_kib = self.rank_kib = self.worker_kib = 0
        self.seconds: float | None = None  # launch to the moment it was waited for (`wait_for`)

    def sample(self) -> None:
        self.driver_kib = max(self.driver_kib, _read_hwm_kib(self.process.pid))
        for pid in _descendants(self.process.pid):
            if _is_rank(pid):
                self.rank_kib = max(self.rank_kib, _read_hwm_kib(pid))
            elif WORKER_MARKER in _command(pid):
                self.worker_kib = max(self.worker_kib, _read_hwm_kib(pid))

    def wait_for(self, path: str, timeout_s: float) -> float:
        """Seconds from launch to the mtime of `path` (a fault hook's marker)."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            self.sample()
            if self.process.poll() is not None:
                raise RuntimeError(f"the run ended (rc {self.process.returncode}) before {path} appeared; "
                                   f"see {self.log.name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")
            time.sleep(0.2)
        self.sample()
        return os.stat(path).st_mtime - self.launched

    def kill(self) -> None:
        """SIGKILL the whole command (its process group), as a user's kill -9 of the job would."""
        for pid in [self.process.pid, *_descendants(self.process.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.log.close()


def hooked_env(base: dict[str, str], state: str, rules: str) -> dict[str, str]:
    os.makedirs(state, exist_ok=True)
    return {**base, "RLHF_FAULT_INJECT": rules, "RLHF_FAULT_STATE": state}


def measure(stage: str, num_rows: int, workdir: str, model: str, env: dict[str, str], timeout_s: float,
            kill: bool) -> dict:
    """first, warm and kill-to-next-step seconds, and the peak memory of driver and rank, of `stage` at `num_rows`."""
    folder = os.path.join(workdir, f"{stage}-{num_rows}")
    os.makedirs(folder, exist_ok=True)
    ckpt, log = os.path.join(folder, "ckpt"), os.path.join(folder, "run.log")
    data = write_hub_dataset(env["HF_HOME"], SHAPES[stage], num_rows)

    def run(run_name: str, out: str, rules: str, label: str) -> tuple[Watched, str]:
        state = os.path.join(folder, f"state-{label}")
        return Watched(command(stage, model, data, num_rows, ckpt, os.path.join(folder, out), run_name),
                       hooked_env(env, state, rules), log), state

    result: dict = {"stage": stage, "rows": num_rows}
    first, state = run("first", "out1", "train_step@2=sleep:0,after_commit@8=sleep:0", "first")
    try:
        result["first_s"] = first.wait_for(os.path.join(state, "train_step@2"), timeout_s)
        if kill:
            first.wait_for(os.path.join(state, "after_commit@8"), timeout_s)
    finally:
        first.kill()
    result.update(driver_peak_mb=first.driver_kib / 1024, rank_peak_mb=first.rank_kib / 1024,
                  worker_peak_mb=first.worker_kib / 1024)
    if kill:
        resumed, state = run("first", "out1", "train_step@10=sleep:0", "resume")
        result["kill_to_next_step_s"] = _time_to(resumed, os.path.join(state, "train_step@10"), timeout_s)
    warm, state = run("warm", "out2", "train_step@2=sleep:0", "warm")
    result["warm_s"] = _time_to(warm, os.path.join(state, "train_step@2"), timeout_s)
    result.update(driver_peak_mb=max(result["driver_peak_mb"], warm.driver_kib / 1024),
                  rank_peak_mb=max(result["rank_peak_mb"], warm.rank_kib / 1024))
    return result


def _time_to(watched: Watched, marker: str, timeout_s: float) -> float:
    """Seconds from the command's start to `marker` (a fault hook's), then the command is killed."""
    try:
        return watched.wait_for(marker, timeout_s)
    finally:
        watched.kill()


def format_rows(results: list[dict]) -> str:
    def cell(value, unit=""):
        return "-" if value is None else f"{value:.1f}{unit}"

    lines = ["| stage | rows | first prep + step 1 | warm: step 1 | kill -> next step | driver peak | rank peak | "
             "preparation worker peak (each) |", "|---|---|---|---|---|---|---|---|"]
    for row in results:
        lines.append(f"| {row['stage']} | {row['rows']:,} | {cell(row.get('first_s'), ' s')} | "
                     f"{cell(row.get('warm_s'), ' s')} | {cell(row.get('kill_to_next_step_s'), ' s')} | "
                     f"{cell(row.get('driver_peak_mb'), ' MB')} | {cell(row.get('rank_peak_mb'), ' MB')} | "
                     f"{cell(row.get('worker_peak_mb'), ' MB')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default=",".join(STAGES), help="Comma-separated stages.")
    parser.add_argument("--rows", default="1000,1000000", help="Comma-separated row counts.")
    parser.add_argument("--workdir", default=None, help="Where data and checkpoints go (default: a temp folder).")
    parser.add_argument("--timeout_s", type=float, default=3600.0, help="Longest wait for one marker.")
    parser.add_argument("--skip_kill", action="store_true", help="Skip the kill-and-rerun measure.")
    parser.add_argument("--keep", action="store_true", help="Keep the work folder.")
    args = parser.parse_args()
    from rlhf_core.toy import init_toy

    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-data-scale-")
    os.makedirs(workdir, exist_ok=True)
    model = init_toy(os.path.join(workdir, "toy"))["model"]
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_API", "RLHF_FAULT"))}
    env.update(PREFECT_HOME=os.path.join(workdir, "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               HF_HOME=os.path.join(workdir, "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results = []
    try:
        for stage in args.stages.split(","):
            for num_rows in (int(part) for part in args.rows.split(",") if part.strip()):
                try:
                    results.append(measure(stage, num_rows, workdir, model, env, args.timeout_s, not args.skip_kill))
                except (RuntimeError, TimeoutError) as error:  # one stage's failure leaves the others' rows
                    results.append({"stage": stage, "rows": num_rows, "error": str(error)})
                print(json.dumps(results[-1]), flush=True)
    finally:
        os.makedirs(CACHE_DIR, exist_ok=True)
        with open(os.path.join(CACHE_DIR, "data-scale.json"), "w") as handle:
            json.dump(results, handle, indent=2)
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()}")
    print(format_rows(results))


if __name__ == "__main__":
    main()
