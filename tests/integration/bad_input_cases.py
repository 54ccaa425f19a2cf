"""The malformed inputs of tests/integration/test_bad_input.py, one builder each.

Each builder takes a `Workspace` (a test's folder, the toy assets and a copy of a committed run) and returns
a `Bad`: the `rlhf` arguments, the names the error line must contain, and how to run it (in-process by default;
`subprocess=True` where the environment matters or to prove no traceback reaches a real terminal;
`unprivileged=True` to run without root's power to write into read-only folders).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

RUN_NAME = "ref"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Bad:
    argv: list[str]
    names: list[str]  # each must appear in the one `rlhf: error:` line
    env: dict[str, str] = field(default_factory=dict)  # extra environment (in-process: monkeypatched)
    subprocess: bool = False
    unprivileged: bool = False


def sft_args(toy: dict[str, str], ckpt: str, save_path: str) -> dict[str, str | None]:
    """The committed reference run's SFT flags (tiny: 16 samples, 2 steps of one chunk each)."""
    return {"--pretrain": toy["model"], "--dataset": toy["sft"], "--input_key": "prompt", "--output_key": "response",
            "--max_len": "64", "--train_batch_size": "8", "--micro_train_batch_size": "4", "--max_epochs": "1",
            "--max_samples": "16", "--save_steps": "1", "--learning_rate": "1e-3", "--ckpt_path": ckpt,
            "--run_name": RUN_NAME, "--save_path": save_path}


@dataclass
class Workspace:
    tmp: Path
    toy: dict[str, str]
    ckpt: Path  # a copy of the committed run's --ckpt_path (holds {RUN_NAME}/sft/step_1, step_2)
    sft_model: str  # the committed run's exported SFT model

    def path(self, name: str) -> str:
        return str(self.tmp / name)

    def write(self, name: str, content: str | bytes) -> str:
        target = self.tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(target)

    def jsonl(self, name: str, *rows) -> str:
        return self.write(name, "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))

    def model_copy(self, name: str = "model") -> Path:
        target = self.tmp / name
        shutil.copytree(self.toy["model"], target)
        return target

    def _command(self, command: list[str], base: dict[str, str | None], overrides: dict, extra: tuple) -> list[str]:
        flags = {**base, **{f"--{key}": value for key, value in overrides.items()}}
        argv = list(command)
        for flag, value in flags.items():
            if value is not None:
                argv += [flag, str(value)]
        return argv + ["--load_checkpoint", "--allow_config_change", *extra]

    def sft(self, *extra: str, **overrides) -> list[str]:
        """The reference run resumed (--load_checkpoint) with `overrides`; --allow_config_change lets the bad
        input itself, not the settings drift it causes, be what is refused."""
        return self._command(["train", "sft"], sft_args(self.toy, str(self.ckpt), self.path("out/sft")),
                             overrides, extra)

    def rm(self, *extra: str, **overrides) -> list[str]:
        base = {"--pretrain": self.toy["model"], "--dataset": self.toy["prefs"], "--prompt_key": "prompt",
                "--chosen_key": "chosen", "--rejected_key": "rejected", "--max_len": "64", "--train_batch_size": "8",
                "--micro_train_batch_size": "4", "--max_samples": "16", "--save_steps": "1",
                "--ckpt_path": str(self.ckpt), "--run_name": RUN_NAME, "--save_path": self.path("out/rm")}
        return self._command(["train", "rm"], base, overrides, extra)

    def ppo(self, *extra: str, **overrides) -> list[str]:
        return self._command(["train", "ppo"], ppo_args(self.toy, str(self.ckpt), self.path("out/ppo")),
                             overrides, extra)

    def ppo_file_reward(self, body: str, **overrides) -> list[str]:
        return self.ppo(reward_fn=None, remote_rm_url=self.write("reward_func.py", body), **overrides)


def ppo_args(toy: dict[str, str], ckpt: str, save_path: str) -> dict[str, str | None]:
    """A tiny critic-free PPO stage: 8 prompts, 4 per step, 2 samples each, 8 new tokens."""
    return {"--pretrain": toy["model"], "--reward_fn": "rlhf_core.toy:gold_reward", "--prompt_data": toy["prompts"],
            "--input_key": "prompt", "--advantage_estimator": "reinforce", "--n_samples_per_prompt": "2",
            "--rollout_batch_size": "4", "--micro_rollout_batch_size": "4", "--train_batch_size": "8",
            "--micro_train_batch_size": "4", "--max_samples": "8", "--max_new_tokens": "8",
            "--prompt_max_len": "32", "--save_steps": "1", "--ckpt_path": ckpt, "--run_name": RUN_NAME,
            "--save_path": save_path}


GOOD = {"prompt": "sort : 2 1 =", "response": "1 2"}
CASES: dict[str, Callable[[Workspace], Bad]] = {}


def case(builder: Callable[[Workspace], Bad]) -> Callable[[Workspace], Bad]:
    CASES[builder.__name__] = builder
    return builder


# ----------------------------------------------------------------------------------------------- data files

@case
def data_missing_file(w):
    return Bad(w.sft(dataset=w.path("nope.jsonl")), ["nope.jsonl"])


@case
def data_invalid_json_line(w):
    return Bad(w.sft(dataset=w.jsonl("bad.jsonl", GOOD, GOOD, '{"prompt": "a", ')), ["bad.jsonl line 3"])


@case
def data_line_not_an_object(w):
    return Bad(w.sft(dataset=w.jsonl("list.jsonl", GOOD, "[1, 2]")), ["list.jsonl line 2"])


@case
def data_json_array_item_not_an_object(w):
    return Bad(w.sft(dataset=w.write("items.json", json.dumps([GOOD, GOOD, 5]))), ["items.json item 3"])


@case
def data_json_array_item_missing_key(w):
    rows = [GOOD, {"prompt": "sort : 3 1 ="}]
    return Bad(w.sft(dataset=w.write("items.json", json.dumps(rows, indent=1))),
               ["items.json item 2", "'response'", "--output_key"])


@case
def data_json_array_syntax_error(w):
    return Bad(w.sft(dataset=w.write("items.json", '[\n{"prompt": "a", "response": "b"},\n{"prompt": }\n]')),
               ["items.json line 3"])


@case
def data_json_top_level_not_a_list(w):
    return Bad(w.sft(dataset=w.write("object.json", '{"rows": []}')), ["object.json"])


@case
def data_not_utf8(w):
    return Bad(w.sft(dataset=w.write("latin1.jsonl", json.dumps(GOOD).encode() + b'\n{"prompt": "caf\xe9", '
                                     b'"response": "x"}\n')), ["latin1.jsonl line 2", "UTF-8"])


@case
def data_missing_key(w):
    return Bad(w.sft(dataset=w.jsonl("nokey.jsonl", GOOD, {"prompt": "sort : 1 ="})),
               ["nokey.jsonl line 2", "'response'", "--output_key"])


@case
def data_wrong_input_key(w):
    return Bad(w.sft(input_key="question"), [w.toy["sft"] + " line 1", "'question'", "--input_key"])


@case
def data_wrong_type(w):
    return Bad(w.sft(dataset=w.jsonl("types.jsonl", GOOD, {"prompt": "sort : 1 =", "response": 1})),
               ["types.jsonl line 2", "'response'", "int"])


@case
def data_empty_file(w):
    return Bad(w.sft(dataset=w.write("empty.jsonl", "")), ["empty.jsonl", "empty"])


@case
def data_blank_lines_only(w):
    return Bad(w.sft(dataset=w.write("blank.jsonl", "\n  \n\n")), ["blank.jsonl", "empty"])


@case
def data_truncated_away_by_max_len(w):
    long_prompt = {"prompt": "sort : " + "9 " * 12 + "=", "response": "9 " * 12}
    return Bad(w.sft(dataset=w.jsonl("long.jsonl", *[long_prompt] * 16), max_len="8"),  # 8: the least allowed
               ["long.jsonl", "--max_len 8"])


@case
def data_bad_parquet(w):
    return Bad(w.sft(dataset=w.write("broken.parquet", b"PAR1 this is not parquet")), ["broken.parquet"])


@case
def data_parquet_missing_key(w):
    import pyarrow
    import pyarrow.parquet

    path = w.path("rows.parquet")
    pyarrow.parquet.write_table(pyarrow.table({"prompt": ["sort : 2 1 ="], "answer": ["1 2"]}), path)
    return Bad(w.sft(dataset=path), ["rows.parquet row 1", "'response'", "--output_key"])


@case
def data_empty_folder(w):
    (w.tmp / "empty_dir").mkdir()
    return Bad(w.sft(dataset=w.path("empty_dir")), ["--dataset", "empty_dir"])


@case
def data_probs_do_not_match_sources(w):
    return Bad(w.sft(dataset=f"{w.toy['sft']},{w.toy['sft']}", dataset_probs="0.5,0.3,0.2"), ["--dataset_probs"])


@case
def data_input_template_not_a_format(w):  # one without '{}' is not used, with a warning, as OpenRLHF
    return Bad(w.sft(input_template="User: {} {name} Assistant:"), ["--input_template"])


@case
def data_eval_dataset_missing(w):
    return Bad(w.sft(eval_dataset=w.path("eval_nope.jsonl")), ["eval_nope.jsonl"])


@case
def data_rm_missing_chosen_key(w):
    return Bad(w.rm(dataset=w.jsonl("prefs.jsonl", {"prompt": "a", "better": "b", "rejected": "c"})),
               ["prefs.jsonl line 1", "'chosen'", "--chosen_key"])


@case
def data_sft_conversation_with_an_unknown_role(w):
    conversation = [{"role": "user", "content": "sort : 2 1 ="}, {"role": "bot", "content": "1 2"}]
    return Bad(w.sft("--apply_chat_template", dataset=w.jsonl("chat.jsonl", {"messages": conversation}),
                     input_key="messages", output_key=None),
               ["chat.jsonl line 1", "'messages' message 2", "role 'bot'"])


@case
def data_ppo_prompt_message_with_empty_content(w):
    messages = [{"role": "system", "content": "You sort."}, {"role": "user", "content": " "}]
    return Bad(w.ppo("--apply_chat_template", prompt_data=w.jsonl("prompts.jsonl", {"prompt": messages})),
               ["prompts.jsonl line 1", "'prompt' message 2", "empty content"])


@case
def data_ppo_prompts_missing_key(w):
    return Bad(w.ppo(prompt_data=w.jsonl("prompts.jsonl", {"question": "sort : 2 1 ="})),
               ["prompts.jsonl line 1", "'prompt'", "--input_key"])


@case
def data_ppo_fewer_prompts_than_a_step(w):
    return Bad(w.ppo(prompt_data=w.jsonl("two.jsonl", {"prompt": "a"}, {"prompt": "b"})),
               ["--rollout_batch_size 4", "two.jsonl"])


def _family_chat_sft(w, family: str, bad_row: list[dict], refusal: str) -> Bad:
    """SFT of `family`'s tiny model, by its hub id from an offline HF cache in the workspace, on chat rows whose
    second the family's own chat template refuses, saying `refusal` (a subprocess: HF_HOME is read when
    huggingface_hub loads)."""
    from tests.families import build_family

    repo_id = build_family(w.tmp / "hf_home", family)
    good = [{"role": "user", "content": GOOD["prompt"]}, {"role": "assistant", "content": GOOD["response"]}]
    return Bad(w.sft("--apply_chat_template", pretrain=repo_id, input_key="messages", output_key=None,
                     dataset=w.jsonl("chat.jsonl", {"messages": good}, {"messages": bad_row}, {"messages": good})),
               ["chat.jsonl line 2", "'messages'", refusal],
               env={"HF_HOME": w.path("hf_home"), "HF_HUB_OFFLINE": "1"}, subprocess=True)


@case
def data_chat_template_refuses_a_system_message(w):
    """Gemma's template raises "System role not supported"."""
    return _family_chat_sft(w, "gemma", [{"role": "system", "content": "You sort digits."},
                                         {"role": "user", "content": "sort : 2 1 ="},
                                         {"role": "assistant", "content": "1 2"}], "System role not supported")


@case
def data_chat_template_refuses_roles_that_do_not_alternate(w):
    """Mistral's template raises "... conversation roles must alternate user/assistant/user/assistant/..."."""
    return _family_chat_sft(w, "mistral", [{"role": "user", "content": "sort : 2 1 ="},
                                           {"role": "user", "content": "sort : 3 1 ="},
                                           {"role": "assistant", "content": "1 2"}],
                            "conversation roles must alternate user/assistant")


# ---------------------------------------------------------------------------------------------------- models

@case
def model_missing_folder(w):
    return Bad(w.sft(pretrain=w.path("no_model")), ["--pretrain", "no_model"])


@case
def model_empty_folder(w):
    (w.tmp / "empty_model").mkdir()
    return Bad(w.sft(pretrain=w.path("empty_model")), ["--pretrain", "empty_model", "config.json"])


@case
def model_is_a_file(w):
    return Bad(w.sft(pretrain=w.write("model.bin", b"weights")), ["--pretrain", "model.bin"])


@case
def model_without_tokenizer(w):
    model = w.model_copy()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    return Bad(w.sft(pretrain=str(model)), ["--pretrain", str(model), "tokenizer"])


@case
def model_corrupt_config(w):
    model = w.model_copy()
    (model / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": \n}')
    return Bad(w.sft(pretrain=str(model)), ["--pretrain", "config.json", "line 4"])


@case
def model_unknown_architecture(w):
    model = w.model_copy()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "llamaX"}))
    return Bad(w.sft(pretrain=str(model)), ["--pretrain", "config.json", "'llamaX'"])


@case
def model_truncated_safetensors(w):
    model = w.model_copy()
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return Bad(w.sft(pretrain=str(model)), ["--pretrain", str(weights)])


@case
def model_missing_shard(w):
    model = w.model_copy()
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    return Bad(w.sft(pretrain=str(model)), ["--pretrain", "model-00002-of-00002.safetensors"])


@case
def model_hub_id_not_cached_offline(w):
    return Bad(w.sft(pretrain="nobody-here/no-such-model"), ["--pretrain", "nobody-here/no-such-model",
                                                              "HF_HUB_OFFLINE=1"],
               env={"HF_HUB_OFFLINE": "1", "HF_HOME": w.path("hf_home")}, subprocess=True)


@case
def model_adapter_config_corrupt(w):
    adapter = Path(_adapter(w))
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": ')
    return Bad(w.sft(pretrain=str(adapter)), ["--pretrain", str(adapter / "adapter_config.json"), "line 1"])


@case
def model_adapter_base_missing(w):
    adapter = Path(_adapter(w))
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": w.path("gone")}))
    return Bad(w.sft(pretrain=str(adapter)), ["--pretrain", "base_model_name_or_path", w.path("gone")])


@case
def model_adapter_without_weights(w):
    adapter = w.tmp / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": w.toy["model"],
                                                             "peft_type": "LORA"}))
    return Bad(w.sft(pretrain=str(adapter)), ["--pretrain", "adapter", "weights"])


@case
def model_reward_pretrain_missing(w):
    return Bad(w.ppo(reward_fn=None, reward_pretrain=w.path("no_rm")), ["--reward_pretrain", "no_rm"])


@case
def model_critic_pretrain_empty(w):
    (w.tmp / "empty_critic").mkdir()
    return Bad(w.ppo(advantage_estimator="gae", critic_pretrain=w.path("empty_critic")),
               ["--critic_pretrain", "empty_critic"])


# ----------------------------------------------------------------------------------------------------- flags

@case
def flag_unknown(w):
    return Bad(w.sft("--no_such_flag"), ["--no_such_flag"], subprocess=True)


@case
def flag_wrong_type(w):
    return Bad(w.sft(max_len="sixty"), ["--max_len", "'sixty'"])


@case
def flag_bad_choice(w):
    return Bad(w.sft(lr_scheduler="warp"), ["--lr_scheduler", "'warp'"])


@case
def flag_out_of_range(w):
    return Bad(w.sft(learning_rate="-1"), ["--learning_rate"])


@case
def flag_refused_load_in_4bit(w):
    return Bad(w.sft("--load_in_4bit"), ["--load_in_4bit"])


@case
def flag_refused_ring_attn_size(w):
    return Bad(w.sft("--ring_attn_size", "2"), ["--ring_attn_size"])


@case
def flag_zero_stage_5(w):
    return Bad(w.sft(zero_stage="5"), ["--zero_stage", "5"])


@case
def flag_inconsistent_batch_sizes(w):
    return Bad(w.sft(micro_train_batch_size="3"), ["--train_batch_size", "--micro_train_batch_size"])


@case
def flag_ppo_rollout_not_a_multiple_of_train_batch(w):
    return Bad(w.ppo(rollout_batch_size="3"), ["--rollout_batch_size", "--train_batch_size"])


@case
def flag_fp16_on_cpu(w):
    return Bad(w.sft(param_dtype="fp16"), ["--param_dtype fp16"])


@case
def flag_unknown_attention(w):
    return Bad(w.sft(attn_implementation="warp_drive"), ["--attn_implementation", "'warp_drive'"])


@case
def flag_storage_options_not_json(w):
    return Bad(w.sft(storage_options="{endpoint"), ["--storage_options"])


@case
def flag_reward_fn_and_remote_rm_url(w):
    return Bad(w.ppo(remote_rm_url=w.path("r.py")), ["--reward_fn", "--remote_rm_url"])


@case
def flag_grpo_with_one_sample(w):
    return Bad(w.ppo(advantage_estimator="group_norm", n_samples_per_prompt="1", rollout_batch_size="8"),
               ["--n_samples_per_prompt", "group_norm"])


# ----------------------------------------------------------------------------------------------------- paths

@case
def path_ckpt_is_a_file(w):
    return Bad(w.sft(ckpt_path=w.write("ckpt_file", "x")), ["--ckpt_path", "ckpt_file"])


@case
def path_ckpt_under_proc(w):
    return Bad(w.sft(ckpt_path="/proc/rlhf-ckpt"), ["--ckpt_path", "/proc/rlhf-ckpt"])


@case
def path_ckpt_read_only(w):
    read_only = w.tmp / "ro_ckpt"
    read_only.mkdir()
    read_only.chmod(0o555)
    return Bad(w.sft(ckpt_path=str(read_only)), ["--ckpt_path", "ro_ckpt"], subprocess=True, unprivileged=True)


@case
def path_save_is_a_file(w):
    return Bad(w.sft(save_path=w.write("save_file", "x")), ["--save_path", "save_file"])


@case
def path_save_under_proc(w):
    return Bad(w.sft(save_path="/proc/rlhf-out"), ["--save_path", "/proc/rlhf-out"])


@case
def path_save_read_only(w):
    read_only = w.tmp / "ro_out"
    read_only.mkdir()
    read_only.chmod(0o555)
    return Bad(w.sft(save_path=str(read_only / "model")), ["--save_path", "ro_out"], subprocess=True,
               unprivileged=True)


# --------------------------------------------------------------------------------------------- object stores

UNREACHABLE_ENDPOINT = f"http://127.0.0.1:{closed_port()}"  # one per session: fsspec caches its S3 clients


def _unreachable_store(w) -> tuple[str, dict[str, str]]:
    """An S3 endpoint on a closed loopback port, one attempt per request: as --storage_options, and as the
    standard environment (credentials, endpoint), which also reaches --dataset and --save_path."""
    endpoint = UNREACHABLE_ENDPOINT
    options = json.dumps({"endpoint_url": endpoint, "config_kwargs": {"retries": {"max_attempts": 1}}})
    return options, {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                     "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint, "AWS_MAX_ATTEMPTS": "1"}


@case
def store_ckpt_unreachable(w):
    options, env = _unreachable_store(w)
    return Bad(w.sft(ckpt_path="s3://bucket/ckpt", storage_options=options),
               ["--ckpt_path", "s3://bucket/ckpt", env["AWS_ENDPOINT_URL"]], env=env, subprocess=True)


@case
def store_dataset_unreachable(w):
    _, env = _unreachable_store(w)
    return Bad(w.sft(dataset="s3://bucket/sft.jsonl"), ["--dataset", "s3://bucket/sft.jsonl", env["AWS_ENDPOINT_URL"]],
               env=env)


@case
def store_save_path_unreachable(w):
    _, env = _unreachable_store(w)
    return Bad(w.sft(save_path="s3://bucket/out"), ["--save_path", "s3://bucket/out", env["AWS_ENDPOINT_URL"]],
               env=env)


@case
def store_pretrain_unreachable(w):
    _, env = _unreachable_store(w)
    return Bad(w.sft(pretrain="s3://bucket/model"), ["--pretrain", "s3://bucket/model", env["AWS_ENDPOINT_URL"]],
               env=env)


# ------------------------------------------------------------------------------------------ reward functions

@case
def reward_file_missing(w):
    return Bad(w.ppo(reward_fn=None, remote_rm_url=w.path("no_reward.py")), ["--remote_rm_url", "no_reward.py"])


@case
def reward_file_without_reward_func(w):
    return Bad(w.ppo_file_reward("def score(q, p, l):\n    return [0.0] * len(q)\n"),
               ["--remote_rm_url", "reward_func.py", "reward_func"])


@case
def reward_file_syntax_error(w):
    return Bad(w.ppo_file_reward("def reward_func(q, p, l)\n    return q\n"), ["--remote_rm_url", "reward_func.py"])


@case
def reward_file_raises(w):
    return Bad(w.ppo_file_reward("def reward_func(q, p, l):\n    raise KeyError('answer')\n"),
               ["--remote_rm_url", "reward_func.py", "KeyError"])


@case
def reward_file_returns_nan(w):
    return Bad(w.ppo_file_reward("def reward_func(q, p, l):\n    return [float('nan')] * len(q)\n"),
               ["--remote_rm_url", "reward_func.py", "nan"])


@case
def reward_file_returns_wrong_length(w):
    return Bad(w.ppo_file_reward("def reward_func(q, p, l):\n    return [0.0] * (len(q) + 1)\n"),
               ["--remote_rm_url", "reward_func.py", "2 rewards for 1 samples"])


@case
def reward_server_down(w):
    url = f"http://127.0.0.1:{closed_port()}/get_reward"
    return Bad(w.ppo(reward_fn=None, remote_rm_url=url), [url])


@case
def reward_fn_module_missing(w):
    return Bad(w.ppo(reward_fn="no_such_package.rewards:score"), ["--reward_fn", "no_such_package.rewards:score"])


@case
def reward_fn_attribute_missing(w):
    return Bad(w.ppo(reward_fn="rlhf_core.toy:no_such_reward"), ["--reward_fn", "rlhf_core.toy:no_such_reward"])


@case
def reward_fn_not_callable(w):
    return Bad(w.ppo(reward_fn="rlhf_core.rewards:HTTP_ATTEMPTS"), ["--reward_fn", "HTTP_ATTEMPTS"])


@case
def reward_fn_malformed_spec(w):
    return Bad(w.ppo(reward_fn="rlhf_core/toy.py"), ["--reward_fn", "rlhf_core/toy.py"])


# -------------------------------------------------------------------------------------------- YAML run configs

def _yaml_run(w, sft_yaml: str) -> str:
    return w.write("run.yaml", f"run_name: {RUN_NAME}\nckpt_path: {w.ckpt}\nload_checkpoint: true\n"
                               f"stages: [sft]\nsft:\n{sft_yaml}")


@case
def yaml_not_yaml(w):
    return Bad(["run", w.write("run.yaml", "run_name: exp\nsft:\n  pretrain: [unclosed\n  dataset: x\n")],
               ["run.yaml line"])


@case
def yaml_not_a_mapping(w):
    return Bad(["run", w.write("run.yaml", "- sft\n- rm\n")], ["run.yaml", "mapping"])


@case
def yaml_unknown_key(w):
    return Bad(["run", _yaml_run(w, f"  pretrain: {w.toy['model']}\n  dataset: {w.toy['sft']}\n  learnig_rate: 1\n")],
               ["run.yaml", "line 8", "sft.learnig_rate"])


@case
def yaml_missing_field(w):
    return Bad(["run", _yaml_run(w, f"  pretrain: {w.toy['model']}\n  input_key: prompt\n")],
               ["run.yaml", "sft.dataset"])


@case
def yaml_wrong_type(w):
    return Bad(["run", _yaml_run(w, f"  pretrain: {w.toy['model']}\n  dataset: {w.toy['sft']}\n  max_len: long\n")],
               ["run.yaml", "line 8", "sft.max_len"])


@case
def yaml_missing_file(w):
    return Bad(["run", w.path("missing.yaml")], ["missing.yaml"], subprocess=True)


@case
def yaml_bad_dataset(w):
    return Bad(["run", _yaml_run(w, f"  pretrain: {w.toy['model']}\n  dataset: {w.path('gone.jsonl')}\n")],
               ["gone.jsonl"])


# ------------------------------------------------------------------------------------------------ subcommands

@case
def ckpt_ls_mistyped_path(w):
    mistyped = str(w.ckpt / RUN_NAME / "sfft")
    return Bad(["ckpt", "ls", mistyped], [mistyped], subprocess=True)


@case
def ckpt_verify_missing_path(w):
    missing = str(w.ckpt / "other_run" / "sft")
    return Bad(["ckpt", "verify", missing], [missing])


@case
def ckpt_ls_a_file(w):
    a_file = str(w.ckpt / RUN_NAME / "sft" / "latest")
    return Bad(["ckpt", "ls", a_file], [a_file])


@case
def lora_combiner_missing_lora_path(w):
    return Bad(["lora-combiner", "--model_path", w.toy["model"], "--lora_path", w.path("no_adapter"),
                "--output_path", w.path("merged")], ["--lora_path", "no_adapter"])


@case
def lora_combiner_lora_path_is_a_full_model(w):
    return Bad(["lora-combiner", "--model_path", w.toy["model"], "--lora_path", w.sft_model,
                "--output_path", w.path("merged")], ["--lora_path", w.sft_model])


@case
def lora_combiner_lora_path_checkpoint_without_steps(w):
    latest = str(w.ckpt / RUN_NAME / "ppo" / "latest")
    return Bad(["lora-combiner", "--model_path", w.toy["model"], "--lora_path", latest,
                "--output_path", w.path("merged")], ["--lora_path", latest])


@case
def lora_combiner_missing_model_path(w):
    return Bad(["lora-combiner", "--model_path", w.path("no_base"), "--lora_path", _adapter(w),
                "--output_path", w.path("merged")], ["--model_path", "no_base"])


@case
def lora_combiner_output_is_a_file(w):
    return Bad(["lora-combiner", "--model_path", w.toy["model"], "--lora_path", _adapter(w),
                "--output_path", w.write("merged_file", "x")], ["--output_path", "merged_file"])


def _adapter(w) -> str:
    """A real LoRA adapter of the toy model (peft), saved into the workspace."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(w.toy["model"])
    model = get_peft_model(base, LoraConfig(r=2, target_modules="all-linear"))
    model.save_pretrained(w.path("adapter"))
    return w.path("adapter")


@case
def toy_init_into_a_file(w):
    return Bad(["toy", "init", w.write("toy_file", "x")], ["toy_file"])


# --------------------------------------------------------------------------------------------- existing runs

@case
def run_exists_without_load_checkpoint(w):
    argv = [arg for arg in w.sft() if arg not in ("--load_checkpoint", "--allow_config_change")]
    return Bad(argv, [str(w.ckpt / RUN_NAME / "sft"), "--load_checkpoint"])


@case
def run_resume_from_missing_step(w):
    return Bad(w.sft(resume_from="7"), ["--resume_from 7"])


@case
def run_settings_drift(w):
    argv = [arg for arg in w.sft(learning_rate="2e-3") if arg != "--allow_config_change"]
    return Bad(argv, ["learning_rate", "--allow_config_change"])


@case
def run_lease_held_by_a_live_run(w):
    lease = {"id": "other", "host": socket.gethostname(), "pid": os.getppid(), "started": time.time(),
             "heartbeat": time.time()}
    (w.ckpt / RUN_NAME / "LEASE.json").write_text(json.dumps(lease))
    return Bad(w.sft(), ["LEASE.json", f"pid {os.getppid()}"])
