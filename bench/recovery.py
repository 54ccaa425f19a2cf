"""Issue 32's recovery bench: a rank SIGKILLed mid-chunk, from the kill to its replacement's first training step.

    .venv/bin/python bench/recovery.py [--repeat 3] [--only demo,model] [--save_steps 8] [--kill_after 4]

- demo: the toy model (`rlhf_core.toy`), SFT as the integration tests run it (`--save_steps 8`), in this process:
  one chunk trains (`ensure_checkpoint`, nothing trained ahead), the warm spares start (as a commit starts them
  once the group is 30 s old) and are waited for (`runner.spares.num_ready()`), and the next chunk trains with
  `train_step@N=kill` in its middle. With 1 rank and 2 ranks (one dies, one survives), each with warm spares (the
  default) and without (`--num_spare_workers 0`), alternated, `--repeat` times each.
- model: the same kill with 1 rank and spares on the 23.6M model (bench/models.py, as the suite's `startup` and
  `chunk` sections), alternated with a cold resume of the checkpoint it committed: a fresh
  `rlhf train sft ... --load_checkpoint` process, launch to the end of its first step (the hook `train_step@N`
  with `sleep:0` touches a marker; its mtime is the time), spares off so none warms beside that step, and this
  process's Ray shut down first.

Recovery is the ledger's newest `replacements` entry (`{ckpt_path}/{run_name}/goodput.json`): `ready_at` +
`first_step_s`, less the mtime of the fault's marker, touched right before the SIGKILL. Detection is `seen_at` less
that mtime. Medians; the numbers land in bench/.cache/recovery-results.json, Ray's and DeepSpeed's output in
bench/.cache/recovery-run.log (the cold resumes' in recovery-resume.log). Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
CACHE_DIR = os.path.join(BENCH_DIR, ".cache")
RESULTS = os.path.join(CACHE_DIR, "recovery-results.json")
RUN_LOG, RESUME_LOG = os.path.join(CACHE_DIR, "recovery-run.log"), os.path.join(CACHE_DIR, "recovery-resume.log")
FAULT_VARS = ("RLHF_FAULT_INJECT", "RLHF_FAULT_STATE")
ISSUE_BOUND_S = 10.0  # issue 32: kill -> the replacement's first step on the demo model
COLD_RESUME_BOUND = 2.0  # and on the bench model, at most this many times a cold resume
BUSY_LOAD = 1.5
TOY_ROWS = 256  # SFT rows of rlhf_core.toy.make_datasets
SECTIONS = ("demo", "model")

from table import Row, format_table  # noqa: E402 - the bench folder is not a package


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"Comma-separated sections: {', '.join(SECTIONS)}.")
    parser.add_argument("--repeat", type=int, default=3, help="Kills per configuration (and cold resumes); medians.")
    parser.add_argument("--save_steps", type=int, default=8, help="Steps per chunk; the kill falls in the second.")
    parser.add_argument("--kill_after", type=int, default=4,
                        help="The rank dies at the start of this step of the second chunk (1: its first step).")
    parser.add_argument("--ranks", default="1,2", help="World sizes of the demo section.")
    parser.add_argument("--spare_timeout_s", type=float, default=120.0, help="Longest wait for the spares' warm-up.")
    parser.add_argument("--resume_timeout_s", type=float, default=300.0, help="Longest wait for a cold resume's step.")
    parser.add_argument("--keep", action="store_true", help="Keep the work folder (models, checkpoints).")
    args = parser.parse_args()
    args.sections = [name.strip() for name in args.only.split(",") if name.strip()]
    args.world_sizes = [int(size) for size in args.ranks.split(",") if size.strip()]
    if set(args.sections) - set(SECTIONS):
        parser.error(f"--only: choose from {', '.join(SECTIONS)}")
    if not 1 <= args.kill_after <= args.save_steps:
        parser.error("--kill_after must fall inside the second chunk: 1 to --save_steps")
    return args


def sft_flags(model: str, data: str, ckpt: str, out: str, run_name: str, num_steps: int, save_steps: int,
              toy: bool) -> list[str]:
    """`rlhf train sft`'s flags: the toy as tests/integration/conftest.py's `train_sft_args` (its `--save_steps`
    aside), the 23.6M model as the suite's sections (batch 8 in one micro-batch, max length 64)."""
    shape = (["--max_len", "128", "--micro_train_batch_size", "4", "--learning_rate", "1e-3"] if toy else
             ["--max_len", "64", "--micro_train_batch_size", "8", "--learning_rate", "1e-4"])
    epochs = -(-num_steps * 8 // TOY_ROWS)  # enough passes over the 256 rows for `num_steps` steps of 8
    return ["--pretrain", model, "--dataset", data, "--input_key", "prompt", "--output_key", "response",
            "--train_batch_size", "8", *shape, "--max_epochs", str(epochs), "--save_steps", str(save_steps),
            "--input_template", "{}",
            "--ckpt_path", ckpt, "--max_ckpt_num", "3",
            "--save_path", out, "--seed", "42", "--load_checkpoint", "--run_name", run_name]


def run_config(flags: list[str], **overrides):
    """The RunConfig `rlhf train sft <flags>` runs, so that a cold resume of it in a subprocess is the same run."""
    from flows.cli import build_parser, run_config_from_flags
    from rlhf_core.driver.plan import resolve_paths

    parsed = vars(build_parser().parse_args(["train", "sft", *flags]))
    own = {key: value for key, value in parsed.items() if key not in ("command", "handler", "stage")}
    return resolve_paths(run_config_from_flags("sft", own).model_copy(update=overrides))


def start_spares(runner, timeout_s: float) -> tuple[int, float]:
    """Start the warm group's spares as a commit does once the group has trained SPARES_AFTER_S (30 s:
    `StageRunner.keep_spares`), without waiting that long; (spares ready, seconds waited) once they all finished
    their warm-up, or at the timeout."""
    from rlhf_core.driver.spares import num_spares

    group, started = runner.warm_group, time.monotonic()
    count = num_spares(runner.run, group.world_size)
    runner.spares.fill(runner.run, "sft", count, group.bundle_nodes)
    while runner.spares.num_ready() < count and time.monotonic() - started < timeout_s:
        time.sleep(0.2)
    return runner.spares.num_ready(), time.monotonic() - started


def newest_replacement(run) -> dict:
    path = os.path.join(run.ckpt_path, run.run_name, "goodput.json")
    with open(path) as handle:
        replacements = json.load(handle)["stages"]["sft"].get("replacements", [])
    if not replacements:
        raise RuntimeError(f"{path} records no replacement: did the fault fire? (see {RUN_LOG})")
    return replacements[-1]


def kill_and_replace(flags: list[str], state: str, save_steps: int, kill_step: int, num_workers: int, spares: bool,
                     spare_timeout_s: float) -> dict:
    """Train the first chunk, wait for the spares, train the second with a rank killed at `kill_step`; the
    replacement's times against the kill's."""
    from rlhf_core.driver.chunk import ensure_checkpoint
    from rlhf_core.driver.resume import begin_stage
    from rlhf_core.driver.runner import StageRunner

    os.makedirs(state, exist_ok=True)
    # Set before the first group starts: a rank takes the fault variables from os.environ when it is created.
    os.environ.update(RLHF_FAULT_INJECT=f"train_step@{kill_step}=kill", RLHF_FAULT_STATE=state)
    try:
        run = run_config(flags, num_workers=num_workers, num_spare_workers=None if spares else 0)
        with StageRunner(run) as runner:
            ensure_checkpoint(runner, "sft", save_steps, begin_stage(run, "sft"), train_ahead=False)
            ready, waited = start_spares(runner, spare_timeout_s) if spares else (0, 0.0)
            ensure_checkpoint(runner, "sft", 2 * save_steps, begin_stage(run, "sft"), train_ahead=False)
    finally:
        for name in FAULT_VARS:
            os.environ.pop(name, None)
    killed = os.stat(os.path.join(state, f"train_step@{kill_step}")).st_mtime
    entry = newest_replacement(run)
    return {"ranks": num_workers, "spares": spares, "spares_ready": ready, "spares_wait_s": waited,
            "detection_s": entry["seen_at"] - killed, "ready_s": entry["ready_at"] - killed,
            "first_step_s": entry["first_step_s"],
            "recovery_s": entry["ready_at"] + entry["first_step_s"] - killed, "ledger": entry}


def cold_resume(flags: list[str], state: str, step: int, env: dict, timeout_s: float) -> float:
    """`rlhf train sft <flags>` resuming the committed `step` in a fresh process: launch to the end of its first
    step (the rank reaching `train_step@{step + 2}`)."""
    from data_scale import RLHF, Watched, hooked_env

    point = f"train_step@{step + 2}"
    watched = Watched([RLHF, "train", "sft", *flags, "--num_spare_workers", "0"],
                      hooked_env(env, state, f"{point}=sleep:0"), RESUME_LOG)
    try:
        return watched.wait_for(os.path.join(state, point), timeout_s)
    finally:
        watched.kill()


def describe(sample: dict) -> str:
    spares = (f"warm spares ({sample['spares_ready']} ready after {sample['spares_wait_s']:.1f} s)"
              if sample["spares"] else "no spares")
    return (f"{ranks(sample['ranks'])}, {spares}: kill -> seen {sample['detection_s']:.2f} s, -> new ranks hold "
            f"the start state {sample['ready_s']:.2f} s, first step {sample['first_step_s']:.2f} s; "
            f"kill -> first step {sample['recovery_s']:.2f} s")


def section_demo(args, work: str, toy: dict, results: dict) -> list[Row]:
    """1 and 2 ranks, with and without spares, alternated `--repeat` times."""
    configs = [(size, spares) for size in args.world_sizes for spares in (True, False)]
    samples: dict[str, list[dict]] = {label(size, spares): [] for size, spares in configs}
    kill_step = args.save_steps + args.kill_after
    for attempt in range(args.repeat):
        for size, spares in configs:
            name = f"demo-{size}-{'spares' if spares else 'cold'}-{attempt}"
            flags = sft_flags(toy["model"], toy["sft"], os.path.join(work, "ckpt"), os.path.join(work, "out", name),
                              name, 2 * args.save_steps, args.save_steps, toy=True)
            sample = kill_and_replace(flags, os.path.join(work, "state", name), args.save_steps, kill_step, size,
                                      spares, args.spare_timeout_s)
            samples[label(size, spares)].append(sample)
            print(f"  demo: {describe(sample)}  (load {os.getloadavg()[0]:.2f})", flush=True)
    results["demo"] = {key: summarise(values) for key, values in samples.items()}
    rows = []
    for size in args.world_sizes:
        warm, cold = results["demo"][label(size, True)], results["demo"][label(size, False)]
        rows += [Row(f"kill -> replacement's first step, toy, {ranks(size)}, warm spares / issue's bound",
                     ISSUE_BOUND_S, warm["recovery_s"], "s", "<=", 1.0),
                 Row("  the same without spares (--num_spare_workers 0)", ISSUE_BOUND_S, cold["recovery_s"], "s",
                     "<=", None),
                 Row("  warm spares / without", cold["recovery_s"], warm["recovery_s"], "s", "<=", None),
                 Row("  kill -> loss seen by the driver (old group released), warm spares", ISSUE_BOUND_S,
                     warm["detection_s"], "s", "<=", None)]
    return rows


def ranks(size: int) -> str:
    return f"{size} rank{'s' if size > 1 else ''}"


def label(size: int, spares: bool) -> str:
    return f"{size}_rank{'s' if size > 1 else ''}_{'spares' if spares else 'no_spares'}"


def summarise(samples: list[dict]) -> dict:
    """Medians of the timed fields, and every sample."""
    keys = ("detection_s", "ready_s", "first_step_s", "recovery_s")
    return {**{key: statistics.median(sample[key] for sample in samples) for key in keys}, "samples": samples}


def section_model(args, work: str, toy: dict, env: dict, results: dict) -> list[Row]:
    """The 23.6M model: a kill with 1 rank and spares, then a cold resume of its commit; alternated."""
    import ray
    from models import build_model_dir

    model, count = build_model_dir(os.path.join(work, "llama-23.6m"), "23.6m")
    print(f"  model 23.6m: {count / 1e6:.1f}M parameters", flush=True)
    kills, resumes = [], []
    for attempt in range(args.repeat):
        name = f"model-{attempt}"
        flags = sft_flags(model, toy["sft"], os.path.join(work, "ckpt"), os.path.join(work, "out", name), name,
                          2 * args.save_steps + 2, args.save_steps, toy=False)
        sample = kill_and_replace(flags, os.path.join(work, "state", name), args.save_steps,
                                  args.save_steps + args.kill_after, 1, True, args.spare_timeout_s)
        kills.append(sample)
        print(f"  model: {describe(sample)}  (load {os.getloadavg()[0]:.2f})", flush=True)
        ray.shutdown()  # the cold resume starts Ray of its own; ours, idle beside it, took 3-4 s from its start
        resumes.append(cold_resume(flags, os.path.join(work, "state", f"{name}-resume"), 2 * args.save_steps, env,
                                   args.resume_timeout_s))
        print(f"  model: cold resume of step {2 * args.save_steps}, launch -> first step {resumes[-1]:.2f} s  "
              f"(load {os.getloadavg()[0]:.2f})", flush=True)
    results["model"] = {"replacement": summarise(kills), "cold_resume_s": statistics.median(resumes),
                        "cold_resume_samples": resumes, "parameters": count}
    replaced = results["model"]["replacement"]
    return [Row("kill -> replacement's first step, 23.6M, 1 rank, warm spares / cold resume (launch -> first step)",
                results["model"]["cold_resume_s"], replaced["recovery_s"], "s", "<=", COLD_RESUME_BOUND),
            Row("  kill -> loss seen by the driver (old group released)", results["model"]["cold_resume_s"],
                replaced["detection_s"], "s", "<=", None)]


def save(results: dict) -> None:
    with open(RESULTS, "w") as handle:
        json.dump(results, handle, indent=1, default=str)


def quiet_console() -> None:
    """The CLI's quiet console, Ray's and DeepSpeed's output to RUN_LOG (as the suite's `quiet_console`)."""
    import flows.pipeline  # noqa: F401 - Prefect sets up its logging on import; the console goes after it
    from rlhf_core.ops.console import configure_console

    print(f"Ray and DeepSpeed output: {configure_console(RUN_LOG, live_progress=False)}; cold resumes: {RESUME_LOG}")


def main() -> None:
    args = parse_args()
    os.makedirs(CACHE_DIR, exist_ok=True)
    from suite import bench_environment

    env = {key: value for key, value in bench_environment().items() if not key.startswith("RLHF_FAULT")}
    quiet_console()
    from rlhf_core.driver.ray_start import ensure_ray
    from rlhf_core.toy import init_toy

    work = tempfile.mkdtemp(prefix="rlhf-bench-recovery-")
    results: dict = {"load_start": os.getloadavg(), "cpus": os.cpu_count()}
    print(f"load average at start: {results['load_start']}, {os.cpu_count()} CPUs", flush=True)
    if results["load_start"][0] > BUSY_LOAD:  # another run on the same cores moves every number here
        print(f"  the machine is busy (1-minute load above {BUSY_LOAD}): the numbers will read slow", flush=True)
    rows, started = [], time.perf_counter()
    try:
        toy = init_toy(os.path.join(work, "toy"))
        ensure_ray(None)
        for section in [name for name in SECTIONS if name in args.sections]:
            print(f"== {section}", flush=True)
            rows += section_demo(args, work, toy, results) if section == "demo" else \
                section_model(args, work, toy, env, results)
            save(results)  # a section's numbers survive a later section's failure
    finally:
        if args.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    results["load_end"] = os.getloadavg()
    save(results)
    print(f"\nload average at end: {results['load_end']}; wall {time.perf_counter() - started:.0f} s; raw numbers in "
          f"{RESULTS}\n")
    print(format_table(rows))


if __name__ == "__main__":
    main()
