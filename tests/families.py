"""Model families beyond Llama, as tiny random models saved under their hub ids in a local HF cache.

Each `Family` declares what makes it different for a training pipeline, all taken from its published
config and tokenizer files (sizes aside):
- qwen2 (Qwen2.5-0.5B-Instruct): ChatML, no BOS token, tied embeddings, q/k/v biases, and a generation config
  whose `eos_token_id` is a list;
- qwen3 (Qwen3-0.6B): ChatML, tied embeddings, q/k norms and an explicit head_dim;
- mistral (Mistral-7B-Instruct-v0.3): `[INST]` template that writes BOS `<s>`, no pad token;
- gemma (gemma-2b-it): `<start_of_turn>` template that writes BOS `<bos>`, tied and scaled embeddings,
  one key/value head, GeLU MLP;
- phi3 (Phi-3-mini-4k-instruct): fused `qkv_proj` and `gate_up_proj`, `<|user|>`/`<|end|>` template;
- gpt2 (openai-community/gpt2): Conv1D layers instead of nn.Linear, tied embeddings, `<|endoftext|>` as its
  only special token (BOS = EOS = UNK), no pad token and no chat template.
Every model has 2 layers and hidden size 64, so each training step takes milliseconds on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tests.hub_cache import QWEN2_CHATML, TokenizerSpec, build_tokenizer, save_model

MISTRAL_TEMPLATE = (  # a system message goes before the first user message, as Mistral's own template does
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token }}{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

MISTRAL_INST = TokenizerSpec(eos="</s>", bos="<s>", unk="<unk>", chat_template=MISTRAL_TEMPLATE,
                             extra_special=("[INST]", "[/INST]"), add_bos_token=True)
GEMMA_IT = TokenizerSpec(eos="<eos>", bos="<bos>", pad="<pad>", unk="<unk>", chat_template=GEMMA_TEMPLATE,
                         extra_special=("<start_of_turn>", "<end_of_turn>"), add_bos_token=True)
PHI3_INSTRUCT = TokenizerSpec(eos="<|end|>", bos="<s>", pad="<|endoftext|>", unk="<unk>", chat_template=PHI3_TEMPLATE,
                              extra_special=("<|system|>", "<|user|>", "<|assistant|>"))
GPT2_PLAIN = TokenizerSpec(eos="<|endoftext|>", bos="<|endoftext|>", unk="<|endoftext|>")

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 256}


@dataclass(frozen=True)
class Family:
    """One architecture: the hub id it is saved under, its tokenizer, its config class and settings, and
    the tokens its generation config lists as EOS (more than one: a list, as Qwen2's)."""

    name: str
    repo_id: str
    tokenizer: TokenizerSpec
    config_class: str
    settings: dict = field(default_factory=dict)
    generation_eos: tuple[str, ...] = ()


FAMILIES = {family.name: family for family in (
    Family("qwen2", "Qwen/Qwen2.5-0.5B-Instruct", QWEN2_CHATML, "Qwen2Config",
           {**TINY, "num_key_value_heads": 2, "tie_word_embeddings": True},
           generation_eos=("<|im_end|>", "<|endoftext|>")),
    Family("qwen3", "Qwen/Qwen3-0.6B", QWEN2_CHATML, "Qwen3Config",  # the same tokenizer shape as Qwen2
           {**TINY, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True},
           generation_eos=("<|im_end|>", "<|endoftext|>")),
    Family("mistral", "mistralai/Mistral-7B-Instruct-v0.3", MISTRAL_INST, "MistralConfig",
           {**TINY, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False}),
    Family("gemma", "google/gemma-2b-it", GEMMA_IT, "GemmaConfig",
           {**TINY, "num_key_value_heads": 1, "head_dim": 16, "tie_word_embeddings": True}),
    Family("phi3", "microsoft/Phi-3-mini-4k-instruct", PHI3_INSTRUCT, "Phi3Config",
           {**TINY, "num_key_value_heads": 4, "original_max_position_embeddings": 256, "tie_word_embeddings": False},
           generation_eos=("<|end|>", "<|endoftext|>")),
    Family("gpt2", "openai-community/gpt2", GPT2_PLAIN, "GPT2Config",
           {"n_embd": 64, "n_inner": 128, "n_layer": 2, "n_head": 4, "n_positions": 256}),
)}


def tiny_model(family: Family, tokenizer, seed: int = 0):
    """A random model of `family`'s architecture with the tokenizer's vocabulary and special token ids."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = getattr(transformers, family.config_class)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **family.settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    eos_ids = [tokenizer.convert_tokens_to_ids(token) for token in family.generation_eos]
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=eos_ids or tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model


def build_family(home: Path, name: str, seed: int = 0) -> str:
    """`name`'s tiny model and tokenizer saved under its hub id in the HF cache at `home`; returns the id."""
    family = FAMILIES[name]
    tokenizer = build_tokenizer(family.tokenizer)
    save_model(home, family.repo_id, tiny_model(family, tokenizer, seed), tokenizer)
    return family.repo_id
