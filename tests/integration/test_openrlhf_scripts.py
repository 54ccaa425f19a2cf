"""OpenRLHF's own example scripts run here as their users run them: hub names as written, chat data, templates kept.

The scripts, byte-identical copies in tests/data/openrlhf/{release}/ (SOURCE.md names each upstream blob):
- `train_sft.sh`, `train_rm.sh`, `train_dpo_llama.sh`, `train_ppo_with_reward_fn.sh` from OpenRLHF v0.9.10 (flat
  flags) and v0.11.0 (dotted flags);
- `train_ppo_llama_ray.sh` from v0.9.0, the seed guide's flagship (actor, critic and reward model; the older
  spellings `--bf16`, `--prompt_max_len`, `--generate_max_len`, `--colocate_critic_reward`, `--reward_num_nodes`);
- `train_ppo_ray_hybrid_engine.sh` (v0.9.10; actor, critic, reward model, no micro batch sizes) and
  `train_dapo_ray_hybrid_engine.sh` (v0.11.0: group_norm with dynamic filtering, 8 samples per prompt). The
  v0.9.10 DAPO script names `--vllm_enable_is_correction`, a flag OpenRLHF 0.9.10 does not have: its own parser
  exits 2 on it, and so does ours (`test_v0910_dapo_script_is_refused_as_openrlhf_refuses_it`);
- `train_reinforce_baseline_ray_agent_multiturn.sh` from v0.9.0, the seed guide's multi-turn agent script
  (`ray job submit`, `NUM_GPUS=${1:-8}` expanded as bash expands it), its `--agent_func_path` pointed at OpenRLHF's
  v0.9.0 `examples/python/agent_func.py` with the one import line a user changes (`rlhf_core.agent`).

The names the scripts give (`meta-llama/Meta-Llama-3-8B`, `Open-Orca/OpenOrca` with `question`/`response`,
`OpenRLHF/Llama-3-8b-sft-mixture`, `OpenRLHF/Llama-3-8b-rm-mixture`, `OpenRLHF/Llama-3-8b-rm-700k`,
`OpenRLHF/preference_dataset_mixture2_and_safe_pku` with `chosen`/`rejected` conversations and no prompt column,
`OpenRLHF/prompt-collection-v0.1` with `context_messages` message lists) resolve from a local Hugging Face cache
the module builds once (`tests.hub_cache.build_openrlhf_hub`: tiny random Llamas with Llama-3 tokenizers whose chat
template writes BOS itself, reward models in OpenRLHF's backbone + `score` layout, datasets as parquet shards
under data/), with HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1.

Each script's command is parsed from its text (`openrlhf_scripts.parse_script`) and edited only by the launcher
(`deepspeed --module` / `python3 -m` -> `rlhf train STAGE`; in `ray job submit ... -- python3 -m` the dashboard
address, the working_dir and `python3 -m ...` -> `rlhf train ppo`), paths, sizes (lengths, batches, max_samples)
and GPU and engine counts: ALLOWED_EDITS. Every other flag stays as the script has it (`--apply_chat_template`,
`--zero_stage 3`, `--param_dtype bf16` / `--bf16`, `--attn_implementation flash_attention_2`, `--packing_samples`,
`--gradient_checkpointing`, `--load_checkpoint`, `--adam_offload`, `--colocate_*`, `--normalize_reward`,
`--use_wandb {wandb_token}` with WANDB_MODE=offline, ...), and `test_edits_touch_only_allowed_flags` proves the
edited command has the script's flags, in its order, with only those changed.

SFT, RM and DPO run as `rlhf train ...` subprocesses in a folder of their own (those scripts set no --ckpt_path, so
checkpoints go to OpenRLHF's default place relative to the working directory, here ./ckpt), and so do the scripts
that launch `python3 -m openrlhf.cli.train_ppo_ray` directly (their --ckpt_path is a path edit); their drivers join
the module's Ray head through RAY_ADDRESS, as in a shell on a cluster. The `ray job submit` scripts are submitted to
that `ray start --head` cluster with its dashboard (one per module), as the scripts do; `rlhf` is found on the
cluster's PATH (the head starts from the venv, as after `source .venv/bin/activate`), and their checkpoints land
in Ray's copy of the working_dir (the job's working directory).

Each run must exit 0, leave the final model in --save_path and a committed checkpoint whose metadata names the
models and datasets as the script wrote them (DPO's reference model, which the scripts leave unset, as their
--pretrain: OpenRLHF's default), print no traceback, print each mapped flag's note once and the warning of each
flag this CPU machine cannot honour. The wall time of each script is printed (run with -s to see it); nothing is
asserted on time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from flows.openrlhf_flags import MAPPED, OPENRLHF_MODULES, flags_for
from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.models.precision import cpu_supports_bf16
from tests.conftest import HUB_REVISION, RLHF
from tests.hub_cache import build_openrlhf_hub
from tests.integration.conftest import VENV_BIN, BackgroundProcess, free_port
from tests.integration.openrlhf_scripts import (
    DATA_DIR,
    DOTTED_RELEASES,
    Command,
    ScriptEdits,
    changed_flags,
    dotted_name,
    edit_command,
    parse_script,
)

# The only flags an edit may touch (0.9 spelling), and why the issue allows it.
ALLOWED_EDITS = {
    "max_len": "size", "prompt_max_len": "size", "generate_max_len": "size", "train_batch_size": "size",
    "micro_train_batch_size": "size", "max_samples": "size", "rollout_batch_size": "size",
    "micro_rollout_batch_size": "size",
    "actor_num_gpus_per_node": "GPU count", "vllm_num_engines": "engine count (no GPU here)",
    "ref_num_gpus_per_node": "GPU count", "num_episodes": "size (the agent script's 1000000 passes: until stopped)",
    "save_path": "path", "ckpt_path": "path", "remote_rm_url": "path (the reward_func.py file)",
    "agent_func_path": "path (OpenRLHF's agent_func.py, its import line changed: gem's is not installable here)",
}
PATH_FLAGS = ("save_path", "ckpt_path", "remote_rm_url", "agent_func_path")


@dataclass(frozen=True)
class Script:
    """One OpenRLHF script to run: its copy, the stage it trains, and its size / GPU / engine edits."""

    release: str
    name: str
    stage: str  # sft, rm, dpo, ppo
    sizes: dict[str, str]

    @property
    def id(self) -> str:
        return f"{self.release}-{self.name.removesuffix('.sh')}"

    @property
    def cli(self) -> str:
        return OPENRLHF_MODULES[self.stage]

    def spelled(self, flag: str) -> str | None:
        """The script's spelling of the 0.9 flag `flag` (None: this release has no such flag)."""
        if self.release not in DOTTED_RELEASES:
            return flag
        try:
            return dotted_name(self.cli, flag)
        except KeyError:
            return None


SFT_SIZES = {"max_len": "64", "train_batch_size": "8", "max_samples": "64"}
RM_SIZES = {"train_batch_size": "16", "micro_train_batch_size": "4", "max_len": "64"}  # all 128 pairs, 10% held out
DPO_SIZES = {"train_batch_size": "16", "micro_train_batch_size": "4", "max_len": "64"}  # the RM script's pairs, as RM
PPO_FN_SIZES = {"actor_num_gpus_per_node": "1", "vllm_num_engines": "0", "micro_train_batch_size": "4",
                "train_batch_size": "8", "micro_rollout_batch_size": "4", "rollout_batch_size": "8",
                "max_samples": "16", "max_len": "64"}
SCRIPTS = [
    *(Script(release, "train_sft.sh", "sft", SFT_SIZES) for release in ("v0.9.10", "v0.11.0")),
    *(Script(release, "train_rm.sh", "rm", RM_SIZES) for release in ("v0.9.10", "v0.11.0")),
    *(Script(release, "train_dpo_llama.sh", "dpo", DPO_SIZES) for release in ("v0.9.10", "v0.11.0")),
    *(Script(release, "train_ppo_with_reward_fn.sh", "ppo", PPO_FN_SIZES) for release in ("v0.9.10", "v0.11.0")),
    Script("v0.9.0", "train_ppo_llama_ray.sh", "ppo", {
        "actor_num_gpus_per_node": "1", "vllm_num_engines": "0", "micro_train_batch_size": "4",
        "train_batch_size": "8", "micro_rollout_batch_size": "4", "rollout_batch_size": "8", "max_samples": "8",
        "prompt_max_len": "48", "generate_max_len": "16"}),
    Script("v0.9.10", "train_ppo_ray_hybrid_engine.sh", "ppo", {  # micro batch sizes: OpenRLHF's defaults
        "actor_num_gpus_per_node": "1", "vllm_num_engines": "0", "train_batch_size": "8",
        "rollout_batch_size": "8", "max_samples": "8", "max_len": "64"}),
    Script("v0.11.0", "train_dapo_ray_hybrid_engine.sh", "ppo", {  # 2 prompts x 8 samples: one step
        "actor_num_gpus_per_node": "1", "vllm_num_engines": "0", "train_batch_size": "16",
        "rollout_batch_size": "2", "max_samples": "2", "max_len": "64"}),
    Script("v0.9.0", "train_reinforce_baseline_ray_agent_multiturn.sh", "ppo", {  # 2 prompts x 16 episodes, 2 steps
        "ref_num_gpus_per_node": "1", "actor_num_gpus_per_node": "1", "vllm_num_engines": "0",
        "train_batch_size": "32", "rollout_batch_size": "2", "max_samples": "4", "num_episodes": "1",
        "prompt_max_len": "48", "generate_max_len": "32"}),
]
HUB_FLAGS = ("pretrain", "reward_pretrain", "dataset", "prompt_data")  # names the checkpoint must keep as written

# Flags whose hardware this machine lacks: the warning each must print when the script has it, as
# (flag, text in the warning, whether it is expected here).
HARDWARE_WARNINGS = [
    ("attn_implementation", "--attn_implementation flash_attention_2: no CUDA device here; using sdpa", True),
    ("param_dtype", "--param_dtype bf16: this CPU has no native bf16", not cpu_supports_bf16()),
    ("bf16", "--param_dtype bf16: this CPU has no native bf16", not cpu_supports_bf16()),
    ("adam_offload", "--adam_offload has no effect here", True),
    ("deepspeed_enable_sleep", "enable_sleep: has no effect on a CPU", True),
]
TRACEBACK = "Traceback (most recent call last)"


def launcher_for(script: Script, original: tuple[str, ...], dashboard: str, working_dir: Path) -> tuple[str, ...]:
    if original[:3] == ("ray", "job", "submit"):
        return ray_job_launcher(original, dashboard, working_dir)
    assert original in (("deepspeed", "--module"), ("python3", "-m")), original
    return (RLHF, "train", script.stage)


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


def script_edits(script: Script, original: Command, root: Path, dashboard: str) -> ScriptEdits:
    """The launcher, the script's sizes, and its paths moved under `root/{script.id}/`."""
    working_dir = root / f"openrlhf-{script.id}"
    paths = {"save_path": str(root / script.id / "out"), "ckpt_path": str(root / script.id / "ckpt"),
             "remote_rm_url": str(working_dir / "examples" / "python" / "reward_func.py"),
             "agent_func_path": str(working_dir / "examples" / "python" / "agent_func.py")}
    values = {flag: (value,) for flag, value in script.sizes.items()}
    values.update({flag: (paths[flag],) for flag in PATH_FLAGS if script.spelled(flag) in original.flags})
    return ScriptEdits(script.cli, launcher_for(script, original.launcher, dashboard, working_dir), values)


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
        response = re.sub(r"^\\s*assistant\\s*:?", "", response)  # the generation prompt (Llama-3: a header)
        scores.append(gold_score(task.group(0), response))
    scores = torch.tensor(scores)
    return {"rewards": scores, "scores": scores, "extra_logs": {"gold_score": scores}}
'''


def openrlhf_working_dir(root: Path, script: Script) -> None:
    """A working_dir laid out as the scripts' /openrlhf: the script itself, examples/python/reward_func.py, and
    OpenRLHF's v0.9.0 examples/python/agent_func.py with its one import line changed to this package's.
    (Each script's copy differs, so Ray unpacks each into a folder of its own.)"""
    scripts, python = root / "examples" / "scripts", root / "examples" / "python"
    scripts.mkdir(parents=True)
    python.mkdir(parents=True)
    shutil.copyfile(DATA_DIR / script.release / script.name, scripts / script.name)
    (python / "reward_func.py").write_text(REWARD_FUNC)
    agent = (DATA_DIR / "v0.9.0" / "agent_func.py").read_text()
    (python / "agent_func.py").write_text(agent.replace("from openrlhf.utils.agent import", "from rlhf_core.agent import"))


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_script_copies_are_byte_identical_to_upstream():
    """Every script listed in a SOURCE.md has the git blob id it names there (and its mode); every script run
    here is listed."""
    listed = set()
    for source in sorted(DATA_DIR.glob("v*/SOURCE.md")):
        for name, upstream, blob, mode in re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| `([0-9a-f]{40})` \| (\d+) \|$",
                                                     source.read_text(), flags=re.M):
            copy = source.parent / name
            assert _git_blob_id(copy.read_bytes()) == blob, f"{copy} is not upstream's {upstream} ({blob})"
            assert bool(copy.stat().st_mode & 0o100) == (mode == "100755"), (copy, mode)
            listed.add(copy)
    assert {DATA_DIR / script.release / script.name for script in SCRIPTS} <= listed


def test_edits_touch_only_allowed_flags(tmp_path):
    """For every script: the edited command keeps every flag of the script, in order, and changes only flags of
    ALLOWED_EDITS (the launcher aside); the hub names, data keys and --apply_chat_template stay as written; and
    every flag the script gives is a row of flows/openrlhf_flags.py."""
    for script in SCRIPTS:
        original = parse_script(DATA_DIR / script.release / script.name)
        edits = script_edits(script, original, tmp_path, "http://127.0.0.1:1")
        edited = edit_command(original, edits, script.release)
        changed = changed_flags(original, edited)
        assert changed == {edits.spelled(flag, script.release) for flag in edits.values}, (script.id, changed)
        assert set(edits.values) <= set(ALLOWED_EDITS), (script.id, set(edits.values) - set(ALLOWED_EDITS))
        assert edited.argv()[:len(edits.launcher)] == list(edits.launcher)
        assert edited.argv()[len(edits.launcher):] == edited.arguments()
        known = {name for flag in flags_for(script.stage) for name in flag.spellings(script.stage)}
        assert set(original.flags) <= known, (script.id, sorted(set(original.flags) - known))
        for flag in (*HUB_FLAGS, "input_key", "output_key", "prompt_key", "chosen_key", "rejected_key"):
            spelled = script.spelled(flag)
            if spelled in original.flags:
                assert edited.value(spelled) == original.value(spelled), (script.id, flag)
    plain = {script.name for script in SCRIPTS if script.spelled("apply_chat_template")
             not in parse_script(DATA_DIR / script.release / script.name).flags}
    # every other script keeps --apply_chat_template, and runs with it (the agent script's prompts are plain text)
    assert plain == {"train_sft.sh", "train_reinforce_baseline_ray_agent_multiturn.sh"}, plain


def test_v0910_dapo_script_is_refused_as_openrlhf_refuses_it(tmp_path, rlhf_env):
    """v0.9.10's train_dapo_ray_hybrid_engine.sh gives `--vllm_enable_is_correction`, which OpenRLHF 0.9.10's
    train_ppo_ray parser does not define (its flag is --enable_vllm_is_correction; argparse's prefix matching
    cannot reach it either), so OpenRLHF itself exits 2 on the script. `rlhf train ppo` does the same, with
    argparse's message, before anything loads; v0.11.0's copy of the script, which is correct, runs below."""
    flags = json.loads((DATA_DIR / "flags.json").read_text())["v0.9.10"]["train_ppo_ray"]
    names = {name for option in flags for name in (option["flag"], *option["aliases"])}
    assert "vllm_enable_is_correction" not in names and "enable_vllm_is_correction" in names
    assert not any(name.startswith("vllm_enable_is_correction") for name in names)
    dapo_sizes = next(s.sizes for s in SCRIPTS if s.release == "v0.11.0" and s.name == "train_dapo_ray_hybrid_engine.sh")
    script = Script("v0.9.10", "train_dapo_ray_hybrid_engine.sh", "ppo", dapo_sizes)
    original = parse_script(DATA_DIR / script.release / script.name)
    assert "vllm_enable_is_correction" in original.flags
    command = edit_command(original, script_edits(script, original, tmp_path, ""), script.release)
    result = subprocess.run(command.argv(), cwd=tmp_path, env=rlhf_env, capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, check=False)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "rlhf: error: unrecognized arguments: --vllm_enable_is_correction" in result.stderr, result.stderr
    assert TRACEBACK not in result.stderr


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

    def wait_until_ready(self, env: dict[str, str]) -> None:
        while subprocess.run([str(VENV_BIN / "ray"), "job", "list", f"--address={self.dashboard}"], env=env,
                             capture_output=True, text=True, check=False).returncode != 0:
            assert self.process.alive(), f"the Ray head's job server did not start:\n{self.process.log_tail()}"
            time.sleep(1)

    def unpacked_working_dirs(self) -> list[Path]:
        """Folders into which Ray unpacked jobs' working_dirs (beside them: the .zip packages and their locks)."""
        return list({path.resolve() for path in self.temp_dir.glob("session_*/runtime_resources/working_dir_files/*")
                     if path.is_dir()})  # resolved: session_latest links to the session

    def stop(self) -> None:
        self.process.stop(grace=3)  # SIGKILL follows: after SIGTERM, gcs_server and raylet stay alive
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def hub_env(rlhf_env, tmp_path_factory) -> dict[str, str]:
    """`rlhf_env` pointed at a Hugging Face cache holding every name the scripts give, offline; built once."""
    home = tmp_path_factory.mktemp("hf-home")
    build_openrlhf_hub(home, num_rows=128)
    env = {key: value for key, value in rlhf_env.items()
           if key not in ("RAY_ADDRESS", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE",
                          "TRANSFORMERS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    return {**env, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}


@pytest.fixture(scope="module")
def ray_head(hub_env):
    """One Ray cluster with a job server for the `ray job submit` scripts, which the other scripts' drivers join
    (RAY_ADDRESS). Its environment is what a job's driver and the ranks get: the offline Hugging Face cache,
    WANDB_MODE=offline for --use_wandb; RAY_AUTH_MODE=disabled for a loopback test cluster."""
    env = {**hub_env, "RAY_AUTH_MODE": "disabled",
           # as `source .venv/bin/activate && ray start --head`: a job's `rlhf` is the cluster's, as in the seed
           "PATH": os.pathsep.join([str(VENV_BIN), hub_env.get("PATH", "")])}
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


def check_output(script: Script, command: Command, output: str) -> None:
    assert TRACEBACK not in output, f"a traceback in the output of {script.id}:\n{output[-6000:]}"
    notes = expected_notes(script.stage, command)
    assert script.stage != "ppo" or notes, "the PPO scripts have mapped flags (e.g. --colocate_*)"
    for note in notes:
        assert output.count(note) == 1, f"expected once: {note!r}\n{output[-4000:]}"
    for flag, warning, expected in HARDWARE_WARNINGS:
        if script.spelled(flag) in command.flags:
            assert (warning in output) == expected, (f"{'missing' if expected else 'unexpected'} warning "
                                                     f"{warning!r}\n{output[-4000:]}")


def check_outputs(script: Script, original: Command, save_path: Path, stage_ckpt: Path) -> None:
    """The final model in --save_path, and a committed (manifest-verified) checkpoint of the stage whose metadata
    names the models and datasets as the script wrote them, the models resolved from the cache's snapshot."""
    assert (save_path / "config.json").is_file(), sorted(p.name for p in save_path.glob("*"))
    assert any((save_path / name).is_file() for name in ("model.safetensors", "adapter_model.safetensors")), \
        sorted(p.name for p in save_path.glob("*"))
    store = CheckpointStore(str(stage_ckpt))
    committed = [info.step for info in store.list(verify=True) if info.is_committed]
    assert committed, f"no committed checkpoint in {stage_ckpt}"
    metadata = store.read_metadata(max(committed))
    for flag in HUB_FLAGS:
        if script.spelled(flag) in original.flags:
            name = original.value(script.spelled(flag))[0]
            assert metadata["config"][flag] == name, (flag, metadata["config"][flag])
            if flag in metadata.get("input_models", {}):
                assert metadata["input_models"][flag] == f"hub:{name}@{HUB_REVISION}", metadata["input_models"]
    chat = script.spelled("apply_chat_template") in original.flags
    assert metadata["config"]["apply_chat_template"] is chat
    if script.stage == "dpo" and script.spelled("ref_pretrain") not in original.flags:
        # the scripts set no reference model: OpenRLHF's default is the policy's start, --pretrain as written
        assert metadata["config"]["ref_pretrain"] == metadata["config"]["pretrain"], metadata["config"]
        assert metadata["input_models"]["ref_pretrain"] == metadata["input_models"]["pretrain"], \
            metadata["input_models"]


def run_script(script: Script, root: Path, hub_env: dict[str, str], request
               ) -> tuple[Command, Command, subprocess.CompletedProcess, Path]:
    """Run one edited script; returns the script's command, the edited one, its result and the stage's
    checkpoint folder."""
    root = Path(tempfile.mkdtemp(prefix="run-", dir=root))  # a folder of its own for each attempt (a rerun too)
    workdir = root / script.id
    workdir.mkdir()
    original = parse_script(DATA_DIR / script.release / script.name)
    ray_job = original.launcher[:3] == ("ray", "job", "submit")
    openrlhf_working_dir(root / f"openrlhf-{script.id}", script)
    head, head_env = request.getfixturevalue("ray_head")
    if ray_job:
        env, before = head_env, set(head.unpacked_working_dirs())
        edits = script_edits(script, original, root, head.dashboard)
    else:  # the driver joins the module's head (RAY_ADDRESS, as a shell on a cluster has it), not a local Ray
        env, edits = {**hub_env, "RAY_ADDRESS": head.address}, script_edits(script, original, root, "")
    command = edit_command(original, edits, script.release)
    started = time.monotonic()
    result = subprocess.run(command.argv(), cwd=workdir, env=env, capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, check=False)
    wall_s = time.monotonic() - started
    stage_s = re.search(rf"{script.stage}: output in \S+ \(([\d.]+) s\)", result.stdout + result.stderr)
    print(f"\n{script.release} {script.name}: exit {result.returncode}, wall time {wall_s:.1f} s "
          f"(the stage itself: {stage_s.group(1) + ' s' if stage_s else 'not reported'})")
    if "ckpt_path" in edits.values:
        ckpt_root = Path(edits.values["ckpt_path"][0])
    elif ray_job:  # the job ran in Ray's unpacked copy of the working_dir: OpenRLHF's relative paths go there
        unpacked = [path for path in set(head.unpacked_working_dirs()) - before if (path / "ckpt").is_dir()]
        assert result.returncode != 0 or len(unpacked) == 1, \
            f"expected one unpacked working_dir holding ckpt/, found {unpacked}"
        ckpt_root = unpacked[0] / "ckpt" if unpacked else workdir / "ckpt"
    else:
        ckpt_root = workdir / "ckpt"
    return original, command, result, ckpt_root / "rlhf" / script.stage


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda script: script.id)
def test_openrlhf_example_script_runs(script, hub_env, runs_root, request):
    original, command, result, stage_ckpt = run_script(script, runs_root, hub_env, request)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command.argv())}\nexited {result.returncode}:\n{output[-8000:]}"
    check_output(script, command, output)
    check_outputs(script, original, Path(command.value(script.spelled("save_path"))[0]), stage_ckpt)
    if script.spelled("use_wandb") in command.flags:
        assert "W&B syncing is set to `offline`" in output, "--use_wandb did not start an (offline) wandb run"
