"""Reward functions that replace the reward model: ours, OpenRLHF's file form, and OpenRLHF's HTTP form.

- `--reward_fn package.module:function`: `fn(prompts, responses) -> scores`, prompts as written in the
  data, responses decoded without special tokens (this project's own form).
- `--remote_rm_url path/to/reward_func.py`: OpenRLHF's `reward_func(queries, prompts, labels, **kwargs)`,
  loaded from the file. `queries` are prompt + response as one decoded text with special tokens kept
  (OpenRLHF decodes the whole sequence with skip_special_tokens=False), `prompts` the prompt as the model
  saw it (after --input_template / chat template), `labels` the `--label_key` values ("" without
  --label_key, as OpenRLHF's prompts dataset gives).
- `--remote_rm_url http://host:port/get_reward`: POSTs OpenRLHF's JSON body
  {"query": [...], "prompts": [...], "labels": [...]} and reads the JSON reply, as
  `openrlhf.cli.serve_rm` serves it; transport errors are retried (HTTP_ATTEMPTS, HTTP_TIMEOUT_S each).

Every form may return a tensor, a list, or OpenRLHF's dict {"rewards", "scores", "extra_logs"}:
rewards drive the advantages, scores (default: the rewards) drive dynamic filtering, extra_logs (a
dict of per-sample lists/tensors, or scalars) reach the step metrics. Anything malformed (wrong
length, NaN/Inf, not a number) or an exception inside the function raises a UserError of one
sentence naming the function. Departure from OpenRLHF 0.9.10: it calls the function once per sample
and logs a failure as a missing reward; here it is called once per rollout batch of a rank, and a
failure stops the chunk (a silent zero reward would train on garbage).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhf_core.errors import UserError

HTTP_ATTEMPTS = 5
HTTP_TIMEOUT_S = 180.0
HTTP_RETRY_DELAY_S = 1.0


@dataclass
class RewardBatch:
    """One reward function call's result, validated: plain floats, one per sample."""

    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardInputs:
    """What any reward function may be given, one entry per sample."""

    raw_prompts: list[str]  # the prompt field as written in the data (--reward_fn's `prompts`)
    prompts: list[str]  # the prompt as the model saw it (OpenRLHF's `prompts`)
    queries: list[str]  # prompt + response, decoded with special tokens (OpenRLHF's `queries`)
    responses: list[str]  # the response, decoded without special tokens (--reward_fn's `responses`)
    labels: list[Any]  # --label_key values


class RewardFunction:
    """A reward function of one of the three forms; `name` is what error messages call it."""

    def __init__(self, name: str, call: Callable[[RewardInputs], Any]):
        self.name, self._call = name, call

    def __call__(self, inputs: RewardInputs) -> RewardBatch:
        try:
            output = self._call(inputs)
        except UserError:
            raise
        except Exception as error:  # the user's code: any exception is theirs to fix
            raise UserError(f"{self.name} raised {type(error).__name__}: {_short(error)}.") from None
        return parse_reward_output(self.name, output, len(inputs.queries))


def _short(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip().replace("\n", " ") or "no message"
    return text if len(text) <= limit else text[:limit] + "..."


def _to_list(value: Any) -> Any:
    """A tensor or array as a (nested) Python list; anything else unchanged."""
    if hasattr(value, "tolist") and callable(value.tolist):
        return value.tolist()
    return value


def _per_sample(name: str, what: str, value: Any, num_samples: int) -> list[float]:
    values = _to_list(value)
    if isinstance(values, (int, float)) and not isinstance(values, bool) and num_samples == 1:
        values = [values]
    if not isinstance(values, (list, tuple)):
        raise UserError(f"{name} returned {what} of type {type(value).__name__}; expected a list or tensor of "
                        f"{num_samples} numbers.")
    if len(values) != num_samples:
        raise UserError(f"{name} returned {len(values)} {what} for {num_samples} samples; return one per sample.")
    return [_finite_number(name, what, index, item) for index, item in enumerate(values)]


def _finite_number(name: str, what: str, index: int, item: Any) -> float:
    item = _to_list(item)
    if isinstance(item, list) and len(item) == 1:  # a [n, 1] tensor
        item = item[0]
    if isinstance(item, bool) or not isinstance(item, (int, float)):
        raise UserError(f"{name} returned {what}[{index}] = {item!r:.60}, not a number.")
    if not math.isfinite(item):
        raise UserError(f"{name} returned {what}[{index}] = {item}; every value must be finite (no NaN or Inf).")
    return float(item)


def parse_reward_output(name: str, output: Any, num_samples: int) -> RewardBatch:
    """A tensor, list, or {"rewards", "scores", "extra_logs"} dict -> a validated RewardBatch."""
    if not isinstance(output, dict):
        rewards = _per_sample(name, "rewards", output, num_samples)
        return RewardBatch(rewards, list(rewards))
    if output.get("rewards") is None:
        raise UserError(f"{name} returned a dict without 'rewards' (keys: {', '.join(map(str, output)) or 'none'}).")
    rewards = _per_sample(name, "rewards", output["rewards"], num_samples)
    scores = rewards if output.get("scores") is None else _per_sample(name, "scores", output["scores"], num_samples)
    extra_logs = output.get("extra_logs") or {}
    if not isinstance(extra_logs, dict):
        raise UserError(f"{name} returned extra_logs of type {type(extra_logs).__name__}; expected a dict.")
    logs = {}
    for key, value in extra_logs.items():
        values = _to_list(value)
        values = values if isinstance(values, (list, tuple)) else [values]  # a scalar counts as one value
        logs[str(key)] = [_finite_number(name, f"extra_logs[{key!r}]", index, item)
                          for index, item in enumerate(values)]
    return RewardBatch(rewards, list(scores), logs)


def load_reward_fn(spec: str) -> Callable:
    """`package.module:function` -> the function (called as fn(prompts, responses) -> scores)."""
    module_name, _, function_name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except Exception as error:  # ImportError, AttributeError, or whatever the module raises at import
        raise UserError(f"--reward_fn {spec}: cannot import it ({type(error).__name__}: {_short(error)}).") from None
    if not callable(function):
        raise UserError(f"--reward_fn {spec}: {function_name} is a {type(function).__name__}, not a function.")
    return function


def load_reward_file(path: str) -> Callable:
    """`reward_func` from a Python file, as OpenRLHF loads `--remote_rm_url FILE.py`."""
    import os

    if not os.path.isfile(path):
        raise UserError(f"--remote_rm_url {path}: no such file (give a .py file defining reward_func, or an "
                        f"http(s):// URL).")
    try:
        spec = importlib.util.spec_from_file_location("rlhf_user_reward_func", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as error:  # a syntax error, a missing import, or whatever the file raises
        raise UserError(f"--remote_rm_url {path}: cannot load it ({type(error).__name__}: {_short(error)}).") from None
    function = getattr(module, "reward_func", None)
    if not callable(function):
        raise UserError(f"--remote_rm_url {path}: the file defines no function reward_func(queries, prompts, "
                        f"labels, **kwargs).")
    return function


def post_to_reward_server(url: str, inputs: RewardInputs) -> Any:
    """OpenRLHF's request to a reward server; transport errors and 5xx replies are retried."""
    import requests

    payload = {"query": inputs.queries, "prompts": inputs.prompts, "labels": inputs.labels}
    problem = ""
    for attempt in range(HTTP_ATTEMPTS):
        if attempt:
            time.sleep(HTTP_RETRY_DELAY_S)
        try:
            reply = requests.post(url, json=payload, timeout=HTTP_TIMEOUT_S)
        except requests.RequestException as error:
            problem = f"{type(error).__name__}: {_short(error, 200)}"
            continue
        if reply.status_code >= 500:
            problem = f"HTTP {reply.status_code}"
            continue
        if reply.status_code >= 400:  # the server refuses this request: asking again will not help
            raise UserError(f"reward server {url} answered HTTP {reply.status_code}: {_short(Exception(reply.text))}.")
        try:
            return reply.json()
        except ValueError:
            raise UserError(f"reward server {url} answered with something that is not JSON: "
                            f"{reply.text[:100]!r}.") from None
    raise UserError(f"reward server {url} did not answer after {HTTP_ATTEMPTS} attempts ({problem}).")


def reward_function(reward_fn: str | None, remote_rm_url: str | None) -> RewardFunction | None:
    """The configured reward function, loaded and ready to call; None when a reward model scores."""
    if reward_fn:
        function = load_reward_fn(reward_fn)
        return RewardFunction(f"--reward_fn {reward_fn}", lambda x: function(x.raw_prompts, x.responses))
    if not remote_rm_url:
        return None
    if remote_rm_url.startswith(("http://", "https://")):
        return RewardFunction(f"reward server {remote_rm_url}", lambda x: post_to_reward_server(remote_rm_url, x))
    function = load_reward_file(remote_rm_url)
    return RewardFunction(f"--remote_rm_url {remote_rm_url} (reward_func)",
                          lambda x: function(x.queries, x.prompts, x.labels))
