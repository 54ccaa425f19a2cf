"""Multi-turn agent rollouts (`--agent_func_path`): OpenRLHF's agent file, run episode by episode inside a rank. A
sample is [prompt | actions and environment feedback], its action mask 1 on the model's own tokens, the episode's
reward on its last action; each episode runs in randomness seeded by (seed, step, sample index), so a resume replays
it. docs/design-notes.md ("Agent rollouts") has the details, and when an environment breaks that exactness.
"""

from __future__ import annotations

import asyncio
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from rlhf_core.agent import CompletionOutput, RequestOutput, SamplingParams, as_float, load_agent_executor
from rlhf_core.errors import UserError
from rlhf_core.data.determinism import derive_seed
from rlhf_core.rank.rollout import SamplingSettings, generate

MAX_TURNS = 10000  # OpenRLHF's max_steps: the length budget ends an episode first


@dataclass(frozen=True)
class Episode:
    prompt: list[int]  # the tokens before the first action
    response: list[int]  # every token after them: actions and environment feedback, cut at the length budget
    action_mask: list[int]  # 1 on the model's own tokens
    reward: float
    score: float
    extra_logs: dict[str, float] = field(default_factory=dict)


@contextmanager
def episode_randomness(seed: int) -> Iterator[None]:
    """Python's, numpy's and torch's global generators seeded with `seed` inside, restored after."""
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        random.seed(seed)
        if numpy is not None:
            numpy.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            if numpy is not None:
                numpy.random.set_state(numpy_state)


def sampling_settings(params: SamplingParams) -> SamplingSettings:
    """The settings of an agent's OpenRLHF-style `SamplingParams` that a turn is sampled with."""
    return SamplingSettings(params.max_tokens, params.temperature, params.top_p)


class TransformersEngine:
    """`llm_engine` over transformers generation: one turn, one sequence."""

    def __init__(self, model, tokenizer, stop_token_id: int):
        self.model, self.tokenizer, self.stop_token_id = model, tokenizer, stop_token_id
        self.prompt: tuple[str, list[int]] = ("", [])  # this episode's prompt text and the tokens the model sees
        self.on_tokens: Callable[[int], None] | None = None  # told a turn's new tokens by blocks (`generate`)

    def begin_episode(self, prompt_text: str, prompt_ids: list[int], seed: int) -> None:
        self.prompt = (prompt_text, prompt_ids)

    def prompt_tokens(self, text: str) -> list[int] | None:
        """The tokens of the episode's prompt when `text` is it (the environment kept the prompt), else None."""
        return self.prompt[1] if text == self.prompt[0] else None

    def sample(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        return generate(self.model, [prompt_ids], self.tokenizer.pad_token_id, self.stop_token_id,
                        sampling_settings(params), on_tokens=self.on_tokens)[0]

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        tokens = self.sample(list(prompt_ids), params)
        text = self.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
        return RequestOutput([CompletionOutput(list(tokens), text)])


class VLLMEngine(TransformersEngine):
    """`llm_engine` over the rank's colocated vLLM engine (weights already loaded for this rollout); each turn's
    seed is derived from the episode's."""

    def __init__(self, vllm, tokenizer, stop_token_id: int):
        super().__init__(None, tokenizer, stop_token_id)
        self.vllm, self.episode_seed, self.num_turns = vllm, 0, 0

    def begin_episode(self, prompt_text: str, prompt_ids: list[int], seed: int) -> None:
        super().begin_episode(prompt_text, prompt_ids, seed)
        self.episode_seed, self.num_turns = seed, 0

    def sample(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        self.num_turns += 1
        seed = derive_seed(self.episode_seed, "turn", self.num_turns) % 2**31
        return self.vllm.sample([prompt_ids], [seed], sampling_settings(params), self.stop_token_id)[0]


class AgentRollout:
    """The agent file's executor and an event loop of this rank's own, reused for every rollout."""

    def __init__(self, path: str, tokenizer, max_length: int, top_p: float):
        self.path, self.tokenizer, self.max_length, self.top_p = path, tokenizer, max_length, top_p
        self.executor_class = load_agent_executor(path)
        self.loop = asyncio.new_event_loop()

    def run(self, engine: TransformersEngine, prompts: list[tuple[str, list[int], Any]], seeds: list[int],
            temperature: float, on_episode: Callable[[], None] | None = None) -> list[Episode]:
        """One episode per (prompt text, prompt tokens, label), each seeded with its seed; `on_episode()` told at
        each episode's end (progress for the hang watch)."""
        queue: asyncio.Queue = asyncio.Queue()
        executor = self.executor_class(max_steps=MAX_TURNS, max_length=self.max_length, llm_engine=engine,
                                       hf_tokenizer=self.tokenizer, result_queue=queue)
        episodes = []
        for (text, ids, label), seed in zip(prompts, seeds):
            with episode_randomness(seed):
                engine.begin_episode(text, ids, seed)
                params = SamplingParams(temperature=temperature, top_p=self.top_p, max_tokens=self.max_length)
                try:
                    self.loop.run_until_complete(executor.execute(text, label, params))
                except UserError:
                    raise
                except Exception as error:  # the user's environment: any exception is theirs to fix
                    raise UserError(f"--agent_func_path {self.path}: the agent raised {type(error).__name__}: "
                                    f"{error} (prompt {text[:60]!r}).") from None
            if queue.qsize() != 1:
                raise UserError(f"--agent_func_path {self.path}: AgentExecutor.execute put {queue.qsize()} results "
                                f"on result_queue for one prompt; put exactly one (OpenRLHF's final_response).")
            episodes.append(self.episode(queue.get_nowait()))
            if on_episode is not None:
                on_episode()
        return episodes

    def episode(self, result: dict) -> Episode:
        """OpenRLHF's final_response -> an Episode, cut at the length budget."""
        try:
            tokens = [int(token) for token in result["observation_tokens"]][: self.max_length]
            ranges = [(int(start), int(end)) for start, end in result["action_ranges"]]
            reward, score = as_float(result["reward"]), as_float(result.get("scores", result["reward"]))
            extra_logs = {str(key): as_float(value) for key, value in (result.get("extra_logs") or {}).items()}
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise UserError(f"--agent_func_path {self.path}: a result on result_queue is malformed "
                            f"({type(error).__name__}: {error}); see OpenRLHF's final_response.") from None
        prompt_length = ranges[0][0] if ranges else len(tokens)
        mask = [0] * max(len(tokens) - prompt_length, 0)
        for start, end in ranges:
            for position in range(max(start, prompt_length), min(end, len(tokens))):
                mask[position - prompt_length] = 1
        return Episode(tokens[:prompt_length], tokens[prompt_length:], mask, reward, score, extra_logs)


def prompt_texts(tokenizer, items: list) -> list[tuple[str, list[int], Any]]:
    """(text, tokens, label) of PPO's prompt items: the text as the model sees it (template applied, without the
    BOS added here), as OpenRLHF hands its agent the prompt."""
    return [(tokenizer.decode(item.written_ids, skip_special_tokens=False), item.ids, item.label) for item in items]
