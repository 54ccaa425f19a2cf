"""Toy evaluation: the mean gold score of a model's greedy answers on held-out toy prompts."""

from __future__ import annotations

import torch

from rlhf_core.data import read_records
from rlhf_core.models import load_causal_lm, load_tokenizer
from rlhf_core.toy import gold_score


@torch.no_grad()
def mean_gold_score(model_url: str, prompts_url: str, max_new_tokens: int = 8, num_prompts: int = 64) -> float:
    tokenizer = load_tokenizer(model_url)
    model = load_causal_lm(model_url).eval()  # an adapter folder is merged into its base
    scores = []
    for record in read_records(prompts_url)[:num_prompts]:
        prompt = record.fields["prompt"]
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []  # Qwen has none
        ids = bos + tokenizer(prompt, add_special_tokens=False).input_ids
        output = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        response = tokenizer.decode(output[0, len(ids):], skip_special_tokens=True)
        scores.append(gold_score(prompt, response))
    return sum(scores) / len(scores)
