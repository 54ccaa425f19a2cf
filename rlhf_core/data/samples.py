"""Records to token samples (SFT samples, reward pairs, PPO prompts) as OpenRLHF's datasets make them, with or
without the tokenizer's chat template. Departs on BOS, on which end of a long PPO prompt is kept, on checking
messages, and with a warning for two of OpenRLHF's silent cuts. docs/design-notes.md ("Chat data and templates")
has the rules and the reasons.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf_core.data.records import Record
from rlhf_core.data.render import Renderer, adds_bos  # noqa: F401 - Renderer: where the stages find it
from rlhf_core.notices import warn_once
from rlhf_core.errors import UserError

if TYPE_CHECKING:  # the collates import torch when called: a preparation's worker processes need none
    import torch

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class TokenizedSample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is a training target


@dataclass(frozen=True)
class TokenizedPair:
    chosen_ids: list[int]
    rejected_ids: list[int]
    prompt_len: int = 0  # the prompt's own token count: both sequences' responses start there (DPO's loss mask)


@dataclass(frozen=True)
class TokenizedPrompt:
    value: Any  # the field as written: a string or a list of messages
    ids: list[int]  # the tokens the model sees (template, BOS where the tokenizer adds one, truncated from the left)
    bos_added: bool  # whether the first token is a BOS added here (not written by the chat template)


# ----------------------------------------------------------------------------------------------- fields
def field_value(url: str, record: Record, key: str, flag: str) -> Any:
    value = record.fields.get(key)
    if value is None:
        raise UserError(f"{record.where(url)}: no key {key!r} (choose the key with {flag}).")
    return value


def require_text(url: str, record: Record, key: str, flag: str) -> str:
    value = field_value(url, record, key, flag)
    if isinstance(value, list):
        raise UserError(f"{record.where(url)}: {key!r} is a list of messages; add --apply_chat_template to render "
                        "it with the tokenizer's chat template.")
    if not isinstance(value, str):
        raise UserError(f"{record.where(url)}: {key!r} must be a string, got {type(value).__name__}.")
    return value


def require_messages(url: str, record: Record, key: str, flag: str, value: Any = None) -> list[dict]:
    """The conversation in `key`, checked: a list of {role, content} with known roles and non-empty content."""
    value = field_value(url, record, key, flag) if value is None else value
    where = f"{record.where(url)}: {key!r}"
    if not isinstance(value, list) or not value:
        raise UserError(f"{where} must be a non-empty list of {{role, content}} messages, got "
                        f"{type(value).__name__ if value != [] else 'an empty list'}.")
    for index, message in enumerate(value, start=1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise UserError(f"{where} message {index} is not a {{role, content}} object ({str(message)[:80]}).")
        if message["role"] not in ROLES:
            raise UserError(f"{where} message {index} has role {message['role']!r}; expected one of "
                            f"{', '.join(ROLES)}.")
        if not isinstance(message["content"], str) or not message["content"].strip():
            raise UserError(f"{where} message {index} ({message['role']}) has empty content.")
    return value


def as_messages(url: str, record: Record, key: str, flag: str, role: str) -> list[dict]:
    """A conversation field as it is, a single message as a conversation of one, a string as one `role` message."""
    value = field_value(url, record, key, flag)
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return require_messages(url, record, key, flag, [value] if isinstance(value, dict) else value)


# ---------------------------------------------------------------------------------------------- tokens
def token_ids(tokenizer, text: str, max_len: int) -> list[int]:
    return tokenizer(text, add_special_tokens=False, truncation=True, max_length=max_len).input_ids


def sequence_ids(tokenizer, text: str, max_len: int) -> list[int]:
    """OpenRLHF's `__getitem__`: newlines stripped, " " + EOS unless present, truncated, the last token EOS."""
    text = text.rstrip("\n")
    if not text.endswith(tokenizer.eos_token):
        text += " " + tokenizer.eos_token
    ids = token_ids(tokenizer, text, max_len)
    ids[-1] = tokenizer.eos_token_id
    return ids


# ------------------------------------------------------------------------------------------------- SFT
def sft_texts(renderer: Renderer, record: Record, input_key: str, output_key: str | None) -> tuple[str, str]:
    """(prompt, response) text of one SFT record (OpenRLHF's `preprocess_data`)."""
    url = renderer.url
    if not renderer.apply_chat_template:
        if output_key is None:
            raise UserError("--output_key: SFT without --apply_chat_template needs the key of the response "
                            "(e.g. --output_key response); a whole conversation needs --apply_chat_template.")
        prompt = renderer.plain_prompt(require_text(url, record, input_key, "--input_key"))
        return renderer.begin(prompt), require_text(url, record, output_key, "--output_key")
    if output_key is not None:
        prompt_messages = as_messages(url, record, input_key, "--input_key", "user")
        return renderer.split(record, prompt_messages, prompt_messages + as_messages(
            url, record, output_key, "--output_key", "assistant"), (input_key, output_key))
    conversation = _conversation(renderer, record, input_key)
    return renderer.split(record, conversation[:-1], conversation, (input_key,))


def _conversation(renderer: Renderer, record: Record, input_key: str) -> list[dict]:
    value = field_value(renderer.url, record, input_key, "--input_key")
    if isinstance(value, str):
        raise UserError(f"{record.where(renderer.url)}: {input_key!r} is a string; without --output_key it must "
                        "be a whole conversation (a list of messages ending with the reply), or give --output_key.")
    conversation = require_messages(renderer.url, record, input_key, "--input_key", value)
    if len(conversation) < 2:
        raise UserError(f"{record.where(renderer.url)}: {input_key!r} holds one message; a conversation to train on "
                        "needs a prompt and a reply.")
    return conversation


def assistant_spans(renderer: Renderer, conversation: list[dict], max_len: int, record: Record | None = None,
                    keys: tuple[str, ...] = ()) -> list[tuple[int, int]]:
    """Token spans [start, end] of each assistant turn (OpenRLHF's `response_ranges`, measured the same way)."""
    spans = []
    for index, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        prompt = renderer.chat(conversation[:index], generation_prompt=True, record=record, keys=keys)
        response = renderer.chat(conversation[:index + 1], record=record, keys=keys)[len(prompt):]
        start = len(token_ids(renderer.tokenizer, prompt, max_len))
        spans.append((start, start + len(token_ids(renderer.tokenizer, response, max_len)) - 1))
    return spans


def multiturn_conversation(renderer: Renderer, record: Record, input_key: str, output_key: str | None) -> list[dict]:
    if not renderer.apply_chat_template:
        raise UserError("--multiturn needs --apply_chat_template: the turns are found through the chat template.")
    conversation = list(_conversation(renderer, record, input_key))
    if output_key is not None:  # OpenRLHF appends the output message to the conversation
        conversation += as_messages(renderer.url, record, output_key, "--output_key", "assistant")
    return conversation


def tokenize_sft(renderer: Renderer, records: list[Record], input_key: str, output_key: str | None, max_len: int,
                 multiturn: bool = False) -> list[TokenizedSample]:
    """One sample per record that fits: loss on the response (every assistant turn with `multiturn`)."""
    tokenizer, samples = renderer.tokenizer, []
    keys = (input_key,) if output_key is None else (input_key, output_key)
    for record in records:
        if multiturn:
            conversation = multiturn_conversation(renderer, record, input_key, output_key)
            prompt, response = renderer.split(record, conversation[:-1], conversation, keys)
        else:
            prompt, response = sft_texts(renderer, record, input_key, output_key)
        prompt_ids = token_ids(tokenizer, prompt, max_len)
        num_prompt = len(prompt_ids)
        if not prompt or not response or num_prompt >= max_len - 2:
            continue
        input_ids = sequence_ids(tokenizer, prompt + response, max_len)
        if input_ids[:num_prompt] != prompt_ids:
            warn_once(f"{renderer.url}: the prompt's last token merges with the response's first when tokenized "
                      f"together ({record.where(renderer.url)} and maybe others); as in OpenRLHF, the loss starts "
                      "after the prompt's own token count, so that first response token is not trained (a template "
                      "or --input_template ending in a space does this).", key=f"prompt-token-merges:{renderer.url}")
        spans = (assistant_spans(renderer, conversation, max_len, record, keys) if multiturn
                 else [(num_prompt, len(input_ids) - 1)])
        loss_mask = [0] * len(input_ids)
        for start, end in spans:
            loss_mask[start:end + 1] = [1] * len(loss_mask[start:end + 1])
        samples.append(TokenizedSample(input_ids, loss_mask))
    if not samples:
        raise UserError(f"{renderer.url}: no sample fits --max_len {max_len} (each prompt takes max_len - 2 tokens "
                        "or more, or has no response); raise --max_len.")
    return samples


def tokenize_pretraining(url: str, records: list[Record], tokenizer, input_key: str,
                         max_len: int) -> list[TokenizedSample]:
    """OpenRLHF's --pretrain_mode: each sample's text, truncated to max_len, every token a training target."""
    renderer, samples = Renderer(tokenizer, url, False), []
    for record in records:
        text = renderer.begin(require_text(url, record, input_key, "--input_key"))
        input_ids = token_ids(tokenizer, text, max_len)
        if len(input_ids) > 1:  # the first token is never predicted
            samples.append(TokenizedSample(input_ids, [1] * len(input_ids)))
    if not samples:
        raise UserError(f"{url}: no sample has two tokens to learn from (--pretrain_mode, --input_key {input_key}).")
    return samples


def collate_sft(samples: list[TokenizedSample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels (IGNORE_INDEX outside the response)."""
    import torch

    length = max(len(sample.input_ids) for sample in samples)
    input_ids = torch.full((len(samples), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids = torch.tensor(sample.input_ids)
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(torch.tensor(sample.loss_mask).bool(), ids, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# -------------------------------------------------------------------------------------------------- RM
def pair_texts(renderer: Renderer, record: Record, prompt_key: str | None, chosen_key: str,
               rejected_key: str, split_prompt: bool = False) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) text of one preference record (OpenRLHF's reward `preprocess_data`). With
    `split_prompt` (DPO's `is_dpo`), whole conversations without --prompt_key are cut after their prompt: every
    message of chosen but the last, rendered with the generation prompt, so the loss covers the replies only."""
    url = renderer.url
    if not renderer.apply_chat_template:
        prompt = "" if prompt_key is None else renderer.plain_prompt(require_text(url, record, prompt_key,
                                                                                  "--prompt_key"))
        chosen, rejected = (require_text(url, record, chosen_key, "--chosen_key"),
                            require_text(url, record, rejected_key, "--rejected_key"))
        return prompt, chosen, rejected
    if prompt_key is None and split_prompt:
        chosen_messages = require_messages(url, record, chosen_key, "--chosen_key")
        prompt_text, chosen = renderer.split(record, chosen_messages[:-1], chosen_messages, (chosen_key,))
        rejected = renderer.chat(require_messages(url, record, rejected_key, "--rejected_key"), record=record,
                                 keys=(rejected_key,))
        return prompt_text, chosen, rejected[len(prompt_text):]  # cut at the same length, as OpenRLHF
    if prompt_key is None:  # each reply is a whole conversation, rendered whole
        chosen = renderer.chat(require_messages(url, record, chosen_key, "--chosen_key"), record=record,
                               keys=(chosen_key,))
        return "", chosen, renderer.chat(require_messages(url, record, rejected_key, "--rejected_key"),
                                         record=record, keys=(rejected_key,))
    prompt_messages = as_messages(url, record, prompt_key, "--prompt_key", "user")
    prompt_text, chosen = renderer.split(record, prompt_messages, prompt_messages + as_messages(
        url, record, chosen_key, "--chosen_key", "assistant"), (prompt_key, chosen_key))
    _, rejected = renderer.split(record, prompt_messages, prompt_messages + as_messages(
        url, record, rejected_key, "--rejected_key", "assistant"), (prompt_key, rejected_key))
    return prompt_text, chosen, rejected


def warn_unused_prompt(renderer: Renderer, record: Record, prompt_key: str | None) -> None:
    if prompt_key is None and isinstance(record.fields.get("prompt"), str):
        warn_once(f"{renderer.url}: the records have a 'prompt' field, but --prompt_key is not set (OpenRLHF's "
                  "default): chosen and rejected are scored without it; pass --prompt_key prompt to use it.")


@dataclass(frozen=True)
class PairKeys:
    """The fields of a preference record: the prompt's (--prompt_key; None: the replies are whole conversations),
    the chosen and the rejected reply's; `split_prompt`: see `pair_texts`."""

    prompt_key: str | None
    chosen_key: str
    rejected_key: str
    split_prompt: bool = False


def tokenize_pairs(renderer: Renderer, records: list[Record], keys: PairKeys, max_len: int) -> list[TokenizedPair]:
    """Prompt + chosen and prompt + rejected, each ending in EOS (the reward is read there), and the prompt's own
    token count (as OpenRLHF's DPO counts it: the prompt tokenized alone, truncated to max_len)."""
    pairs = []
    for record in records:
        warn_unused_prompt(renderer, record, keys.prompt_key)
        prompt, chosen, rejected = pair_texts(renderer, record, keys.prompt_key, keys.chosen_key, keys.rejected_key,
                                              keys.split_prompt)
        pairs.append(TokenizedPair(sequence_ids(renderer.tokenizer, renderer.begin(prompt + chosen), max_len),
                                   sequence_ids(renderer.tokenizer, renderer.begin(prompt + rejected), max_len),
                                   len(token_ids(renderer.tokenizer, renderer.begin(prompt), max_len))))
    return pairs


def collate_pairs(pairs: list[TokenizedPair], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Chosen sequences first, then rejected ones, right-padded into one batch."""
    import torch

    sequences = [pair.chosen_ids for pair in pairs] + [pair.rejected_ids for pair in pairs]
    length = max(map(len, sequences))
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


# ------------------------------------------------------------------------------------------------- PPO
def prompt_text(renderer: Renderer, record: Record, input_key: str) -> str:
    """One PPO prompt as the model sees it (OpenRLHF's prompts `preprocess_data`), before any BOS of ours."""
    if renderer.apply_chat_template:
        return renderer.chat(as_messages(renderer.url, record, input_key, "--input_key", "user"),
                             generation_prompt=True, record=record, keys=(input_key,))
    return renderer.plain_prompt(require_text(renderer.url, record, input_key, "--input_key"))


def tokenize_prompts(renderer: Renderer, records: list[Record], input_key: str,
                     prompt_max_len: int) -> list[TokenizedPrompt]:
    """One prompt per record; long prompts keep their end, which holds the question (and our BOS its place)."""
    tokenizer, prompts = renderer.tokenizer, []
    for record in records:
        text = prompt_text(renderer, record, input_key)
        bos = [tokenizer.bos_token_id] if renderer.begin(text) != text else []
        ids = tokenizer(text, add_special_tokens=False).input_ids
        ids = bos + ids[max(len(ids) - (prompt_max_len - len(bos)), 0):]
        prompts.append(TokenizedPrompt(record.fields[input_key], ids, bool(bos)))
    return prompts
