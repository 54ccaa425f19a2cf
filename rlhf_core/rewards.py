"""Reward functions that replace the reward model: Python functions in either form, and OpenRLHF's HTTP form.

- `--reward_fn package.module:function` or `--remote_rm_url path/to/file.py` (the file's `reward_func`), written
  as ours, `fn(prompts, responses) -> scores`, or as OpenRLHF's, `reward_func(queries, prompts, labels, **kwargs)`;
- `--remote_rm_url http://host:port/get_reward`: a server answering OpenRLHF's JSON body, as `serve_rm` does.

Each may return a tensor, a list or OpenRLHF's dict {"rewards", "scores", "extra_logs"}. Departs from OpenRLHF:
called once per rollout batch, and a failure stops the chunk. docs/design-notes.md ("Reward functions") has the rest.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_core.errors import UserError
from rlhf_core.user_files import import_user_file

logger = logging.getLogger(__name__)

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

    raw_prompts: list[str]  # the prompt as written in the data, as text (our form's `prompts`; `prompt_text`)
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
    """`package.module:function` -> the function (in either form, `reward_form`)."""
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
        module = import_user_file(path, "rlhf_user_reward_func")
    except Exception as error:  # a syntax error, a missing import, or whatever the file raises
        raise UserError(f"--remote_rm_url {path}: cannot load it ({type(error).__name__}: {_short(error)}).") from None
    function = getattr(module, "reward_func", None)
    if not callable(function):
        raise UserError(f"--remote_rm_url {path}: the file defines no function reward_func (OpenRLHF's "
                        f"reward_func(queries, prompts, labels, **kwargs), or reward_func(prompts, responses)).")
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


# The two forms of a Python reward function, by the names of their positional arguments.
OURS = ("prompts", "responses")
OPENRLHF = ("queries", "prompts", "labels")
FORMS_TEXT = "OpenRLHF's reward_func(queries, prompts, labels, **kwargs) or ours, fn(prompts, responses)"


def prompt_text(prompt: Any) -> str:
    """A prompt as our form's `prompts` gives it: a string as written; for a list of chat messages
    ({"role", "content"}), the content of the last user message (of the last message when none is the user's)."""
    if not isinstance(prompt, list):
        return prompt
    messages = [message for message in prompt if isinstance(message, dict)]
    chosen = next((message for message in reversed(messages) if message.get("role") == "user"),
                  messages[-1] if messages else {})
    return str(chosen.get("content", ""))


def _fits(signature: inspect.Signature, form: tuple[str, ...]) -> bool:
    """Whether the function takes `form`'s arguments positionally without one of them landing on a parameter
    named after another argument of the two forms (`fn(prompts, queries, labels)` does not fit OpenRLHF's)."""
    try:
        signature.bind(*form)
    except TypeError:
        return False
    positional = [parameter.name for parameter in signature.parameters.values()
                  if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)]
    known = set(OURS) | set(OPENRLHF)
    return all(name == wanted or name not in known for name, wanted in zip(positional, form))


def reward_form(name: str, function: Callable) -> tuple[str, ...]:
    """OPENRLHF or OURS, read from `function`'s signature (the rule: docs/design-notes.md, "Reward functions"); a
    UserError naming both forms when it fits both or neither."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: nothing says which form it is
        raise UserError(f"{name}: its signature cannot be read, so it fits neither reward-function form; define "
                        f"it as {FORMS_TEXT}.") from None
    forms = [form for form in (OPENRLHF, OURS) if _fits(signature, form)]
    if len(forms) == 1:
        return forms[0]
    which = "both reward-function forms" if forms else "neither reward-function form"
    raise UserError(f"{name}: its signature {getattr(function, '__name__', 'fn')}{signature} fits {which}, so "
                    f"which arguments it wants cannot be told; define it as {FORMS_TEXT}.")


def python_reward_function(name: str, function: Callable) -> RewardFunction:
    """A Python function, called in the form its signature declares."""
    if reward_form(name, function) == OPENRLHF:
        return RewardFunction(name, lambda x: function(x.queries, x.prompts, x.labels))
    return RewardFunction(name, lambda x: function(x.raw_prompts, x.responses))


def reward_function(reward_fn: str | None, remote_rm_url: str | None) -> RewardFunction | None:
    """The configured reward function, loaded and ready to call; None when a reward model scores."""
    if reward_fn:
        return python_reward_function(f"--reward_fn {reward_fn}", load_reward_fn(reward_fn))
    if not remote_rm_url:
        return None
    if remote_rm_url.startswith(("http://", "https://")):
        return RewardFunction(f"reward server {remote_rm_url}", lambda x: post_to_reward_server(remote_rm_url, x))
    return python_reward_function(f"--remote_rm_url {remote_rm_url} (reward_func)", load_reward_file(remote_rm_url))


def reward_inputs(tokenizer, items: Sequence[Any], responses: list[list[int]]) -> RewardInputs:
    """Every form's arguments for prompt items (`rlhf_core.data.prompts.PromptItem`) and their sampled
    responses: OpenRLHF's prompt and query are decoded from the tokens the model saw (without the BOS we add),
    so each query starts with its prompt; our form's prompt is `prompt_text` of the field."""
    prompts = [tokenizer.decode(item.written_ids, skip_special_tokens=False) for item in items]
    queries = [tokenizer.decode(item.written_ids + response, skip_special_tokens=False)
               for item, response in zip(items, responses)]
    return RewardInputs(raw_prompts=[prompt_text(item.text) for item in items], prompts=prompts, queries=queries,
                        responses=tokenizer.batch_decode(responses, skip_special_tokens=True),
                        labels=[item.label for item in items])


def check_reward_setup(cfg, tokenizer, sample: Any) -> None:
    """Before any training (preflight): PPO settings `cfg`'s reward function loads, its form is told from its
    signature, and it scores one real prompt item with an empty response."""
    function = reward_function(cfg.reward_fn, cfg.remote_rm_url)
    if function is None:
        return
    if cfg.normalize_reward:
        logger.warning("--normalize_reward has no effect with a reward function (%s); as in OpenRLHF, only "
                       "reward-model scores are normalized.", function.name)
    function(reward_inputs(tokenizer, [sample], [[tokenizer.eos_token_id]]))

