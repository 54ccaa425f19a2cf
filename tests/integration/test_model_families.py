"""Every model family of tests.families through the whole pipeline, as a user runs it: `rlhf run run.yaml`
with SFT -> RM -> PPO (LoRA, gae, the RM as reward model and critic) -> merge -> export, `--pretrain` a hub id
resolved from a local HF cache (HF_HUB_OFFLINE=1), the data the toy task as chat message lists rendered with
`--apply_chat_template` (GPT-2, which has no chat template, gets the same rows as strings).

Each run is SIGKILLed inside the second chunk of one stage (step 3 paused while step 2 commits) and the same
command again finishes the pipeline: what was committed comes from Prefect's cache, the killed stage resumes
from step 2. Its weights must equal, bit for bit, those of the same stage never interrupted (trained by a
process of its own from the same inputs, beside the resumed command). The killed stage is full-parameter SFT for the
families with tied embeddings and Mistral, and PPO with LoRA (adapter and critic) for the two whose LoRA
targets have no Llama names: GPT-2 (Conv1D) and Phi-3 (fused qkv_proj, gate_up_proj).

To stay within the CI budget, all families share one HF cache, one Prefect server and one Ray head started for
this module (their start-up would otherwise be paid by every command), models have 2 layers and hidden size 64,
and each stage trains a few steps. `pytest -s` prints each family's wall times.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from rlhf_core.toy import init_toy
from tests.conftest import HUB_REVISION, RLHF
from tests.families import FAMILIES, build_family
from tests.hub_cache import chat_data
from tests.integration.conftest import PAUSE_IS_NO_HANG_S, kill_once_committed
from tests.integration.conftest import ray_head as start_ray_head

pytestmark = pytest.mark.slow

PROJECT_DIR = Path(__file__).resolve().parents[2]
PAUSED_STEP, STEPS = 3, 4  # the killed stage commits steps 2 and 4; the others train 2 steps, so step 3 is its
KILLED_STAGE = {"qwen2": "sft", "qwen3": "sft", "mistral": "sft", "gemma": "sft", "phi3": "ppo", "gpt2": "ppo"}
COMPARED_MODELS = {"sft": ("actor_model",), "ppo": ("actor_model", "critic_model")}


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def ray_cluster(hub_home, tmp_path_factory):
    """A Ray head every command of this module joins, its nodes' environment pointing at the HF cache (as the
    nodes of a real cluster have their own), and every family saved in that cache."""
    with start_ray_head(offline_env(hub_home), tmp_path_factory.mktemp("ray") / "head.log") as address:
        for name in FAMILIES:
            build_family(hub_home, name)
        try:
            yield address
        finally:
            import ray

            ray.shutdown()


def offline_env(home: Path) -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith(("RLHF_FAULT", "RAY_ADDRESS"))} | {
        "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def write_data(family: str, directory: Path) -> dict[str, str]:
    """The toy task's SFT pairs, preference pairs and prompts as JSONL files: message lists for a family with a
    chat template (as OpenRLHF's hub datasets hold them), the toy's strings for one without. For a family whose
    template refuses a system message (Gemma's), each prompt's system message opens its user message instead."""
    if FAMILIES[family].tokenizer.chat_template is None:
        return init_toy(str(directory))
    data, paths = chat_data(num_rows=32), {}
    if not FAMILIES[family].system_role:
        data.prompts = [{**row, "context_messages": without_system(row["context_messages"])} for row in data.prompts]
    directory.mkdir()
    for name, rows in (("sft", data.sft), ("prefs", data.prefs), ("prompts", data.prompts)):
        paths[name] = str(directory / f"{name}.jsonl")
        Path(paths[name]).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def without_system(messages: list[dict]) -> list[dict]:
    """[system, user, ...] as [user, ...] with the system prompt and a blank line before the user's words."""
    if messages[0]["role"] != "system":
        return messages
    system, first, *rest = messages
    return [{**first, "content": f"{system['content']}\n\n{first['content']}"}, *rest]


def data_keys(family: str) -> dict[str, dict]:
    """Each stage's data flags for the files of `write_data`, as OpenRLHF's scripts give them."""
    if FAMILIES[family].tokenizer.chat_template is None:
        return {"sft": {"input_key": "prompt", "output_key": "response"}, "rm": {"prompt_key": "prompt"},
                "ppo": {"input_key": "prompt"}}
    chat = {"apply_chat_template": True}
    return {"sft": {"input_key": "messages", **chat}, "rm": chat, "ppo": {"input_key": "context_messages", **chat}}


def pipeline_config(family: str, data: dict[str, str], root: Path, ray_address: str) -> dict:
    out, keys = root / "out", data_keys(family)
    steps = {stage: STEPS if KILLED_STAGE[family] == stage else 2 for stage in ("sft", "ppo")}
    return {
        "run_name": family, "stages": ["sft", "rm", "ppo", "merge", "export"], "ckpt_path": str(root / "ckpt"),
        "load_checkpoint": True, "ray_address": ray_address,
        "sft": {"pretrain": FAMILIES[family].repo_id, "dataset": data["sft"], **keys["sft"], "max_len": 96,
                "max_samples": 8 * steps["sft"], "max_epochs": 1, "train_batch_size": 8, "micro_train_batch_size": 8,
                "learning_rate": 1e-3, "save_steps": 2, "save_path": str(out / "sft")},
        "rm": {"dataset": data["prefs"], **keys["rm"], "max_len": 96, "max_samples": 20, "train_batch_size": 8,
               "micro_train_batch_size": 8, "learning_rate": 1e-3, "save_steps": 2, "save_path": str(out / "rm")},
        "ppo": {"prompt_data": data["prompts"], **keys["ppo"], "max_samples": 4 * steps["ppo"],
                "advantage_estimator": "gae", "n_samples_per_prompt": 2, "rollout_batch_size": 4,
                "micro_rollout_batch_size": 8, "train_batch_size": 8, "micro_train_batch_size": 8,
                "max_new_tokens": 8, "learning_rate": 1e-3, "critic_learning_rate": 1e-3, "lora_rank": 4,
                "lora_alpha": 8, "save_steps": 2, "save_path": str(out / "ppo_lora")},
        "merge": {"output_path": str(out / "merged")},
        "export": {"save_path": str(out / "final")},
    }


def uninterrupted_run(config: dict, stage: str, root: Path, hub_home: Path):
    """`stage` of the pipeline alone, from the same inputs: for SFT the hub snapshot's folder (the same files the
    hub id resolves to), for PPO copies of the killed run's SFT and RM outputs (the resumed command exports them again
    while this run reads them)."""
    from rlhf_core.driver.plan import resolve_paths
    from rlhf_core.config import RunConfig
    from rlhf_core.stages.ppo import PPOConfig
    from rlhf_core.stages.sft import SFTConfig

    if stage == "sft":
        snapshot = hub_home / "hub" / f"models--{config['sft']['pretrain'].replace('/', '--')}" / "snapshots"
        stage_config = SFTConfig(**config["sft"] | {"pretrain": str(snapshot / HUB_REVISION),
                                                    "save_path": str(root / "sft")})
    else:
        sft, rm = (shutil.copytree(config[name]["save_path"], root / "inputs" / name) for name in ("sft", "rm"))
        stage_config = PPOConfig(**config["ppo"] | {"pretrain": str(sft), "reward_pretrain": str(rm),
                                                    "critic_pretrain": str(rm), "save_path": str(root / "ppo_lora")})
    return resolve_paths(RunConfig(run_name=config["run_name"], stages=[stage], ckpt_path=str(root / "ckpt"),
                                   ray_address=config["ray_address"], **{stage: stage_config}))


def start_uninterrupted(run, env: dict[str, str]) -> subprocess.Popen:
    """`run`'s one stage trained by a process of its own (tests/integration/fault_driver.py), never interrupted.
    Not in this process: a Ray connection here would be its second after any earlier module's `ray.init`, and
    Ray keeps the first cluster's auth token for it (every rank then dies before it starts)."""
    return subprocess.Popen([sys.executable, "-m", "tests.integration.fault_driver", run.model_dump_json()],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=PROJECT_DIR)


def hf_weights(model_dir: Path) -> dict:
    """The safetensors of a checkpoint's model folder (`actor_model`: the adapter alone; `critic_model`)."""
    [path] = (model_dir / "hf").glob("*.safetensors")
    return load_file(str(path))


def assert_same_weights(expected_dir: Path, actual_dir: Path, what: str) -> None:
    expected, actual = hf_weights(expected_dir), hf_weights(actual_dir)
    assert expected and expected.keys() == actual.keys(), what
    for name, tensor in expected.items():
        assert actual[name].equal(tensor), f"{what}: {name} differs from the uninterrupted run"


def check_outputs(family: str, config: dict) -> None:
    """What each stage left for the next, in the family's own layout: the RM a sequence classifier, the PPO
    adapter on every linear layer of the family (all-linear in its names, never the head), the export the
    family's model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_core.models.lora_targets import linear_layer_names

    sft_config = AutoConfig.from_pretrained(config["sft"]["save_path"])
    assert AutoConfig.from_pretrained(config["export"]["save_path"]).model_type == sft_config.model_type
    assert AutoConfig.from_pretrained(config["rm"]["save_path"]).architectures[0].endswith("ForSequenceClassification")
    adapter = json.loads((Path(config["ppo"]["save_path"]) / "adapter_config.json").read_text())
    with torch.device("meta"):
        architecture = AutoModelForCausalLM.from_config(sft_config)
    assert {name.rsplit(".", 1)[-1] for name in adapter["target_modules"]} == set(linear_layer_names(architecture))
    assert adapter["fan_in_fan_out"] == (family == "gpt2")  # GPT-2's Conv1D stores its weight transposed


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_runs_the_pipeline_from_its_hub_id_and_resumes_bit_exactly(family, hub_home, ray_cluster,
                                                                         prefect_server, tmp_path):
    config = pipeline_config(family, write_data(family, tmp_path / "data"), tmp_path / "run", ray_cluster)
    config["hang_timeout_s"] = PAUSE_IS_NO_HANG_S  # the kill pauses a rank on purpose
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**offline_env(hub_home), **{k: v for k, v in prefect_server.env.items() if k.startswith("PREFECT_")}}
    command, killed = [RLHF, "run", str(tmp_path / "run.yaml")], KILLED_STAGE[family]
    stage_dir = tmp_path / "run" / "ckpt" / family / killed

    started = time.perf_counter()
    kill_once_committed(command, env, PAUSED_STEP, tmp_path / "faults", stage_dir / "step_2" / "MANIFEST.json")
    killed_at = time.perf_counter()
    assert not (stage_dir / f"step_{STEPS}").exists() and not Path(config[killed]["save_path"]).exists()
    reference_run = uninterrupted_run(config, killed, tmp_path / "reference", hub_home)
    resumed = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    uninterrupted = start_uninterrupted(reference_run, offline_env(hub_home))  # beside the resumed command
    try:
        reference_log = uninterrupted.communicate(timeout=600)[0]
        reference_done = time.perf_counter()
        log = resumed.communicate(timeout=600)[0]
    finally:
        resumed.kill()
        uninterrupted.kill()
    finished = time.perf_counter()
    assert uninterrupted.returncode == 0, reference_log[-4000:]
    reference = Path(reference_run.stage_url(killed))
    assert resumed.returncode == 0 and "Traceback" not in log, log[-4000:]
    # Step 2 was committed before the kill: its chunk comes from Prefect's cache, or, when the kill came before
    # Prefect stored the chunk's result, from the store without training again.
    assert re.search(rf"step 2/{STEPS}: (cached|trained 0 steps)", log), log[-3000:]
    assert f"step {STEPS}/{STEPS}: trained 2 steps" in log, log[-3000:]
    check_outputs(family, config)
    for model in COMPARED_MODELS[killed]:
        assert_same_weights(reference / f"step_{STEPS}" / model, stage_dir / f"step_{STEPS}" / model,
                            f"{family} {killed} {model}")
    print(f"\n{family} ({FAMILIES[family].repo_id}): pipeline {finished - started:.1f} s (SIGKILLed in {killed} "
          f"after {killed_at - started:.1f} s, the same command again {finished - killed_at:.1f} s, the uninterrupted "
          f"{killed} beside it {reference_done - killed_at:.1f} s); {killed} resumed bit-exactly")
