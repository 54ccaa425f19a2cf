"""Toy evaluation: the mean gold score of a model's greedy answers on held-out toy prompts."""

from __future__ import annotations

import torch

from rlhf_core.data.stream import read_records
from rlhf_core.models.load import load_causal_lm
from rlhf_core.storage.locate import load_tokenizer
from rlhf_core.data.samples import Renderer, tokenize_prompts
from rlhf_core.toy import gold_score


@torch.no_grad()
def mean_gold_score(model_url: str, prompts_url: str, max_new_tokens: int = 8, num_prompts: int = 64) -> float:
    tokenizer = load_tokenizer(model_url)
    model = load_causal_lm(model_url).eval()  # an adapter folder is merged into its base
    scores = []
    records = read_records(prompts_url)[:num_prompts]
    # the prompt's tokens as PPO's rollouts see them (BOS only where the tokenizer adds one; Qwen has none)
    prompts = tokenize_prompts(Renderer(tokenizer, prompts_url, apply_chat_template=False), records, "prompt",
                               prompt_max_len=tokenizer.model_max_length)
    for record, tokenized in zip(records, prompts):
        prompt, ids = record.fields["prompt"], tokenized.ids
        output = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        response = tokenizer.decode(output[0, len(ids):], skip_special_tokens=True)
        scores.append(gold_score(prompt, response))
    return sum(scores) / len(scores)
