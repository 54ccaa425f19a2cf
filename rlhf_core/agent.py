"""OpenRLHF's agent API (`openrlhf.utils.agent`, v0.9.0), for `--agent_func_path`: a user's agent file moves
over by changing one import line,

    from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase
    ->  from rlhf_core.agent import AgentExecutorBase, AgentInstanceBase

The file defines `AgentInstance(AgentInstanceBase)` (async `reset(states)` and `step(states)`) and may define
`AgentExecutor(AgentExecutorBase)`. Departs from OpenRLHF: instances live in the rank's process and a rollout's
episodes run one after another, each seeded. docs/design-notes.md ("The agent API") has the rest.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

from rlhf_core.errors import UserError
from rlhf_core.user_files import import_user_file


@dataclass
class SamplingParams:
    """The sampling settings of one turn, under vLLM's names (the environment may hand back a changed copy)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 1024
    skip_special_tokens: bool = False  # OpenRLHF's: the action text keeps special tokens
    logprobs: int | None = None  # per-token log-probs of the action (OpenRLHF's rollout_log_probs)
    seed: int | None = None


@dataclass
class CompletionOutput:
    token_ids: list[int]
    text: str
    logprobs: list[dict] | None = None


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput] = field(default_factory=list)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def new_instance(cls: type[AgentInstanceBase]) -> AgentInstanceBase:
    """An instance of `cls` whose `__init__` may be async (OpenRLHF 0.9.0's example declares `async def __init__`,
    which Ray's actors allow and plain Python does not)."""
    instance = cls.__new__(cls)
    await _maybe_await(cls.__init__(instance))
    return instance


class AgentInstanceBase(ABC):
    """One episode's environment: OpenRLHF's `AgentInstanceBase`."""

    @abstractmethod
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    @abstractmethod
    async def step(self, state_dict: dict, **kwargs):
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase(ABC):
    """Runs episodes of `agent_instance_cls` with `llm_engine`: OpenRLHF 0.9.0's `AgentExecutorBase`."""

    def __init__(self, agent_instance_cls, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError("AgentInstance must inherit from AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls
        self.max_steps, self.max_length = max_steps, max_length
        self.llm_engine, self.hf_tokenizer, self.result_queue = llm_engine, hf_tokenizer, result_queue

    async def generate(self, prompt_ids: list[int], sampling_params: SamplingParams) -> RequestOutput:
        return await self.llm_engine.generate(prompt_ids, sampling_params)

    def tokenize(self, text: str) -> list[int]:
        return self.hf_tokenizer(text, add_special_tokens=False)["input_ids"]

    async def execute(self, prompt, label, sampling_params):
        """One episode of `prompt` (text), its result put on `result_queue`."""
        agent = await new_instance(self.agent_instance_cls)
        reset = await _maybe_await(agent.reset({"observation": prompt, "label": label}))
        observation_text = reset["observation"]
        # The engine knows the prompt's tokens as the model sees them (BOS, truncation): keep those when the
        # environment kept the prompt; a new observation is tokenized as OpenRLHF tokenizes it.
        tokens = list(self.llm_engine.prompt_tokens(observation_text) or self.tokenize(observation_text))
        action_ranges, total_reward, final_scores, extra_logs = [], 0.0, 0.0, {}
        for _ in range(self.max_steps):
            sampling_params.max_tokens = self.max_length - len(tokens)
            if sampling_params.max_tokens <= 0:
                break
            output = (await self.generate(tokens, sampling_params)).outputs[0]
            action_ranges.append((len(tokens), len(tokens) + len(output.token_ids)))
            result = await _maybe_await(agent.step({"observation_text": observation_text,
                                                    "action_text": output.text, "label": label,
                                                    "sampling_params": sampling_params}))
            total_reward += as_float(result["rewards"])
            final_scores = as_float(result.get("scores", total_reward))
            extra_logs = result.get("extra_logs") or {}
            feedback = result["environment_feedback"]
            observation_text = observation_text + output.text + feedback
            tokens = tokens + list(output.token_ids) + self.tokenize(feedback)
            if result.get("sampling_params"):
                sampling_params = result["sampling_params"]
            if result["done"]:
                break
        await self.result_queue.put({"prompt": prompt, "label": label, "observation_tokens": tokens,
                                     "reward": total_reward, "scores": final_scores,
                                     "extra_logs": extra_logs, "action_ranges": action_ranges,
                                     "rollout_log_probs": None})


def as_float(value: Any) -> float:
    """A reward as a float: a number, or a one-element tensor or array (what OpenRLHF's `.item()` takes)."""
    return float(value.item() if hasattr(value, "item") else value)


IMPORT_HINT = "from rlhf_core.agent import AgentExecutorBase, AgentInstanceBase"


def load_agent_executor(path: str) -> Callable[..., AgentExecutorBase]:
    """The file's `AgentExecutor` class, or a function making the base executor around its `AgentInstance`
    (OpenRLHF 0.11's files)."""
    try:
        module = import_user_file(path, "rlhf_user_agent_func")
    except FileNotFoundError:
        raise UserError(f"--agent_func_path {path}: no such file (give the .py file that defines AgentInstance).") \
            from None
    except ModuleNotFoundError as error:
        hint = f"; change its import to `{IMPORT_HINT}`" if (error.name or "").startswith("openrlhf") else ""
        raise UserError(f"--agent_func_path {path}: cannot load it (ModuleNotFoundError: {error}){hint}.") from None
    except Exception as error:  # a syntax error, or whatever the user's file raises at import
        raise UserError(f"--agent_func_path {path}: cannot load it ({type(error).__name__}: {error}).") from None
    executor = getattr(module, "AgentExecutor", None)
    if isinstance(executor, type) and issubclass(executor, AgentExecutorBase):
        return executor
    instance = getattr(module, "AgentInstance", None)
    if isinstance(instance, type) and issubclass(instance, AgentInstanceBase):
        return lambda **kwargs: AgentExecutorBase(instance, **kwargs)
    raise UserError(f"--agent_func_path {path}: the file defines neither AgentExecutor(AgentExecutorBase) nor "
                    f"AgentInstance(AgentInstanceBase) (import them with `{IMPORT_HINT}`).")
