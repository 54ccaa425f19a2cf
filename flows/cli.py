"""The `rlhf` command. Flags keep OpenRLHF's names and are generated from the pydantic configs,
so each flag's help is the field's description.

    rlhf toy init DIR                 tiny model + toy data
    rlhf train sft --pretrain ... --dataset ... [--load_checkpoint]
    rlhf run CONFIG.yaml              the pipeline from a YAML run config
    rlhf ckpt ls PATH [--json]        checkpoints of one stage folder, with their alerts
    rlhf status RUN_URL               stages, last committed steps, alerts, lease, outputs of a run
    rlhf goodput RUN_URL [--json]     where a run's wall time went, across restarts (goodput.json)
    rlhf plan --ckpt_path P --mtbf_hours H   --save_steps by Young/Daly from the measured costs
    rlhf demo [--workdir DIR]         the whole pipeline on toy data

Training commands run the Prefect flow `rlhf` (on Prefect's ephemeral server when no
PREFECT_API_URL is set). Their console shows the chunk and stage lines, warnings once and errors;
Ray's, DeepSpeed's and the ranks' full output goes to a log file (rlhf_core.ops.console: in the run
folder's logs/driver.log when it is local) and --verbose shows it on the console too.
Every failure the pipeline names (rlhf_core.errors) prints one sentence; mistakes the user can fix exit
with code 2.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import typing
from typing import Any, Sequence

from pydantic import ValidationError

from flows.cli_flags import add_openrlhf_flags, apply_openrlhf_flags, dotted_defaults, say_departures
from flows.cli_inspect import cmd_ckpt, cmd_goodput, cmd_plan, cmd_status
from rlhf_core.config import RunConfig
from rlhf_core.config_file import describe_validation_error, load_run_config
from rlhf_core.stages import STAGES
from rlhf_core.stages.merge import MergeConfig
from rlhf_core.errors import RLHFError, UserError
from rlhf_core.driver.stop import StopSignals, StoppedBySignal

STAGE_CONFIGS = {name: stage.config for name, stage in STAGES.items() if stage.kind == "train"}
RUN_FLAGS_EXCLUDED = {"stages", *STAGES}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="Resumable RLHF pipeline on Prefect, Ray and DeepSpeed.")
    commands = parser.add_subparsers(dest="command", required=True)

    toy = commands.add_parser("toy", help="Toy model and data.").add_subparsers(dest="toy_command", required=True)
    toy_init = toy.add_parser("init", help="Write a tiny HF model, tokenizer and toy datasets into DIR.")
    toy_init.add_argument("directory", metavar="DIR")
    toy_init.add_argument("--seed", type=int, default=0, help="Seed of the toy model and data.")
    toy_init.set_defaults(handler=_cmd_toy)

    train = commands.add_parser("train", help="Train one stage.").add_subparsers(dest="stage", required=True)
    for stage, config in STAGE_CONFIGS.items():
        stage_parser = train.add_parser(stage, help=config.__doc__)
        add_openrlhf_flags(stage_parser, stage, (RunConfig, config), exclude=RUN_FLAGS_EXCLUDED)
        stage_parser.set_defaults(handler=_cmd_train)

    run = commands.add_parser("run", help="Run the pipeline from a YAML run config.")
    run.add_argument("config", metavar="CONFIG.yaml")
    run.set_defaults(handler=_cmd_run)

    ckpt = commands.add_parser("ckpt", help="Inspect checkpoints.").add_subparsers(dest="ckpt_command", required=True)
    ckpt_ls = ckpt.add_parser("ls", help="List the checkpoints of a stage folder ({ckpt_path}/{run_name}/{stage}).")
    ckpt_ls.add_argument("path", metavar="PATH")
    ckpt_ls.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    ckpt_ls.add_argument("--verify", action="store_true",
                         help="Check every file's checksum (the one its manifest names), not only its size.")
    status = commands.add_parser("status", help="Stages, last committed steps, alerts, lease and outputs of a run.")
    status.add_argument("run_url", metavar="RUN_URL", help="The run folder, {ckpt_path}/{run_name} (local or s3://).")
    status.set_defaults(handler=lambda args: cmd_status(args.run_url))
    goodput = commands.add_parser("goodput", help="Goodput of a run: useful step time against wall time, and where "
                                  "the rest went (stall, start-up, load, lost to crashes), from its goodput.json.")
    goodput.add_argument("run_url", metavar="RUN_URL", help="The run folder, {ckpt_path}/{run_name} (local or s3://).")
    goodput.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    goodput.set_defaults(handler=lambda args: cmd_goodput(args.run_url, args.json))
    add_plan_parser(commands)
    ckpt_verify = ckpt.add_parser("verify", help="Check every file's checksum in every checkpoint; exit 1 if "
                                  "the newest is not valid.")
    ckpt_verify.add_argument("path", metavar="PATH")
    ckpt_verify.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    for ckpt_command in (ckpt_ls, ckpt_verify):
        ckpt_command.set_defaults(handler=lambda args: cmd_ckpt(args.ckpt_command, args.path, args.json,
                                                                getattr(args, "verify", False)))

    combiner = commands.add_parser("lora-combiner", help="Merge a LoRA adapter into its base model.")
    add_openrlhf_flags(combiner, "lora-combiner", (MergeConfig,))
    combiner.set_defaults(handler=_cmd_lora_combiner)

    demo = commands.add_parser("demo", help="Run the pipeline on the toy model and data.")
    demo.add_argument("--workdir", default="./demo", help="Folder for toy assets, checkpoints and outputs.")
    demo.add_argument("--num_workers", type=int, default=1, help="DeepSpeed ranks (Ray actors).")
    demo.add_argument("--verbose", action="store_true", help=RunConfig.model_fields["verbose"].description)
    demo.set_defaults(handler=_cmd_demo)
    return parser


def add_plan_parser(commands) -> None:
    plan = commands.add_parser(
        "plan", help="Suggest --save_steps for a mean time between failures, by Young/Daly: T = sqrt(2*C*MTBF) "
        "seconds of work between checkpoints, C and the step time measured in the run's goodput.json.")
    plan.add_argument("--ckpt_path", required=True, help="Checkpoint root of the run (as given to rlhf train).")
    plan.add_argument("--run_name", default=RunConfig.model_fields["run_name"].default, help="Name of the run.")
    plan.add_argument("--mtbf_hours", type=float, required=True, help="Mean time between failures, in hours.")
    plan.add_argument("--stage", help="Only this stage (default: every stage in the ledger).")
    for name, what in (("checkpoint_seconds", "C, seconds each checkpoint costs the step loop"),
                       ("step_seconds", "seconds per optimizer step"),
                       ("restart_seconds", "R, seconds a restart costs (start-up and load)")):
        plan.add_argument(f"--{name}", type=float, help=f"{what}; overrides the measured value (needed with "
                          "no ledger, except restart_seconds, default 0).")
    plan.set_defaults(handler=cmd_plan)


def run_config_from_flags(stage: str, flags: dict[str, Any]) -> RunConfig:
    """The run a `rlhf train STAGE` command line (`flags`, as parsed) asks for, with OpenRLHF's defaults (0.11's
    where it spells a flag the 0.11 way); each default that departs from OpenRLHF's and matters is said once."""
    values = apply_openrlhf_flags(stage, flags, (RunConfig, STAGE_CONFIGS[stage]), RUN_FLAGS_EXCLUDED)
    values = {**dotted_defaults(stage, flags, values), **values}
    stage_fields = STAGE_CONFIGS[stage].model_fields
    stage_values = {name: value for name, value in values.items() if name in stage_fields}
    run_values = {name: value for name, value in values.items() if name in RunConfig.model_fields}
    try:
        run = RunConfig(stages=[stage], **run_values, **{stage: STAGE_CONFIGS[stage](**stage_values)})
    except ValidationError as error:
        raise UserError(describe_validation_error(error, f"rlhf train {stage}", flag_style=True)) from None
    say_departures(stage, values, run)
    return run


def cmd_lora_combiner(flags: dict[str, Any]) -> None:
    from rlhf_core.driver.export import merge_lora

    try:
        cfg = MergeConfig(**flags)
    except ValidationError as error:
        raise UserError(describe_validation_error(error, "rlhf lora-combiner", flag_style=True)) from None
    if cfg.model_path is None or cfg.lora_path is None:
        raise UserError("rlhf lora-combiner: --model_path and --lora_path are required.")
    with tempfile.TemporaryDirectory(prefix="rlhf-adapter-") as local_dir:
        adapter = checkpoint_adapter(cfg.lora_path, local_dir) or cfg.lora_path
        difference = merge_lora(cfg.model_path, adapter, cfg.output_path, cfg.bf16)
    print(f"merged {cfg.lora_path} into {cfg.model_path} -> {cfg.output_path} "
          f"(max logit difference vs base+adapter: {difference:.2e})")


def checkpoint_adapter(lora_path: str, local_dir: str) -> str | None:
    """The seed's `--lora_path {ckpt_path}/latest` (or `.../step_N`): the policy adapter of that checkpoint,
    verified and downloaded into `local_dir`; None when `lora_path` names no checkpoint."""
    from rlhf_core.driver.export import hf_files_of
    from rlhf_core.storage.manifest import HF_WEIGHTS_DIR
    from rlhf_core.storage.checkpoint import CheckpointStore
    from rlhf_core.storage.manifest import parse_step_dir_name

    parent, _, name = lora_path.rstrip("/").rpartition("/")
    if not parent or (name != "latest" and parse_step_dir_name(name) is None):
        return None
    store = CheckpointStore(parent)
    committed = [info for info in store.list(verify=True) if info.is_committed]
    chosen = committed[-1:] if name == "latest" else [info for info in committed if info.name == name]
    if not chosen:
        raise UserError(f"--lora_path {lora_path}: {parent} holds no valid checkpoint "
                        f"{'at all' if name == 'latest' else name} (see `rlhf ckpt ls {parent}`).")
    store.download(chosen[0].step, local_dir, hf_files_of("actor_model"))
    return os.path.join(local_dir, "actor_model", HF_WEIGHTS_DIR)


def _run_pipeline(run: RunConfig, command_started: float | None, signals: StopSignals) -> None:
    from flows.pipeline import run_pipeline

    run_pipeline(run, command_started, signals)


def run_quietly(run_url: str, run_name: str, verbose: bool, start: typing.Callable[[StopSignals], Any],
                stop_grace_s: float = RunConfig.model_fields["stop_grace_s"].default) -> None:
    """`start()` (a training command) with the quiet console of rlhf_core.ops.console: its log file is written once
    the run is real, and not at all when the run is refused with a UserError. SIGTERM and Ctrl-C stop it
    after an emergency checkpoint (rlhf_core.driver.stop) from the first moment on, Prefect's start included."""
    import flows.pipeline  # noqa: F401 - importing prefect sets up its logging; the console's filters go on it
    from rlhf_core.ops.console import configure_console, discard_log_file, open_log_file, reset_console
    from rlhf_core.ops.run_log import log_file_for

    configure_console(log_file_for(run_url, run_name), verbose)
    try:
        with StopSignals(stop_grace_s, owns_process=True).obeying() as signals:
            start(signals)
    except UserError:
        discard_log_file()
        reset_console()  # the one-sentence error prints as usual; an in-process caller (tests) gets logging back
        raise
    except BaseException:
        open_log_file()
        raise
    open_log_file()


def prefect_environment() -> None:
    """Prefect's settings for a command, each only where the user's environment does not set it; before prefect
    is imported (its import reads them)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's client prints a telemetry banner on import, on a terminal, whatever the server's analytics; only
    # DO_NOT_TRACK stops it. Set unless the user turned the analytics on (PREFECT_SERVER_ANALYTICS_ENABLED) or
    # chose DO_NOT_TRACK's value.
    if os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"].strip().lower() in ("false", "0", "no", "off", ""):
        os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "rlhf_core")  # fallback and set-aside notices
    # rlhf_core's warnings during preflight come before any flow run: keep them off Prefect's API handler.
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    # The ephemeral server's start took 12-25 s on a loaded 2-core machine, past Prefect's 20 s default, which then
    # starts a second one (see flows.startup.EphemeralServer).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")


def main(argv: Sequence[str] | None = None) -> int:
    prefect_environment()
    args = build_parser().parse_args(argv)
    if argv is None:  # a real command (not a test calling main): the ledger's start-up counts from its start
        from rlhf_core.ops.goodput import process_start_time

        args.command_started = process_start_time()
    code = _handle(args)
    if argv is None:  # a real command leaves without Ray's exit waits and the interpreter's teardown (~2 s)
        from rlhf_core.driver.process_exit import exit_now

        exit_now(code)
    return code


def _handle(args: argparse.Namespace) -> int:
    try:
        return args.handler(args) or 0
    except StoppedBySignal as stopped:
        print(f"rlhf: {stopped}", file=sys.stderr)
        return stopped.exit_code  # 130 after Ctrl-C, 143 after SIGTERM, as a shell reports them
    except RLHFError as error:  # one sentence, its remedy included; 2 for the user's own mistakes
        print(f"rlhf: error: {error}", file=sys.stderr)
        return error.exit_code


def _own_flags(args: argparse.Namespace, *parser_keys: str) -> dict[str, Any]:
    """The flags a command was given, without the parser's own entries (the command, its handler, ...)."""
    return {key: value for key, value in vars(args).items()
            if key not in ("command", "handler", "command_started", *parser_keys)}


def _cmd_toy(args: argparse.Namespace) -> None:
    from rlhf_core.toy import init_toy

    for name, path in init_toy(args.directory, args.seed).items():
        print(f"{name}: {path}")


def _cmd_train(args: argparse.Namespace) -> None:
    run = run_config_from_flags(args.stage, _own_flags(args, "stage"))
    started = getattr(args, "command_started", None)
    run_quietly(run.run_url(), run.run_name, run.verbose, functools.partial(_run_pipeline, run, started),
                run.stop_grace_s)


def _cmd_run(args: argparse.Namespace) -> None:
    run = load_run_config(args.config)
    started = getattr(args, "command_started", None)
    run_quietly(run.run_url(), run.run_name, run.verbose, functools.partial(_run_pipeline, run, started),
                run.stop_grace_s)


def _cmd_lora_combiner(args: argparse.Namespace) -> None:
    cmd_lora_combiner(apply_openrlhf_flags("lora-combiner", _own_flags(args), (MergeConfig,)))


def _cmd_demo(args: argparse.Namespace) -> None:
    from flows.demo import demo_config, run_demo

    demo_run = demo_config(args.workdir, args.num_workers)
    run_quietly(demo_run.run_url(), demo_run.run_name, args.verbose,
                functools.partial(run_demo, args.workdir, args.num_workers))


if __name__ == "__main__":
    sys.exit(main())
