"""What users bring, built offline for tests: tokenizers in the shape of real model families, tiny random
models saved under hub ids, and chat datasets saved as hub dataset repositories store them (parquet shards
under `data/`, one file per split), all in huggingface_hub's cache layout (`tests.conftest.hub_snapshot_dir`).

The tokenizers are byte-level BPE models trained here on the toy task's text plus chat words, with each
family's special tokens and chat template. The templates are the families' published ones, trimmed of tool
calling: ChatML (Qwen2, no BOS token at all) and Llama-3's (which writes the BOS token itself).
The chat datasets are the toy sorting task in OpenRLHF's hub shapes (message lists), so the gold score still
judges what a policy learned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import hub_snapshot_dir

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerSpec:
    """A family's tokenizer shape: its special tokens (None: the family has no such token) and chat template."""

    eos: str
    bos: str | None = None
    pad: str | None = None
    unk: str | None = None
    chat_template: str | None = None
    extra_special: tuple[str, ...] = ()
    add_bos_token: bool = False  # sentencepiece-style families put BOS before every text tokenized plainly
    vocab_size: int = 512


QWEN2_CHATML = TokenizerSpec(eos="<|im_end|>", pad="<|endoftext|>", chat_template=CHATML_TEMPLATE,
                             extra_special=("<|im_start|>",))
# Llama-3's tokenizers put BOS before plain text themselves, and its template writes BOS too.
LLAMA3_INSTRUCT = TokenizerSpec(eos="<|eot_id|>", bos="<|begin_of_text|>", pad="<|end_of_text|>",
                                chat_template=LLAMA3_TEMPLATE, add_bos_token=True,
                                extra_special=("<|start_header_id|>", "<|end_header_id|>"))
LLAMA3_BASE = TokenizerSpec(eos="<|end_of_text|>", bos="<|begin_of_text|>", chat_template=LLAMA3_TEMPLATE,
                            add_bos_token=True, extra_special=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))

CORPUS_WORDS = ("sort : = user assistant system You are a helpful assistant . Hello how can I help you today ? "
                "The answer is 0 1 2 3 4 5 6 7 8 9 please digits in ascending order thanks")


def _corpus() -> list[str]:
    from rlhf_core.toy import ToySizes, make_datasets

    data = make_datasets(seed=0, sizes=ToySizes(num_sft=64, num_prefs=0, num_prompts=0, num_eval_prompts=0))
    return [CORPUS_WORDS] * 4 + [row["prompt"] + " " + row["response"] for row in data["sft"]]


def build_tokenizer(spec: TokenizerSpec):
    """A transformers fast tokenizer: byte-level BPE trained on the toy corpus, with the spec's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = [token for token in (spec.pad, spec.bos, spec.eos, spec.unk, *spec.extra_special) if token]
    backend = Tokenizer(models.BPE(unk_token=spec.unk))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=list(dict.fromkeys(special)),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_corpus(), trainer=trainer)
    if spec.add_bos_token and spec.bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B",
            special_tokens=[(spec.bos, backend.token_to_id(spec.bos))])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=spec.bos, eos_token=spec.eos,
                                        pad_token=spec.pad, unk_token=spec.unk,
                                        additional_special_tokens=list(spec.extra_special))
    if spec.chat_template:
        tokenizer.chat_template = spec.chat_template
    return tokenizer


def tiny_llama(tokenizer, seed: int = 0, tie_word_embeddings: bool = False):
    """A 2-layer Llama sized like the toy's, with the tokenizer's special token ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def save_model(home: Path, repo_id: str, model, tokenizer) -> Path:
    """`model` and `tokenizer` as the hub snapshot of `repo_id` in the cache at `home`."""
    snapshot = hub_snapshot_dir(home, "model", repo_id)
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    return snapshot


def save_dataset(home: Path, repo_id: str, splits: dict[str, list[dict]]) -> Path:
    """Rows of each split as `data/{split}-00000-of-00001.parquet`, as the hub stores a dataset repository."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    snapshot = hub_snapshot_dir(home, "dataset", repo_id)
    (snapshot / "data").mkdir()
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), snapshot / "data" / f"{split}-00000-of-00001.parquet")
    return snapshot


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


@dataclass
class ChatData:
    """The toy task in OpenRLHF's hub shapes: `sft` ({"messages": [user, assistant]}), `multiturn` (two
    exchanges in one conversation), `prefs` (chosen/rejected conversations, no prompt column, as
    OpenRLHF/preference_dataset_mixture2_and_safe_pku), `prompts` ({"context_messages": [system, user],
    "label": the sorted digits}, as OpenRLHF/prompt-collection-v0.1 with a label column)."""

    sft: list[dict] = field(default_factory=list)
    multiturn: list[dict] = field(default_factory=list)
    prefs: list[dict] = field(default_factory=list)
    prompts: list[dict] = field(default_factory=list)


SYSTEM = {"role": "system", "content": "You sort digits."}


def chat_data(seed: int = 0, num_rows: int = 64) -> ChatData:
    from rlhf_core.toy import ToySizes, make_datasets, prompt_digits

    toy = make_datasets(seed, ToySizes(num_sft=num_rows, num_prefs=num_rows, num_prompts=num_rows, num_eval_prompts=0))
    data = ChatData()
    for row in toy["sft"]:
        data.sft.append({"messages": [user(row["prompt"]), assistant(row["response"])]})
    for first, second in zip(toy["sft"][0::2], toy["sft"][1::2]):
        data.multiturn.append({"messages": [user(first["prompt"]), assistant(first["response"]),
                                            user(second["prompt"]), assistant(second["response"])]})
    for row in toy["prefs"]:
        data.prefs.append({"chosen": [user(row["prompt"]), assistant(row["chosen"])],
                           "rejected": [user(row["prompt"]), assistant(row["rejected"])]})
    for row in toy["prompts"]:
        answer = " ".join(map(str, sorted(prompt_digits(row["prompt"]))))
        data.prompts.append({"context_messages": [SYSTEM, user(row["prompt"])], "label": answer})
    return data


def openorca_rows(seed: int = 0, num_rows: int = 64) -> list[dict]:
    """The toy task in Open-Orca/OpenOrca's columns: `id`, `system_prompt`, `question`, `response` (strings)."""
    from rlhf_core.toy import ToySizes, make_datasets

    toy = make_datasets(seed, ToySizes(num_sft=num_rows, num_prefs=0, num_prompts=0, num_eval_prompts=0))
    return [{"id": f"toy.{index}", "system_prompt": SYSTEM["content"], "question": row["prompt"],
             "response": row["response"]} for index, row in enumerate(toy["sft"])]


def tiny_llama_reward_model(tokenizer, seed: int = 0, mean: float = 0.0, std: float = 1.0):
    """A reward model as OpenRLHF's RM checkpoints are laid out: a Llama backbone (`model.*`) with a one-output
    `score` head, transformers' sequence-classification layout, and the reward mean/std OpenRLHF records in
    config.json for PPO's --normalize_reward."""
    import torch
    from transformers import LlamaForSequenceClassification

    config = tiny_llama(tokenizer, seed).config
    config.num_labels = 1
    config.architectures = ["LlamaForSequenceClassification"]
    config.mean, config.std, config.normalize_reward = mean, std, False
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(config)


# OpenRLHF's example scripts' hub names, as written in them, and what each holds here.
OPENRLHF_BASE_MODEL = "meta-llama/Meta-Llama-3-8B"
OPENRLHF_SFT_MODEL = "OpenRLHF/Llama-3-8b-sft-mixture"
OPENRLHF_REWARD_MODELS = ("OpenRLHF/Llama-3-8b-rm-mixture", "OpenRLHF/Llama-3-8b-rm-700k")
OPENRLHF_SFT_DATA = "Open-Orca/OpenOrca"
OPENRLHF_PREFERENCE_DATA = "OpenRLHF/preference_dataset_mixture2_and_safe_pku"
OPENRLHF_PROMPT_DATA = "OpenRLHF/prompt-collection-v0.1"
OPENRLHF_AGENT_MODEL = "Qwen/Qwen3-1.7B"  # the multi-turn agent script's
OPENRLHF_AGENT_DATA = "OpenRLHF/gem_guess_game"


def build_openrlhf_hub(home: Path, seed: int = 0, num_rows: int = 64) -> dict[str, Path]:
    """The models and datasets OpenRLHF's example scripts name, as tiny local stand-ins in the cache at `home`:
    the base model with a Llama-3 base tokenizer, the SFT model and the reward models with a Llama-3 instruct
    tokenizer (its chat template writes BOS itself), Open-Orca rows (`question`/`response` strings), preference
    conversations (`chosen`/`rejected` message lists, no prompt column) and prompts (`context_messages` message
    lists, with a `label`); for the multi-turn agent script, a tiny Qwen3 with a ChatML tokenizer and its prompts
    (`query` strings with a `label`). Returns each repo id's snapshot folder."""
    base, instruct = build_tokenizer(LLAMA3_BASE), build_tokenizer(LLAMA3_INSTRUCT)
    data = chat_data(seed, num_rows)
    snapshots = {
        OPENRLHF_BASE_MODEL: save_model(home, OPENRLHF_BASE_MODEL, tiny_llama(base, seed), base),
        OPENRLHF_SFT_MODEL: save_model(home, OPENRLHF_SFT_MODEL, tiny_llama(instruct, seed), instruct),
        OPENRLHF_SFT_DATA: save_dataset(home, OPENRLHF_SFT_DATA, {"train": openorca_rows(seed, num_rows)}),
        OPENRLHF_PREFERENCE_DATA: save_dataset(home, OPENRLHF_PREFERENCE_DATA, {"train": data.prefs}),
        OPENRLHF_PROMPT_DATA: save_dataset(home, OPENRLHF_PROMPT_DATA, {"train": data.prompts}),
    }
    for offset, repo_id in enumerate(OPENRLHF_REWARD_MODELS, start=1):
        snapshots[repo_id] = save_model(home, repo_id, tiny_llama_reward_model(instruct, seed + offset), instruct)
    from tests.families import FAMILIES, tiny_model  # families builds on this module's tokenizers

    qwen3 = FAMILIES["qwen3"]
    chatml = build_tokenizer(qwen3.tokenizer)
    snapshots[OPENRLHF_AGENT_MODEL] = save_model(home, OPENRLHF_AGENT_MODEL, tiny_model(qwen3, chatml, seed), chatml)
    snapshots[OPENRLHF_AGENT_DATA] = save_dataset(home, OPENRLHF_AGENT_DATA, {"train": [
        {"query": row["context_messages"][-1]["content"], "label": row["label"]} for row in data.prompts]})
    return snapshots
