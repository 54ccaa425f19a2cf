"""The CPU-testable half of the vLLM path: the weights handed to a vLLM engine (LoRA merged, Hugging
Face names) reproduce the actor's logits, and taking them leaves the actor untouched."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from rlhf_core.models.load import LoadOptions, load_causal_lm
from rlhf_core.rank.vllm_engine import inference_weights


def test_merged_weights_reproduce_the_lora_actor_and_leave_it_unchanged(toy_assets):
    torch.manual_seed(0)  # lora_A's draw too, not only lora_B's: the same adapter whichever test ran before
    actor = load_causal_lm(toy_assets["model"], LoadOptions(lora_rank=4, lora_alpha=8))
    for name, param in actor.named_parameters():
        if "lora_B" in name:  # fresh adapters are zero: give them something to merge
            param.data.normal_(0, 0.5)
    before = {name: tensor.clone() for name, tensor in actor.state_dict().items()}

    weights = dict(inference_weights(actor))
    plain = AutoModelForCausalLM.from_pretrained(toy_assets["model"], dtype=torch.float32)
    assert set(weights) == set(plain.state_dict())  # Hugging Face names, no adapter tensors
    plain.load_state_dict(weights)

    ids = torch.randint(0, plain.config.vocab_size, (2, 12))
    with torch.no_grad():
        expected, actual = actor(input_ids=ids).logits, plain(input_ids=ids).logits
        base_only = AutoModelForCausalLM.from_pretrained(toy_assets["model"], dtype=torch.float32)(input_ids=ids).logits
    assert (expected - actual).abs().max() < 1e-5
    assert (expected - base_only).abs().max() > 1e-2  # the adapters mattered
    for name, tensor in actor.state_dict().items():
        assert tensor.equal(before[name]), f"{name} changed"


def test_a_plain_actor_is_handed_over_as_is(toy_assets):
    actor = load_causal_lm(toy_assets["model"])
    weights = dict(inference_weights(actor))
    assert all(weights[name].equal(tensor) for name, tensor in actor.state_dict().items())
