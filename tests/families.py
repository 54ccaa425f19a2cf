"""Model families beyond Llama, as tiny random models saved under their hub ids in a local HF cache.

Each `Family` declares what makes it different for a training pipeline, all taken from its published
config and tokenizer files (sizes aside):
- qwen2 (Qwen2.5-0.5B-Instruct): ChatML, no BOS token, tied embeddings, q/k/v biases, and a generation config
  whose `eos_token_id` is a list;
- qwen3 (Qwen3-0.6B): ChatML, tied embeddings, q/k norms and an explicit head_dim;
- mistral (Mistral-7B-Instruct-v0.3): `[INST]` template that writes BOS `<s>` and refuses a conversation whose
  roles do not alternate user/assistant after an optional system message, no pad token;
- gemma (gemma-2b-it): `<start_of_turn>` template that writes BOS `<bos>` and refuses a system message and roles
  that do not alternate, tied and scaled embeddings, one key/value head, GeLU MLP;
- phi3 (Phi-3-mini-4k-instruct): fused `qkv_proj` and `gate_up_proj`, `<|user|>`/`<|end|>` template;
- gpt2 (openai-community/gpt2): Conv1D layers instead of nn.Linear, tied embeddings, `<|endoftext|>` as its
  only special token (BOS = EOS = UNK), no pad token and no chat template.
Every model has 2 layers and hidden size 64, so each training step takes milliseconds on a CPU.
Mistral's and Gemma's chat templates are the ones their hub repositories ship (tests/chat_templates/), not
simplified: users have them, `raise_exception` included, so data the real template refuses fails a test here
too. Gemma's data puts the system prompt in the first user message (`Family.system_role`), as Gemma's users do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tests.hub_cache import QWEN2_CHATML, TokenizerSpec, build_tokenizer, save_model

TEMPLATES = Path(__file__).parent / "chat_templates"
MISTRAL_TEMPLATE = (TEMPLATES / "mistral-7b-instruct-v0.3.jinja").read_text()
GEMMA_TEMPLATE = (TEMPLATES / "gemma-2b-it.jinja").read_text()
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
    """One architecture: the hub id it is saved under, its tokenizer, its config class and settings, the
    tokens its generation config lists as EOS (more than one: a list, as Qwen2's), and whether its chat template
    takes a system message."""

    name: str
    repo_id: str
    tokenizer: TokenizerSpec
    config_class: str
    settings: dict = field(default_factory=dict)
    generation_eos: tuple[str, ...] = ()
    system_role: bool = True  # False: the chat template raises on a system message (Gemma's)


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
           {**TINY, "num_key_value_heads": 1, "head_dim": 16, "tie_word_embeddings": True}, system_role=False),
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
