"""A tiny model, tokenizer and toy datasets with a gold score, for the demo and the tests.

The task: a prompt "sort : 5 3 8 =" asks for its digits in ascending order ("3 5 8"). The gold
score of a response is the fraction of positions holding the right digit, so later stages can show
that RLHF improves a policy without any model hub. Everything is generated from a seed, offline.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from rlhf_core.errors import UserError

DIGITS = [str(d) for d in range(10)]
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = ["sort", ":", "=", "user", "assistant"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def build_tokenizer():
    """A word-level tokenizer over the toy vocabulary, as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + WORDS + DIGITS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins word tokens with spaces
    # BOS before plain text, as Llama's tokenizers put it (the chat template writes none)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(vocab_size: int, seed: int):
    """A 2-layer Llama of about 0.1M parameters: big enough to learn sorting, small enough for CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def make_prompt(digits: list[int]) -> str:
    return "sort : " + " ".join(map(str, digits)) + " ="


def prompt_digits(prompt: str) -> list[int]:
    body = prompt.split(":", 1)[-1].rsplit("=", 1)[0]
    return [int(token) for token in body.split() if token.isdigit()]


def gold_score(prompt: str, response: str) -> float:
    """Fraction of positions where the response holds the right digit (extra tokens count as wrong)."""
    target = [str(d) for d in sorted(prompt_digits(prompt))]
    produced = response.split()
    matches = sum(1 for want, got in zip(target, produced) if want == got)
    return matches / max(len(target), len(produced), 1)


def _corrupt(digits: list[int], rng: random.Random) -> list[int]:
    """A plausible wrong answer: two positions swapped, or one digit replaced."""
    wrong = list(digits)
    if len(wrong) > 1 and rng.random() < 0.5:
        i, j = rng.sample(range(len(wrong)), 2)
        wrong[i], wrong[j] = wrong[j], wrong[i]
    else:
        wrong[rng.randrange(len(wrong))] = rng.randrange(10)
    return wrong if wrong != digits else list(reversed(digits)) + [rng.randrange(10)]


def _random_digits(rng: random.Random) -> list[int]:
    return [rng.randrange(10) for _ in range(rng.randint(3, 6))]


@dataclass(frozen=True)
class ToySizes:
    """How many rows each toy dataset gets (`make_datasets`)."""

    num_sft: int = 256
    num_prefs: int = 256
    num_prompts: int = 256
    num_eval_prompts: int = 64


def make_datasets(seed: int, sizes: ToySizes = ToySizes(), noise: float = 0.1,
                  verbose: float = 0.6) -> dict[str, list[dict]]:
    """SFT pairs, preference triples, RL prompts and held-out evaluation prompts.

    The SFT data carries a habit RLHF should remove: a `verbose` fraction of answers end with a
    spurious " =" (which the gold score counts as a wrong token), and a `noise` fraction are wrong.
    Preferences always choose the right, plain answer over a corrupted or verbose one.
    """
    rng = random.Random(seed)
    sft = []
    for _ in range(sizes.num_sft):
        digits = _random_digits(rng)
        answer = " ".join(map(str, sorted(digits) if rng.random() >= noise else _corrupt(sorted(digits), rng)))
        sft.append({"prompt": make_prompt(digits), "response": answer + (" =" if rng.random() < verbose else "")})
    prefs = []
    for _ in range(sizes.num_prefs):
        digits = _random_digits(rng)
        right = sorted(digits)
        rejected = " ".join(map(str, right)) + " =" if rng.random() < 0.5 else " ".join(map(str, _corrupt(right, rng)))
        prefs.append({"prompt": make_prompt(digits), "chosen": " ".join(map(str, right)), "rejected": rejected})
    prompts = [{"prompt": make_prompt(_random_digits(rng))} for _ in range(sizes.num_prompts)]
    eval_prompts = [{"prompt": make_prompt(_random_digits(rng))} for _ in range(sizes.num_eval_prompts)]
    return {"sft": sft, "prefs": prefs, "prompts": prompts, "eval_prompts": eval_prompts}


STEP_PLACEHOLDER, STEP_GOOD, STEP_BAD = "user", "1", "0"  # the PRM's tokens (Math-Shepherd's: ки, +, -)


def step_labelled_rows(num_rows: int, seed: int) -> list[dict]:
    """PRM data in Math-Shepherd's shape: `sort : 3 1 2 = 1 user 5 user 3 user` with `value` labels 1 0 1, each
    step labelled by whether its digit is the sorted list's digit there; 40% of the steps hold a random digit."""
    rng, rows = random.Random(seed), []
    for _ in range(num_rows):
        digits = [rng.randrange(10) for _ in range(rng.randint(3, 5))]
        right = sorted(digits)
        answer = [(d + rng.randint(1, 9)) % 10 if rng.random() < 0.4 else d for d in right]
        labels = [STEP_GOOD if given == expected else STEP_BAD for given, expected in zip(answer, right)]
        text = f"sort : {' '.join(map(str, digits))} = " + " ".join(f"{d} {STEP_PLACEHOLDER}" for d in answer)
        rows.append({"input": text, "value": labels})
    return rows


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def init_toy(directory: str, seed: int = 0) -> dict[str, str]:
    """Write model/ (HF model + tokenizer), sft.jsonl, prefs.jsonl, prompts.jsonl, eval_prompts.jsonl and
    steps.jsonl (step-labelled answers for a process reward model)."""
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise UserError(f"{directory} is a file; give a folder for the toy model and data (rlhf toy init DIR).")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"{directory}: cannot create the folder ({error.strerror}); give a writable folder.") from None
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    paths = {"model": str(root / "model")}
    datasets = {**make_datasets(seed), "steps": step_labelled_rows(256, seed)}  # steps: for rlhf/prm
    for name, records in datasets.items():
        _write_jsonl(root / f"{name}.jsonl", records)
        paths[name] = str(root / f"{name}.jsonl")
    return paths


def gold_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """The gold score as a verifiable reward, for `--reward_fn rlhf_core.toy:gold_reward`."""
    return [gold_score(prompt, response) for prompt, response in zip(prompts, responses)]
