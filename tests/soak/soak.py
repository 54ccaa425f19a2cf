"""The chaos soak: per leg, an uninterrupted run of `rlhf/full` (toy SFT then PPO, 2 ranks on 2 Ray nodes), then
the same run again with faults from a seeded schedule, and nothing else done to it: no retry, no state change, no
new run. Then a row per fault (seconds to detect it and to the next training step, steps recomputed, whether a
commit was lost) and the totals: human actions, commits lost, whether the final weights equal the uninterrupted
run's tensor for tensor, and the faulted runs' wall time against the uninterrupted ones'.

`SHORT` is the suite's version (tests/integration/test_soak.py); `FULL` is `make soak`'s (about 30 minutes of
faulted run on the disk leg, then the S3 leg for the store outage)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.integration.conftest import PROJECT_DIR
from tests.soak.kinds import KINDS, NotNow
from tests.soak.observe import Evidence, committed_steps, read_console, read_log, training_now
from tests.soak import report
from tests.soak.report import FaultRow, LegTimes
from tests.soak.site import BUCKET, SoakSite

HANG_TIMEOUT_S = 20.0  # --hang_timeout_s of the soak's runs: a toy step takes well under a second
RUN_NAME = "soak"


@dataclass(frozen=True)
class Leg:
    """One store and the faults it holds, and the run's size (steps are the toy's: 256 SFT rows, 8 per step)."""

    name: str
    store: str  # "disk": a local folder (the power-cut filesystem when the site has one); "s3": moto
    kinds: tuple[str, ...]
    num_faults: int
    first_fault_s: float  # after the faulted run's first training step
    mean_interval_s: float
    recovered_after_s: float  # the next fault waits for a training step this long after the last one
    sft_epochs: int
    sft_save_steps: int
    ppo_prompts: int
    ppo_episodes: int
    ppo_save_steps: int


SHORT = (Leg("disk", "disk", ("rank_kill", "preemption", "flow_run_kill"), num_faults=3, first_fault_s=4,
             mean_interval_s=8, recovered_after_s=3, sft_epochs=16, sft_save_steps=32, ppo_prompts=32,
             ppo_episodes=1, ppo_save_steps=2),)
DISK_KINDS = ("rank_kill", "rank_hang", "oom", "flow_run_kill", "worker_kill", "preemption", "node_loss", "power_cut")
# The disk leg's uninterrupted run: about 24 minutes here (2 ranks on 2 cores train the toy SFT at ~43 steps/s
# and its PPO at ~17 steps/s), in chunks of 4-7 s; long enough that the faulted run, which now takes about 1.2
# times as long, is still training when its 12th fault is due (seed 0: about 1690 s after its first step; at 760
# epochs and 100 episodes the faulted run of the 3rd full soak ended at 1265 s, after 9). The S3 leg's is about
# 2 minutes; its outage lasts 2.
FULL = (Leg("disk", "disk", DISK_KINDS, num_faults=12, first_fault_s=60, mean_interval_s=120, recovered_after_s=10,
            sft_epochs=1064, sft_save_steps=256, ppo_prompts=256, ppo_episodes=140, ppo_save_steps=64),
        Leg("s3", "s3", ("store_outage", "rank_kill"), num_faults=2, first_fault_s=20, mean_interval_s=150,
            recovered_after_s=10, sft_epochs=40, sft_save_steps=128, ppo_prompts=256, ppo_episodes=8,
            ppo_save_steps=32))


def schedule(leg: Leg, rng: random.Random) -> list[tuple[float, str]]:
    """(seconds after the first training step, kind): every kind once in a random order, then random kinds;
    the gaps are uniform in [0.5, 1.5] x the leg's mean."""
    kinds = list(leg.kinds)
    rng.shuffle(kinds)
    kinds += [rng.choice(leg.kinds) for _ in range(leg.num_faults - len(kinds))]
    at, planned = leg.first_fault_s, []
    for kind in kinds[:leg.num_faults]:
        planned.append((at, kind))
        at += leg.mean_interval_s * rng.uniform(0.5, 1.5)
    return planned


def run_config(site: SoakSite, leg: Leg, ckpt_path: str, out: Path) -> dict:
    toy = site.toy
    return {
        "run_name": RUN_NAME, "stages": ["sft", "ppo"], "ckpt_path": ckpt_path, "load_checkpoint": True,
        "max_ckpt_num": 3, "seed": 42, "num_workers": 2, "hang_timeout_s": HANG_TIMEOUT_S,
        "sft": {"pretrain": toy["model"], "dataset": toy["sft"], "input_key": "prompt", "output_key": "response",
                "max_len": 64, "train_batch_size": 8, "micro_train_batch_size": 4, "max_epochs": leg.sft_epochs,
                "learning_rate": 1e-3, "save_steps": leg.sft_save_steps, "save_path": str(out / "sft"),
                "input_template": None},  # the prompts as written, as the soaks before OpenRLHF's default
        "ppo": {"reward_fn": "rlhf_core.toy:gold_reward", "prompt_data": toy["prompts"], "input_key": "prompt",
                "advantage_estimator": "group_norm", "max_samples": leg.ppo_prompts, "n_samples_per_prompt": 2,
                "rollout_batch_size": 4, "train_batch_size": 8, "micro_train_batch_size": 4, "max_new_tokens": 8,
                "num_episodes": leg.ppo_episodes, "learning_rate": 1e-3, "save_steps": leg.ppo_save_steps,
                "save_path": str(out / "ppo")},
    }


def store_url(site: SoakSite, leg: Leg, which: str) -> str:
    if leg.store == "s3":
        return f"s3://{BUCKET}/{leg.name}-{which}"
    root = site.mount.mountpoint if site.mount is not None else site.workdir / "local"
    return str(root / which)


def driver_log(ckpt_path: str) -> Path:
    """The run's log file (rlhf_core.ops.run_log): in the run folder, or ./rlhf-logs of the flow's folder."""
    from rlhf_core.ops.run_log import LOG_DIR_NAME, LOG_FILE_NAME, REMOTE_FALLBACK_DIR

    if ckpt_path.startswith("s3://"):
        return PROJECT_DIR / REMOTE_FALLBACK_DIR / f"{RUN_NAME}.log"
    return Path(ckpt_path) / RUN_NAME / LOG_DIR_NAME / LOG_FILE_NAME


def ended(site: SoakSite):
    """The flow run's state once it is final and nothing will restart it (a plain Crashed is restarted)."""
    state = site.flow_run().state
    if state is None or not state.is_final() or (state.type.value == "CRASHED" and state.name == "Crashed"):
        return None
    return state


def wait_to_end(site: SoakSite, timeout_s: float, on_tick=lambda: None):
    deadline = time.monotonic() + timeout_s
    while (state := ended(site)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"flow run {site.flow_run_id} did not end within {timeout_s:.0f} s "
                               f"(state {site.flow_run().state})")
        on_tick()
        time.sleep(1.0)  # the soak shares the machine's CPUs with what it measures
    return state


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "ppo" / "model.safetensors"))


class Injector:
    """Injects a leg's scheduled faults into the running soak, one at a time, each once the run trains again."""

    def __init__(self, site: SoakSite, leg: Leg, planned: list[tuple[float, str]], rng: random.Random,
                 ckpt_path: str, started_at: float):
        self.site, self.leg, self.planned, self.rng = site, leg, list(planned), rng
        self.ckpt_path, self.started_at = ckpt_path, started_at
        self.first_step_at: float | None = None
        self.rows: list[FaultRow] = []

    def tick(self) -> None:
        if not self.planned:
            return
        steps = self.site.trace.read()  # the whole soak's: only its newest step is looked at (the soak shares the CPUs)
        if not steps or steps[-1].time < self.started_at:
            return
        if self.first_step_at is None:
            self.first_step_at = next(step.time for step in steps if step.time >= self.started_at)
        due, kind = self.planned[0]
        now = time.time()
        last = self.rows[-1].injected_at if self.rows else 0.0
        if now - self.first_step_at < due or not self._trains_again(steps, last):
            return
        stage = steps[-1].stage
        options = self.site.store.storage_options if self.ckpt_path.startswith("s3://") and self.site.store else {}
        committed = committed_steps(self.ckpt_path, RUN_NAME, stage, **options)
        try:
            target = KINDS[kind](self.site, self.rng)
        except NotNow:
            return
        self.planned.pop(0)
        row = FaultRow(self.leg.name, kind, target, round(now - self.started_at, 1), injected_at=now, stage=stage,
                       committed_before=committed[-1] if committed else None)
        self.rows.append(row)
        print(f"soak: {row.at_s:7.1f} s  {kind:<14} {target}", flush=True)

    def _trains_again(self, steps, last_injected_at: float) -> bool:
        """The run trains (a step in the last 5 s), one started the leg's `recovered_after_s` after the last fault,
        and the nodes and the store that a fault took away are back."""
        recovered = not last_injected_at or steps[-1].time > last_injected_at + self.leg.recovered_after_s
        return recovered and training_now(steps) and not self.site.pending()


def run_leg(site: SoakSite, leg: Leg, rng: random.Random, out: Path) -> tuple[LegTimes, list[FaultRow]]:
    reference_ckpt, soak_ckpt = store_url(site, leg, "reference"), store_url(site, leg, "faulted")
    print(f"soak: leg {leg.name}: the uninterrupted run", flush=True)
    started = time.time()
    site.submit(run_config(site, leg, reference_ckpt, out / "reference"))
    reference_state = wait_to_end(site, 3600)
    reference_s = time.time() - started
    assert reference_state.type.value == "COMPLETED", f"the uninterrupted run ended {reference_state}"
    print(f"soak: leg {leg.name}: uninterrupted {reference_s:.0f} s; the faulted run", flush=True)

    started = time.time()
    site.submit(run_config(site, leg, soak_ckpt, out / "faulted"))
    injector = Injector(site, leg, schedule(leg, rng), rng, soak_ckpt, started)
    state = wait_to_end(site, 4 * reference_s + 1800, on_tick=injector.tick)
    soak_s = time.time() - started
    print(f"soak: leg {leg.name}: faulted run {state.name} after {soak_s:.0f} s", flush=True)

    # The server's copy of the run's log, the run's log file (records logged outside a Prefect run's context reach
    # only it) and the worker's output (a power cut takes the last lines of the first two with it).
    log = site.run_logs() + read_log(driver_log(soak_ckpt)) + read_console(site.worker.log_path, started)
    evidence = Evidence(list(site.trace.read()), sorted(log, key=lambda line: line.time), site.states(),
                        list(site.worker.restarts), list(site.trace.marks))
    for row, next_row in zip(injector.rows, [*injector.rows[1:], None]):
        row.measure(evidence, next_row.injected_at if next_row else float("inf"))
    bit_exact, differing = False, ["(no final weights)"]
    if state.type.value == "COMPLETED":
        reference, faulted = final_weights(out / "reference"), final_weights(out / "faulted")
        differing = sorted(name for name in reference
                           if name not in faulted or not torch.equal(reference[name], faulted[name]))
        bit_exact = reference.keys() == faulted.keys() and not differing
    return LegTimes(leg.name, round(reference_s, 1), round(soak_s, 1), state.name, bit_exact, differing[:5]), \
        injector.rows


def run_soak(legs: tuple[Leg, ...], workdir: Path, seed: int = 0, time_scale: float = 1.0) -> dict:
    """Every leg on one site; prints the table, publishes the report, and prints its folder last."""
    rng = random.Random(seed)
    with_power_cut = any("power_cut" in leg.kinds for leg in legs)
    with SoakSite(workdir, time_scale, with_power_cut) as site:
        times, rows = [], []
        for leg in legs:
            leg_times, leg_rows = run_leg(site, leg, rng, workdir / "out" / leg.name)
            times.append(leg_times)
            rows += leg_rows
        result = report.build(rows, times, site.api_changes, num_runs=2 * len(legs))
        print(report.as_markdown(result), flush=True)
        path = report.publish(result, workdir, site.server.api_url, site.flow_run_id)
    print(path.parent, flush=True)
    return result
