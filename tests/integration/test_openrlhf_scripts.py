"""OpenRLHF's own example scripts run here with only the edits the issue allows.

`train_sft.sh`, `train_rm.sh` and `train_ppo_with_reward_fn.sh`, from OpenRLHF v0.9.10 (flat flags) and v0.11.0
(dotted flags), byte-identical copies in tests/data/openrlhf. Each script's command is parsed from its text
(`openrlhf_scripts.parse_script`) and edited by the tables below: the launcher (`deepspeed --module
openrlhf.cli.train_sft` -> `rlhf train sft`; in `ray job submit ... -- python3 -m openrlhf.cli.train_ppo_ray` the
dashboard address, the working_dir and `python3 -m ...` -> `rlhf train ppo`), model and dataset names (the toy
of `rlhf toy init`), data keys, sizes (lengths, batches, max_samples, GPU and engine counts) and paths. Every
other flag stays as the script has it: `--zero_stage 3`, `--param_dtype bf16`, `--attn_implementation
flash_attention_2`, `--packing_samples`, `--gradient_checkpointing`, `--load_checkpoint`, `--adam_offload`,
`--colocate_actor_ref`, `--normalize_reward`, `--use_wandb {wandb_token}` (with WANDB_MODE=offline) ... and
`test_edits_touch_only_allowed_flags` proves the edited command has the script's flags, in its order, with
only the allowed ones changed.

SFT and RM run as `rlhf train ...` subprocesses in a folder of their own (the scripts set no --ckpt_path, so
checkpoints go to OpenRLHF's default place relative to the working directory, here ./ckpt). PPO is submitted
with `ray job submit` to a `ray start --head` cluster with its dashboard (one per module), as the script does;
`rlhf` is found on the cluster's PATH (the head starts from the venv, as after `source .venv/bin/activate`).
Its checkpoints land in Ray's copy of the working_dir (the job's working directory), where the test looks for them.

Each run must exit 0, leave the final model in --save_path and a committed checkpoint, print no traceback,
print each mapped flag's note once and the warning of each flag this CPU machine cannot honour. The wall time
of each script is printed (run with -s to see it); nothing is asserted on time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from flows.openrlhf_flags import MAPPED, flags_for
from rlhf_core.checkpoint import CheckpointStore
from rlhf_core.ds_config import cpu_supports_bf16
from tests.conftest import RLHF
from tests.integration.conftest import VENV_BIN, BackgroundProcess, free_port
from tests.integration.openrlhf_scripts import (
    DATA_DIR,
    RELEASES,
    Command,
    ScriptEdits,
    changed_flags,
    dotted_name,
    edit_command,
    parse_script,
)

SCRIPTS = {"sft": "train_sft.sh", "rm": "train_rm.sh", "ppo": "train_ppo_with_reward_fn.sh"}
OPENRLHF_CLI = {"sft": "train_sft", "rm": "train_rm", "ppo": "train_ppo_ray"}
RUN_TIMEOUT_S = 900

# The only flags an edit may touch (0.9 spelling), and why the issue allows it.
ALLOWED_EDITS = {
    "pretrain": "model name", "dataset": "dataset name", "prompt_data": "dataset name",
    "input_key": "data key", "max_len": "size", "train_batch_size": "size", "micro_train_batch_size": "size",
    "max_samples": "size", "rollout_batch_size": "size", "micro_rollout_batch_size": "size",
    "actor_num_gpus_per_node": "GPU count", "vllm_num_engines": "engine count (no GPU here)",
    "save_path": "path", "remote_rm_url": "path (the reward_func.py file)",
}

# Flags whose hardware this machine lacks: the warning each must print when the script has it, as
# (flag, text in the warning, whether it is expected here).
HARDWARE_WARNINGS = [
    ("attn_implementation", "--attn_implementation flash_attention_2: no CUDA device here; using sdpa", True),
    ("param_dtype", "--param_dtype bf16: this CPU has no native bf16", not cpu_supports_bf16()),
    ("adam_offload", "--adam_offload has no effect here", True),
]
TRACEBACK = "Traceback (most recent call last)"


def sft_edits(toy: dict[str, str], out: Path) -> ScriptEdits:
    return ScriptEdits("train_sft", (RLHF, "train", "sft"), {
        "max_len": ("64",), "dataset": (toy["sft"],), "input_key": ("prompt",), "train_batch_size": ("8",),
        "max_samples": ("64",), "pretrain": (toy["model"],), "save_path": (str(out),),
    })


def rm_edits(toy: dict[str, str], out: Path) -> ScriptEdits:
    # The script sets no --max_samples: all 256 toy pairs (7 steps of 32, 10% held out) are trained on.
    return ScriptEdits("train_rm", (RLHF, "train", "rm"), {
        "save_path": (str(out),), "train_batch_size": ("32",), "micro_train_batch_size": ("4",),
        "pretrain": (toy["model"],), "max_len": ("64",), "dataset": (toy["prefs"],),
    })


def ppo_edits(toy: dict[str, str], out: Path, launcher: tuple[str, ...], reward_file: Path) -> ScriptEdits:
    return ScriptEdits("train_ppo_ray", launcher, {
        "actor_num_gpus_per_node": ("1",), "vllm_num_engines": ("0",), "pretrain": (toy["model"],),
        "remote_rm_url": (str(reward_file),), "save_path": (str(out),), "micro_train_batch_size": ("4",),
        "train_batch_size": ("8",), "micro_rollout_batch_size": ("4",), "rollout_batch_size": ("8",),
        "max_samples": ("16",), "max_len": ("64",), "prompt_data": (toy["prompts"],), "input_key": ("prompt",),
    })


def ray_job_launcher(original: tuple[str, ...], dashboard: str, working_dir: Path) -> tuple[str, ...]:
    """The script's `ray job submit --address=... --runtime-env-json=... -- python3 -m`, pointed at our dashboard
    and working_dir, running `rlhf train ppo` instead of the OpenRLHF module."""
    assert original[:3] == ("ray", "job", "submit") and original[-3:] == ("--", "python3", "-m"), original
    words = [str(VENV_BIN / "ray"), *original[1:-2]]
    for index, word in enumerate(words):
        if word.startswith("--address="):
            words[index] = f"--address={dashboard}"
        elif word.startswith("--runtime-env-json="):
            runtime_env = json.loads(word.split("=", 1)[1])
            assert set(runtime_env) == {"working_dir"}, runtime_env
            words[index] = "--runtime-env-json=" + json.dumps({"working_dir": str(working_dir)})
    return (*words, "rlhf", "train", "ppo")


REWARD_FUNC = '''\
"""reward_func in OpenRLHF's published form (examples/python/reward_func.py), scoring the toy sorting task
with its gold score: `queries` are prompt + response decoded with special tokens."""
import re

import torch

from rlhf_core.toy import gold_score

TASK = re.compile(r"sort\\s*:\\s*[\\d\\s]*=")
SPECIAL_TOKEN = re.compile(r"<[^<>\\s]+>")


def reward_func(queries, prompts, labels, **kwargs):
    scores = []
    for query in queries:
        task = TASK.search(query)
        response = SPECIAL_TOKEN.sub(" ", query[task.end():])
        response = re.sub(r"^\\s*assistant\\s*:", "", response)  # the toy chat template's generation prompt
        scores.append(gold_score(task.group(0), response))
    scores = torch.tensor(scores)
    return {"rewards": scores, "scores": scores, "extra_logs": {"gold_score": scores}}
'''


def ppo_working_dir(root: Path, release: str) -> None:
    """A working_dir laid out as the script's /openrlhf: the script itself and examples/python/reward_func.py.
    (Each release's copy differs, so Ray unpacks each into a folder of its own.)"""
    scripts, python = root / "examples" / "scripts", root / "examples" / "python"
    scripts.mkdir(parents=True)
    python.mkdir(parents=True)
    shutil.copyfile(DATA_DIR / release / SCRIPTS["ppo"], scripts / SCRIPTS["ppo"])
    (python / "reward_func.py").write_text(REWARD_FUNC)


def test_edits_touch_only_allowed_flags(tmp_path):
    """For all six scripts: the edited command keeps every flag of the script, in order, and changes only
    flags of ALLOWED_EDITS (the launcher aside); and the 0.9 and 0.11 scripts get the same edits."""
    toy = {name: f"/toy/{name}" for name in ("model", "sft", "prefs", "prompts")}
    for release in RELEASES:
        for stage, (original, edits) in _edited_scripts(toy, tmp_path, release, "http://127.0.0.1:1").items():
            edited = edit_command(original, edits, release)
            changed = changed_flags(original, edited)
            assert changed == {edits.spelled(flag, release) for flag in edits.values}, (release, stage, changed)
            assert set(edits.values) <= set(ALLOWED_EDITS), set(edits.values) - set(ALLOWED_EDITS)
            assert edited.argv()[:len(edits.launcher)] == list(edits.launcher)
            assert edited.argv()[len(edits.launcher):] == edited.arguments()


def _edited_scripts(toy, root: Path, release: str, dashboard: str) -> dict[str, tuple[Command, ScriptEdits]]:
    scripts = {stage: parse_script(DATA_DIR / release / name) for stage, name in SCRIPTS.items()}
    working_dir = root / f"openrlhf-{release}"
    reward_file = working_dir / "examples" / "python" / "reward_func.py"
    return {
        "sft": (scripts["sft"], sft_edits(toy, root / release / "out" / "sft")),
        "rm": (scripts["rm"], rm_edits(toy, root / release / "out" / "rm")),
        "ppo": (scripts["ppo"], ppo_edits(toy, root / release / "out" / "ppo",
                                          ray_job_launcher(scripts["ppo"].launcher, dashboard, working_dir),
                                          reward_file)),
    }


class RayHead:
    """`ray start --head` with its dashboard on free loopback ports, in a private temp dir."""

    def __init__(self, env: dict[str, str]):
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rlhf-ray-"))  # short: Ray's socket paths live under it
        self.address, port = f"127.0.0.1:{free_port()}", free_port()
        self.dashboard = f"http://127.0.0.1:{port}"
        self.process = BackgroundProcess.start("ray-head", [
            str(VENV_BIN / "ray"), "start", "--head", "--block", f"--port={self.address.split(':')[1]}",
            "--num-cpus=2", "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={port}",
            f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
            "--disable-usage-stats", f"--temp-dir={self.temp_dir}"], env, self.temp_dir / "head.log")

    def wait_until_ready(self, env: dict[str, str], timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while subprocess.run([str(VENV_BIN / "ray"), "job", "list", f"--address={self.dashboard}"], env=env,
                             capture_output=True, text=True, check=False).returncode != 0:
            assert self.process.alive() and time.monotonic() < deadline, \
                f"the Ray head's job server did not start:\n{self.process.log_tail()}"
            time.sleep(1)

    def unpacked_working_dirs(self) -> list[Path]:
        """Folders into which Ray unpacked jobs' working_dirs (beside them: the .zip packages and their locks)."""
        return list({path.resolve() for path in self.temp_dir.glob("session_*/runtime_resources/working_dir_files/*")
                     if path.is_dir()})  # resolved: session_latest links to the session

    def stop(self) -> None:
        self.process.stop(grace=3)  # SIGKILL follows: after SIGTERM, gcs_server and raylet stay alive
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head(rlhf_env):
    """One Ray cluster with a job server for both PPO scripts. Its environment is what a job's driver gets:
    WANDB_MODE=offline for the scripts' --use_wandb; RAY_AUTH_MODE=disabled for a loopback test cluster."""
    env = {**rlhf_env, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "offline",
           # as `source .venv/bin/activate && ray start --head`: a job's `rlhf` is the cluster's, as in the seed
           "PATH": os.pathsep.join([str(VENV_BIN), rlhf_env.get("PATH", "")])}
    env.pop("RAY_ADDRESS", None)
    head = RayHead(env)
    try:
        head.wait_until_ready(env)
        yield head, env
    finally:
        head.stop()


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("openrlhf-scripts")


def expected_notes(stage: str, command: Command) -> list[str]:
    """The one `rlhf: note:` line each mapped flag of the command prints (as flows/cli.py words it)."""
    notes = []
    for flag in flags_for(stage):
        if flag.kind == MAPPED and set(flag.spellings(stage)) & set(command.flags):
            spelled = " / ".join(f"--{name}" for name in flag.spellings(stage))
            notes.append(f"rlhf: note: {spelled}: {flag.note}.")
    return notes


def check_output(stage: str, release: str, command: Command, output: str) -> None:
    assert TRACEBACK not in output, f"a traceback in the output of {release} {SCRIPTS[stage]}:\n{output[-6000:]}"
    notes = expected_notes(stage, command)
    assert stage != "ppo" or notes, "the PPO script has mapped flags (e.g. --colocate_actor_ref)"
    for note in notes:
        assert output.count(note) == 1, f"expected once: {note!r}\n{output[-4000:]}"
    for flag, warning, expected in HARDWARE_WARNINGS:
        if _spelled(stage, release, flag) in command.flags:
            assert (warning in output) == expected, (f"{'missing' if expected else 'unexpected'} warning "
                                                     f"{warning!r}\n{output[-4000:]}")


def check_outputs(save_path: Path, stage_ckpt: Path) -> None:
    """The final model in --save_path, and a committed (manifest-verified) checkpoint of the stage."""
    assert (save_path / "config.json").is_file(), sorted(p.name for p in save_path.glob("*"))
    assert any((save_path / name).is_file() for name in ("model.safetensors", "adapter_model.safetensors")), \
        sorted(p.name for p in save_path.glob("*"))
    committed = [info.step for info in CheckpointStore(str(stage_ckpt)).list(verify=True) if info.is_committed]
    assert committed, f"no committed checkpoint in {stage_ckpt}"


def run_script(stage: str, release: str, toy: dict[str, str], root: Path, rlhf_env: dict[str, str],
               request) -> tuple[Command, subprocess.CompletedProcess, float, Path]:
    """Run one edited script; returns the command, its result, its wall time and the stage's checkpoint folder."""
    workdir = root / release
    workdir.mkdir(exist_ok=True)
    if stage == "ppo":
        head, env = request.getfixturevalue("ray_head")
        ppo_working_dir(root / f"openrlhf-{release}", release)
        before = set(head.unpacked_working_dirs())
        original, edits = _edited_scripts(toy, root, release, head.dashboard)["ppo"]
    else:
        env = {key: value for key, value in rlhf_env.items() if key != "RAY_ADDRESS"}
        original, edits = _edited_scripts(toy, root, release, "")[stage]
    command = edit_command(original, edits, release)
    started = time.monotonic()
    result = subprocess.run(command.argv(), cwd=workdir, env=env, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
    wall_s = time.monotonic() - started
    stage_s = re.search(rf"{stage}: output in \S+ \(([\d.]+) s\)", result.stdout + result.stderr)
    print(f"\n{release} {SCRIPTS[stage]}: exit {result.returncode}, wall time {wall_s:.1f} s "
          f"(the stage itself: {stage_s.group(1) + ' s' if stage_s else 'not reported'})")
    if stage == "ppo":  # the job ran in Ray's unpacked copy of the working_dir: OpenRLHF's relative paths go there
        unpacked = [path for path in set(head.unpacked_working_dirs()) - before if (path / "ckpt").is_dir()]
        assert len(unpacked) == 1, f"expected one unpacked working_dir holding ckpt/, found {unpacked}"
        ckpt_root = unpacked[0]
    else:
        ckpt_root = workdir
    return command, result, wall_s, ckpt_root / "ckpt" / "rlhf" / stage


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(SCRIPTS))
@pytest.mark.parametrize("release", RELEASES)
def test_openrlhf_example_script_runs(release, stage, toy_assets, rlhf_env, runs_root, request):
    command, result, _, stage_ckpt = run_script(stage, release, toy_assets, runs_root, rlhf_env, request)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command.argv())}\nexited {result.returncode}:\n{output[-8000:]}"
    check_output(stage, release, command, output)
    check_outputs(Path(command.value(_spelled(stage, release, "save_path"))[0]), stage_ckpt)
    if stage == "ppo":
        assert "W&B syncing is set to `offline`" in output, "--use_wandb did not start an (offline) wandb run"


def _spelled(stage: str, release: str, flag: str) -> str:
    """The script's spelling of the 0.9 flag `flag`."""
    return flag if release == "v0.9.10" else dotted_name(OPENRLHF_CLI[stage], flag)
