"""What differs between model families once a model is loaded: where a reward model reads its score when the
family has no pad token (GPT-2, Mistral: the pad token becomes the EOS, as OpenRLHF sets it), where generation
stops when the generation config lists several EOS tokens (Qwen2, Phi-3), and scoring a tokenizer without BOS."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.models.load import load_scalar_model, sequence_scores, token_values
from rlhf_core.storage.locate import load_tokenizer
from tests.families import FAMILIES, tiny_model
from tests.hub_cache import build_tokenizer


def saved_family(name: str, directory) -> str:
    tokenizer = build_tokenizer(FAMILIES[name].tokenizer)
    tiny_model(FAMILIES[name], tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("family", ["gpt2", "mistral", "qwen2"])
def test_a_padded_batch_is_scored_at_each_sequence_last_token_also_when_pad_is_eos(family, tmp_path):
    directory = saved_family(family, tmp_path)
    tokenizer = load_tokenizer(directory)
    assert (tokenizer.pad_token_id == tokenizer.eos_token_id) == (family != "qwen2")  # no pad token: pad = EOS
    torch.manual_seed(0)
    model = load_scalar_model(directory, tokenizer.pad_token_id).eval()
    rows = [tokenizer("sort : 3 1 2 = 1 2 3", add_special_tokens=False).input_ids + [tokenizer.eos_token_id],
            tokenizer("sort : 5 4 = 4 5", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]]
    length = max(map(len, rows))
    input_ids = torch.tensor([row + [tokenizer.pad_token_id] * (length - len(row)) for row in rows])
    attention_mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in rows])
    with torch.no_grad():
        scores = sequence_scores(model, input_ids, attention_mask)
        alone = [token_values(model, torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long))[0, -1]
                 for row in rows]  # the score head at the EOS each sequence ends with, as OpenRLHF reads it
    torch.testing.assert_close(scores, torch.stack(alone), atol=1e-5, rtol=0)


def test_generation_stops_at_any_eos_of_the_generation_config(tmp_path):
    """Qwen2's generation config lists <|im_end|> (the tokenizer's EOS) and <|endoftext|>; a policy that says
    <|endoftext|> has ended its response, as vLLM (OpenRLHF's generator) ends it."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.rank.rollout import SamplingSettings, generate

    directory = saved_family("qwen2", tmp_path)
    tokenizer = load_tokenizer(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    other_eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id, other_eos]

    def always_other_eos(module, inputs, logits):
        forced = torch.full_like(logits, -1e4)
        forced[..., other_eos] = 0.0
        return forced

    model.lm_head.register_forward_hook(always_other_eos)
    prompt = tokenizer("sort : 3 1 =", add_special_tokens=False).input_ids
    sampling = SamplingSettings(max_new_tokens=6, temperature=1.0, top_p=1.0)
    assert generate(model, [prompt, prompt[1:]], tokenizer.pad_token_id, tokenizer.eos_token_id,
                    sampling) == [[other_eos], [other_eos]]


def test_gold_score_of_a_model_whose_tokenizer_has_no_bos(tmp_path):
    from rlhf_core.models.evaluate import mean_gold_score

    directory = saved_family("qwen2", tmp_path)
    assert load_tokenizer(directory).bos_token_id is None
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "sort : 3 1 ="}\n{"prompt": "sort : 5 4 2 ="}\n')
    assert 0.0 <= mean_gold_score(directory, str(prompts)) <= 1.0


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_a_left_padded_row_scores_as_it_would_unpadded(family, tmp_path):
    """PPO scores [left-padded prompt | response] rows; GPT-2's positions are learned embeddings, so its
    positions must count attended tokens only, as in the right-padded batches the reward model trained on."""
    directory = saved_family(family, tmp_path)
    tokenizer = load_tokenizer(directory)
    torch.manual_seed(0)
    model = load_scalar_model(directory, tokenizer.pad_token_id).eval()
    row = tokenizer("sort : 5 4 = 4 5", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    padded = torch.tensor([[tokenizer.pad_token_id] * 3 + row])
    with torch.no_grad():
        left = sequence_scores(model, padded, torch.tensor([[0] * 3 + [1] * len(row)]))
        alone = sequence_scores(model, torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long))
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=0)
