"""Generation and scoring of rollouts with transformers (CPU, or GPU without vLLM): prompts left-padded, responses
right-padded and ended at their first EOS, sampled from torch's generator, which the PPO trainer seeds per (seed,
step, rank). docs/design-notes.md ("Rollouts with transformers") has the details.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from rlhf_core.rank.ppo_math import token_logprobs

# A generation tells its progress every this many new tokens: often enough that a block takes a fraction of a step,
# seldom enough to cost nothing (one Python call per block; the heartbeat reads it once a second).
TOKEN_BLOCK = 8


def collate_sequences(prompts: list[list[int]], responses: list[list[int]], pad_token_id: int) -> dict:
    """[left-padded prompt | right-padded response] rows, with masks and positions that skip padding."""
    prompt_len, response_len = max(map(len, prompts)), max(max(map(len, responses)), 1)
    rows = len(prompts)
    input_ids = torch.full((rows, prompt_len + response_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    action_mask = torch.zeros((rows, response_len), dtype=torch.float32)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        input_ids[row, prompt_len - len(prompt) : prompt_len] = torch.tensor(prompt)
        input_ids[row, prompt_len : prompt_len + len(response)] = torch.tensor(response, dtype=torch.long)
        attention_mask[row, prompt_len - len(prompt) : prompt_len + len(response)] = 1
        action_mask[row, : len(response)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "action_mask": action_mask, "prompt_len": prompt_len}


def on_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors moved to `device` (batches are built on the CPU; the models may be on a GPU)."""
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in batch.items()}


def response_logits(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 logits that predict each response token, [rows, response_len, vocab], and those tokens, [rows,
    response_len], on the model's device."""
    batch = on_device(batch, model.device)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits.float()  # fp32 log-probs under bf16 autocast
    start = batch["prompt_len"]
    return logits[:, start - 1 : -1], batch["input_ids"][:, start:]


def response_logprobs(model, batch: dict) -> torch.Tensor:
    """log p(response token | prefix) for every response position, [rows, response_len], on the model's device."""
    return token_logprobs(*response_logits(model, batch))


def stop_token_ids(model, eos_token_id: int) -> list[int]:
    """The tokenizer's EOS, then every other EOS the model's generation config lists (Qwen2's: <|im_end|> and
    <|endoftext|>): a response ends at whichever comes first, as vLLM, OpenRLHF's generator, ends it."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    return list(dict.fromkeys([eos_token_id, *configured]))


class GenerationPieces:
    """A rollout's generation as pieces of work for the rank (`RankSignals.work_done`, phase "generate"): `parts`
    parts (micro-batches, episodes, vLLM requests) of up to `tokens_per_part` new tokens each. Done counts the
    tokens of the finished parts and those out in the part under way; the last part's end clears the phase."""

    def __init__(self, signals, parts: int, tokens_per_part: int):
        self.signals, self.per_part, self.finished = signals, max(tokens_per_part, 1), 0
        self.total = parts * self.per_part

    def tokens(self, count: int) -> None:
        """`count` new tokens of the part under way are out (`generate`'s `on_tokens`)."""
        self.signals.work_done("generate", self.finished * self.per_part + min(count, self.per_part - 1), self.total)

    def part_done(self) -> None:
        self.finished += 1
        self.signals.work_done("generate", self.finished * self.per_part, self.total)


class TokenBlocks(StoppingCriteria):
    """A stopping criterion that never stops: every TOKEN_BLOCK new tokens it tells `on_tokens` how many are out,
    so a long generation is progress (the hang watch's, the driver's bar). It draws no random number and changes no
    row, so the samples are the same with it or without it."""

    def __init__(self, prompt_len: int, on_tokens: Callable[[int], None]):
        self.prompt_len, self.on_tokens, self.told = prompt_len, on_tokens, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.BoolTensor:
        new_tokens = input_ids.shape[1] - self.prompt_len
        if new_tokens - self.told >= TOKEN_BLOCK:
            self.told = new_tokens
            self.on_tokens(new_tokens)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


@dataclass(frozen=True)
class SamplingSettings:
    """How a response is sampled, with transformers (`generate`) or vLLM (`VLLMGenerator.sample`): at most
    `max_new_tokens` tokens, at `temperature`, from the `top_p` nucleus (no top-k)."""

    max_new_tokens: int
    temperature: float
    top_p: float


@torch.no_grad()
def generate(model, prompts: list[list[int]], pad_token_id: int, eos_token_id: int, sampling: SamplingSettings,
             on_tokens: Callable[[int], None] | None = None) -> list[list[int]]:
    """One sampled response per prompt (token ids, ending at the first EOS of `stop_token_ids`). `on_tokens(n)`:
    told every TOKEN_BLOCK tokens how many new tokens each row has so far (`TokenBlocks`)."""
    batch = on_device(collate_sequences(prompts, [[] for _ in prompts], pad_token_id), model.device)
    prompt_len = batch["prompt_len"]
    stop = stop_token_ids(model, eos_token_id)
    progress = StoppingCriteriaList([TokenBlocks(prompt_len, on_tokens)]) if on_tokens is not None else None
    output = model.generate(input_ids=batch["input_ids"][:, :prompt_len],
                            attention_mask=batch["attention_mask"][:, :prompt_len],
                            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
                            max_new_tokens=sampling.max_new_tokens, eos_token_id=stop, pad_token_id=pad_token_id,
                            stopping_criteria=progress)
    responses = []
    for row in output[:, prompt_len:].tolist():
        cut = next((index + 1 for index, token in enumerate(row) if token in stop), len(row))
        responses.append(row[:cut])
    return responses
