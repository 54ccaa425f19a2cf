"""Generation and scoring of rollouts with transformers (CPU, or GPU without vLLM): prompts left-padded, responses
right-padded and ended at their first EOS, sampled from torch's generator, which the PPO trainer seeds per (seed,
step, rank). docs/design-notes.md ("Rollouts with transformers") has the details.
"""

from __future__ import annotations


import torch

from rlhf_core.rank.ppo_math import token_logprobs


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


@torch.no_grad()
def generate(model, prompts: list[list[int]], pad_token_id: int, eos_token_id: int, max_new_tokens: int,
             temperature: float, top_p: float) -> list[list[int]]:
    """One sampled response per prompt (token ids, ending at the first EOS of `stop_token_ids`)."""
    batch = on_device(collate_sequences(prompts, [[] for _ in prompts], pad_token_id), model.device)
    prompt_len = batch["prompt_len"]
    stop = stop_token_ids(model, eos_token_id)
    output = model.generate(input_ids=batch["input_ids"][:, :prompt_len],
                            attention_mask=batch["attention_mask"][:, :prompt_len],
                            do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                            max_new_tokens=max_new_tokens, eos_token_id=stop, pad_token_id=pad_token_id)
    responses = []
    for row in output[:, prompt_len:].tolist():
        cut = next((index + 1 for index, token in enumerate(row) if token in stop), len(row))
        responses.append(row[:cut])
    return responses
