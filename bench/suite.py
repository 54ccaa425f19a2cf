"""The benchmark suite of issue 10: every goal's ratio, ours next to TRL's (or next to a plain copy of
the same bytes), measured side by side in one run and printed as one table.

    .venv/bin/python bench/suite.py [--only steps,grpo,startup,chunk,ckpt,wholerun] [--trl_python PATH]

`make bench` builds TRL's venv (bench/.cache/trl-venv) and runs this. Sections, in the order they run:

- startup: command -> end of the first training step, `rlhf train sft` against TRL's SFTTrainer script, on
  1,000 rows: cold, with a Prefect server, and warm (Ray head, Prefect server, spares of an earlier command)
  (both as fresh processes on the 23.6M model);
- steps: SFT and RM seconds per step on the 23.6M model, batch 8, our fp32 against TRL's `bf16=False`
  and our `--param_dtype bf16` (CPU autocast) against TRL's default; the median step after warm-up;
- grpo: GRPO samples per second (8 prompts x 8 samples, 8 new tokens, fp32 both) against GRPOTrainer;
- chunk: time outside training per warm chunk boundary, as a share of a 50-step chunk's training
  (the `rlhf` Prefect flow, 23.6M model);
- ckpt: on the ~100M model, the training stall per checkpoint, and per snapshot between commits (with K as
  the rank chooses it), against one in-memory copy of the rank's tensors, save-to-durable-commit against a
  durable copy of the committed step (`cp -r` + fsync of every file and folder), and resume (fetch + verify + load) against `cat` of the files the rank
  reads, both from a cold page cache (and warm, labelled); each manifest checksum and the fsyncs' cost
  side by side in the same run; and, as floors, the checksum alone of the same files;
- wholerun: the extra wall time per checkpoint of a whole SFT run (23.6M model, `--save_steps 50`
  against one chunk), as a share of a 50-step chunk's training.

The startup section runs first, before this process starts its own Ray. The machine may be shared:
the load average is printed at the start and the end, and every number is a median. No number here
is a test: the suite reports, it asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)

import ckpt_costs  # noqa: E402 - the bench folder is not a package
import ours  # noqa: E402
import wholerun_costs  # noqa: E402
from table import Row, format_table, median_or_none, outside_per_chunk  # noqa: E402

SECTIONS = ("startup", "steps", "grpo", "chunk", "ckpt", "wholerun")
WHOLERUN_FULL_STEPS = 256
STARTUP_ROWS = 1000  # issue 46: the start-up rows' dataset, on both sides
CACHE_DIR = os.path.join(BENCH_DIR, ".cache")
DEFAULT_TRL_PYTHON = os.path.join(CACHE_DIR, "trl-venv", "bin", "python")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"Comma-separated sections: {', '.join(SECTIONS)}.")
    parser.add_argument("--trl_python", default=DEFAULT_TRL_PYTHON, help="Python of the venv with TRL installed.")
    parser.add_argument("--steps", type=int, default=24, help="Optimizer steps per step-speed run.")
    parser.add_argument("--warmup", type=int, default=4, help="Steps left out of the step-speed medians.")
    parser.add_argument("--grpo_steps", type=int, default=8)
    parser.add_argument("--chunk_steps", type=int, default=50, help="Steps per chunk in the chunk section.")
    parser.add_argument("--num_chunks", type=int, default=3, help="Full chunks in the chunk section.")
    parser.add_argument("--repeat", type=int, default=3,
                        help="Repeats of each start-up (both sides) and of each copy/load in the ckpt section.")
    parser.add_argument("--ckpt_chunks", type=int, default=19,
                        help="Chunks of one step in the ckpt section: the first is cold, the rest cycle through "
                             "the variants (no fsync, through the page cache, each installed checksum, the default "
                             "beside training: 6 with blake3 installed); 19 gives each of 6 three.")
    parser.add_argument("--wholerun_steps", type=int, default=160,
                        help="SFT steps of each whole run (one with a checkpoint every --wholerun_save_steps, one as "
                             "one chunk); rounded up to whole passes over the 256 toy samples (32 steps each).")
    parser.add_argument("--wholerun_save_steps", type=int, default=50)
    parser.add_argument("--wholerun_repeat", type=int, default=1,
                        help="Pairs of whole runs (one chunk, and chunked), in ABBA order; the median pair is shown.")
    parser.add_argument("--wholerun_no_equal_writer", action="store_true",
                        help="Skip each pair's third run (the writer sharing the cores as an equal): more pairs in "
                             "the same time, when the median pair is what you need.")
    parser.add_argument("--wholerun_no_floor", action="store_true",
                        help="Skip each pair's floor run (one chunk with a durable copy of the same bytes at every "
                             "boundary, the least any checkpoint costs).")
    parser.add_argument("--wholerun_full", action="store_true",
                        help=f"The issue's whole-run measure: {WHOLERUN_FULL_STEPS} steps "
                             "(overrides --wholerun_steps).")
    parser.add_argument("--keep", action="store_true", help="Keep the work folder (models, checkpoints).")
    args = parser.parse_args()
    args.sections = [name.strip() for name in args.only.split(",") if name.strip()]
    if args.wholerun_full:
        args.wholerun_steps = WHOLERUN_FULL_STEPS
    if not 0 < args.wholerun_save_steps < args.wholerun_steps:
        parser.error("--wholerun_save_steps must be positive and below --wholerun_steps (else both runs are one chunk)")
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    return args


def trl_run(args: argparse.Namespace, task: str, model_dir: str, data: str, num_steps: int, fp32: bool,
            env: dict) -> dict:
    """One trl_side.py run; its step end times, and its launch time on the same clock."""
    command = [args.trl_python, os.path.join(BENCH_DIR, "trl_side.py"), task, "--model", model_dir, "--data", data,
               "--steps", str(num_steps), "--batch", str(ours.BATCH), "--learning_rate", str(ours.LEARNING_RATE)]
    if fp32:
        command.append("--fp32")
    launched = time.time()
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("BENCH_RESULT ")]
    if completed.returncode != 0 or not lines:
        raise RuntimeError(f"TRL {task} run failed (exit {completed.returncode}):\n{completed.stderr[-3000:]}")
    return {**json.loads(lines[-1].split(" ", 1)[1]), "launched": launched}


def step_durations(step_ends: list[float]) -> list[float]:
    return [later - earlier for earlier, later in zip(step_ends, step_ends[1:])]


def median_after(values: list[float], warmup: int) -> float | None:
    return median_or_none(values[warmup:])


def section_steps(args, assets, env, results: dict) -> list[Row]:
    rows = []
    for stage, data in (("sft", assets["toy"]["sft"]), ("rm", assets["toy"]["prefs"])):
        for precision, trl_label in (("fp32", "TRL bf16=False"), ("bf16", "TRL default (bf16 autocast)")):
            trl = trl_run(args, stage, assets["m23"], data, args.steps, precision == "fp32", env)
            # TRL's step k lasts from the end of step k-1 to its own end; step 1 has no start, so drop it too.
            trl_step = median_after(step_durations(trl["step_ends"]), args.warmup - 1)
            cfg = ours.stage_config(stage, assets["toy"], assets["m23"], os.path.join(assets["work"], "out"),
                                    args.steps, -1, precision)
            mine = ours.step_seconds(ours.stage_run(assets["work"], f"steps-{stage}-{precision}", stage, cfg),
                                     stage, args.steps)
            our_step = median_after(mine, args.warmup)
            results[f"{stage}_{precision}"] = {"trl_step_ends": trl["step_ends"], "ours_steps": mine,
                                                "trl_bf16": trl["bf16"]}
            print(f"  {stage} {precision}: ours {our_step:.3f} s/step, {trl_label} {trl_step:.3f} s/step", flush=True)
            rows.append(Row(f"{stage.upper()} s/step, ours {precision} vs {trl_label}", trl_step, our_step, "s",
                            "<=", 1.0))
    return rows


def section_grpo(args, assets, env, results: dict) -> list[Row]:
    shape = {"prompts": ours.BATCH, "generations": 8, "max_new_tokens": 8}
    samples = shape["prompts"] * shape["generations"]
    trl = trl_run(args, "grpo", assets["m23"], assets["toy"]["prompts"], args.grpo_steps, True, env)
    trl_step = median_after(step_durations(trl["step_ends"]), 1)
    cfg = ours.stage_config("ppo", assets["toy"], assets["m23"], os.path.join(assets["work"], "out"), args.grpo_steps,
                            -1, grpo=shape)
    mine = ours.step_seconds(ours.stage_run(assets["work"], "grpo", "ppo", cfg), "ppo", args.grpo_steps)
    our_step = median_after(mine, 2)
    results["grpo"] = {"trl_step_ends": trl["step_ends"], "ours_steps": mine, "samples_per_step": samples}
    ours_rate, trl_rate = samples / our_step, samples / trl_step
    print(f"  grpo: ours {ours_rate:.1f} samples/s ({our_step:.3f} s/step), TRL {trl_rate:.1f} samples/s", flush=True)
    return [Row("GRPO samples/s (8x8 samples, 8 new tokens, fp32)", trl_rate, ours_rate, "/s", ">=", 1.0)]


def section_startup(args, assets, env, results: dict) -> list[Row]:
    """Issue 46: the same 1,000 rows, model and batch on both sides, from the command to the first step trained;
    ours cold (nothing running: a local Ray, Prefect's ephemeral server), with a Prefect server, and warm (a Ray
    head and a Prefect server running, and the spare rank processes an earlier command left)."""
    toy = {**assets["toy"], "sft": ours.rows_file(assets["toy"]["sft"], STARTUP_ROWS,
                                                  os.path.join(assets["work"], "startup-rows.jsonl"))}
    start = functools.partial(ours.startup_seconds, assets["work"], toy, assets["m23"])
    mine_runs, trl_runs = [], []
    for _ in range(args.repeat):  # alternated, so a busy moment of the machine hits both sides alike
        mine_runs.append(start(env))
        trl = trl_run(args, "sft", assets["m23"], toy["sft"], 2, True, env)
        trl_runs.append(trl["step_ends"][0] - trl["launched"])
    with ours.running_prefect_server(env) as api_url:  # what users with the Prefect UI have
        served_runs = [start({**env, "PREFECT_API_URL": api_url}) for _ in range(args.repeat)]
        with ours.running_ray_head() as ray_address:
            warm_env, state = {**env, "PREFECT_API_URL": api_url, "RAY_ADDRESS": ray_address}, tempfile.mkdtemp()
            start(warm_env, state)  # the earlier command, which leaves its ranks as spares
            warm_runs = [start(warm_env, state) for _ in range(args.repeat)]
    mine, trl_startup, served, warm = (statistics.median(runs) for runs in (mine_runs, trl_runs, served_runs,
                                                                             warm_runs))
    results["startup"] = {"ours": mine, "trl": trl_startup, "ours_runs": mine_runs, "trl_runs": trl_runs,
                          "ours_with_server": served, "ours_with_server_runs": served_runs,
                          "ours_warm": warm, "ours_warm_runs": warm_runs, "rows": STARTUP_ROWS}
    print(f"  startup ({STARTUP_ROWS} rows): ours {mine:.1f} s {[round(x, 1) for x in mine_runs]}, with a running "
          f"Prefect server {served:.1f} s {[round(x, 1) for x in served_runs]}, warm {warm:.1f} s "
          f"{[round(x, 1) for x in warm_runs]}, TRL {trl_startup:.1f} s {[round(x, 1) for x in trl_runs]}", flush=True)
    return [Row("start-up: command -> first step trained (SFT, 1,000 rows)", trl_startup, mine, "s", "<=", 1.5),
            Row("start-up, Prefect server already running (PREFECT_API_URL)", trl_startup, served, "s", "<=", 2.0),
            Row("start-up warm: Ray head, Prefect server and spares running", trl_startup, warm, "s", "<=", 0.75)]


def section_chunk(args, assets, env, results: dict) -> list[Row]:
    num_steps = args.chunk_steps * args.num_chunks + 1  # a last chunk of one step adds one more warm boundary
    cfg = ours.stage_config("sft", assets["toy"], assets["m23"], os.path.join(assets["work"], "chunk-out"),
                            num_steps, args.chunk_steps)
    run = ours.stage_run(assets["work"], "chunk", "sft", cfg)
    flow = ours.chunk_boundaries(run)
    # One driver train_until per chunk (no trackers, no live bar): its end marks the end of the chunk's training.
    chunk_ends = [end for _, end in flow["spans"]]
    loops = [row.get("step_loop_s", row.get("train_s")) for row in flow["chunks"]]
    if len(chunk_ends) != len(loops):
        raise RuntimeError(f"{len(chunk_ends)} training calls for {len(loops)} chunks: the chunk loop stopped "
                           "inside chunks (trackers or a live progress bar?); the boundaries cannot be told apart.")
    outside = outside_per_chunk(chunk_ends, loops)
    full_chunks = loops[1:args.num_chunks]  # warm chunks of chunk_steps steps
    results["chunk"] = {"spans": flow["spans"], "loops": loops, "outside": outside, "wall": flow["wall"],
                        "chunks": flow["chunks"]}
    print(f"  chunk: outside training per warm chunk {[round(x, 3) for x in outside]} s; warm {args.chunk_steps}-step "
          f"chunks train {full_chunks} s; flow wall {flow['wall']:.1f} s", flush=True)
    return [Row(f"outside training per warm chunk / {args.chunk_steps}-step chunk (23.6M)", median_or_none(full_chunks),
                median_or_none(outside), "s", "<=", 0.02, as_percent=True)]


def section_ckpt(args, assets, env, results: dict) -> list[Row]:
    cfg = ours.stage_config("sft", assets["toy"], assets["m100"], os.path.join(assets["work"], "ckpt-out"),
                            args.ckpt_chunks, 1)
    # Keep one checkpoint of every variant (the last cycle), for the resume of each checksum.
    run = ours.stage_run(assets["work"], "ckpt", "sft", cfg, max_ckpt_num=len(ckpt_costs.schedule()))
    costs = ckpt_costs.checkpoint_costs(run, args.repeat)
    results["ckpt"] = costs
    ckpt_costs.print_costs(costs)
    return ckpt_costs.rows(costs)


def section_wholerun(args, assets, env, results: dict) -> list[Row]:
    costs = wholerun_costs.whole_run(assets["work"], assets["toy"], assets["m23"], args.wholerun_steps,
                                     args.wholerun_save_steps, args.wholerun_repeat, not args.wholerun_no_equal_writer,
                                     not args.wholerun_no_floor)
    results["wholerun"] = costs
    wholerun_costs.print_costs(costs, args.wholerun_save_steps)
    return wholerun_costs.rows(costs, args.wholerun_save_steps)


RUNNERS = {"startup": section_startup, "steps": section_steps, "grpo": section_grpo, "chunk": section_chunk,
           "ckpt": section_ckpt, "wholerun": section_wholerun}


def prepare(work: str, sections: list[str]) -> dict:
    from models import build_model_dir
    from rlhf_core.toy import init_toy

    assets = {"work": work, "toy": init_toy(os.path.join(work, "toy"))}
    if set(sections) - {"ckpt"}:
        assets["m23"], count = build_model_dir(os.path.join(work, "llama-23.6m"), "23.6m")
        print(f"model 23.6m: {count / 1e6:.1f}M parameters")
    if "ckpt" in sections:
        assets["m100"], count = build_model_dir(os.path.join(work, "llama-100m"), "100m")
        print(f"model 100m: {count / 1e6:.1f}M parameters")
    return assets


def bench_environment() -> dict:
    """Offline, quiet, and a Prefect home of the bench's own, created once (its first server start migrates
    the database, which would otherwise land in whichever section starts Prefect first)."""
    prefect_home = os.path.join(CACHE_DIR, "prefect-home")
    os.environ.update(PREFECT_HOME=prefect_home, PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1",
                      TRANSFORMERS_OFFLINE="1", RAY_DEDUP_LOGS="0", RAY_AUTH_MODE="disabled")
    if not os.path.exists(os.path.join(prefect_home, "prefect.db")):
        os.makedirs(prefect_home, exist_ok=True)
        subprocess.run([sys.executable, "-c", "from prefect import flow\nflow(lambda: None)()"], check=True,
                       capture_output=True)
    return dict(os.environ)


def quiet_console() -> None:
    """The CLI's quiet console: Ray workers', DeepSpeed's and Prefect's output go to a log file, so the
    suite's own lines stay readable."""
    import flows.pipeline  # noqa: F401 - Prefect sets up its logging on import; the console goes after it
    from rlhf_core.ops.console import configure_console

    log_file = configure_console(os.path.join(CACHE_DIR, "last-run.log"), live_progress=False)
    print(f"Ray, DeepSpeed and Prefect output: {log_file}")


def main() -> None:
    args = parse_args()
    if {"startup", "steps", "grpo"} & set(args.sections) and not os.path.exists(args.trl_python):
        sys.exit(f"--trl_python {args.trl_python} does not exist; `make bench` builds it (or pass the python of a "
                 "venv with trl installed).")
    env = bench_environment()
    quiet_console()
    print(f"load average at start: {os.getloadavg()}, {os.cpu_count()} CPUs", flush=True)
    work = tempfile.mkdtemp(prefix="rlhf-bench-")
    rows, results, started = [], {}, time.perf_counter()
    try:
        assets = prepare(work, args.sections)
        for section in [name for name in SECTIONS if name in args.sections]:
            print(f"== {section}", flush=True)
            section_started = time.perf_counter()
            rows += RUNNERS[section](args, assets, env, results)
            print(f"  ({time.perf_counter() - section_started:.0f} s)", flush=True)
    finally:
        if args.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    with open(os.path.join(CACHE_DIR, "last-results.json"), "w") as handle:
        json.dump(results, handle, indent=1, default=str)
    print(f"\nload average at end: {os.getloadavg()}; suite wall {time.perf_counter() - started:.0f} s; raw numbers in "
          f"{os.path.join(CACHE_DIR, 'last-results.json')}\n")
    print(format_table(rows))


if __name__ == "__main__":
    main()
