"""Each stage's batch job (one tokenizer call per batch) against today's per-row functions (one call per text),
token for token, on tokenizers with and without BOS, chat templates, long texts that truncate, prompts cut from
the left, and the errors a bad row raises in the middle of a batch."""

from __future__ import annotations

import pytest

from rlhf_core.data.encoding import BatchEncoder
from rlhf_core.data.pairs import PairBatches
from rlhf_core.data.prompts import PromptBatches
from rlhf_core.data.records import Record
from rlhf_core.data.samples import PairKeys, Renderer, tokenize_pairs, tokenize_prompts
from rlhf_core.data.step_labels import StepLabelBatches, tokenize_step_labels
from rlhf_core.errors import UserError
from tests.hub_cache import LLAMA3_BASE, LLAMA3_INSTRUCT, QWEN2_CHATML, SYSTEM, assistant, build_tokenizer, user

SPECS = {"chatml": QWEN2_CHATML, "llama3": LLAMA3_INSTRUCT, "llama3-base": LLAMA3_BASE}
WORDS = "sort the numbers 3 1 2 and then 5 4 please reply with the answer\n".split(" ")


@pytest.fixture(scope="module", params=list(SPECS))
def tokenizer(request):
    return build_tokenizer(SPECS[request.param])


def text(i: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 23)) + ("\n\n" if i % 5 == 0 else "")


def records(rows: list[dict]) -> list[Record]:
    return [Record(line, row) for line, row in enumerate(rows, start=1)]


@pytest.mark.parametrize("chat,prompt_key,split_prompt", [(False, "prompt", False), (False, None, False),
                                                        (True, None, False), (True, None, True),
                                                        (True, "prompt", False)])
def test_pairs_are_tokenize_pairs(tokenizer, chat, prompt_key, split_prompt):
    if chat and prompt_key is None:
        rows = [{"chosen": [SYSTEM, user(text(i)), assistant(text(i + 1))],
                 "rejected": [user(text(i)), assistant(text(i + 2))]} for i in range(40)]
    elif chat:
        rows = [{"prompt": [user(text(i))], "chosen": [assistant(text(i + 1))], "rejected": text(i + 3)}
                for i in range(40)]
    else:
        rows = [{"prompt": text(i), "chosen": text(i + 1), "rejected": text(i + 2), "margin": i} for i in range(40)]
    renderer = Renderer(tokenizer, "prefs.jsonl", chat, None if chat else "Q: {} A:")
    columns = PairBatches(renderer, prompt_key, "chosen", "rejected", 24, False, split_prompt)(records(rows))
    todays = tokenize_pairs(renderer, records(rows), PairKeys(prompt_key, "chosen", "rejected", split_prompt), 24)
    assert columns["chosen_ids"] == [pair.chosen_ids for pair in todays]
    assert columns["rejected_ids"] == [pair.rejected_ids for pair in todays]
    assert columns["prompt_len"] == [pair.prompt_len for pair in todays]
    assert any(len(pair.chosen_ids) == 24 for pair in todays)  # truncation is exercised


@pytest.mark.parametrize("chat", [False, True])
def test_prompts_are_tokenize_prompts(tokenizer, chat):
    rows = [{"q": [user(text(i))] if chat and i % 2 else text(i), "label": i} for i in range(40)]
    renderer = Renderer(tokenizer, "prompts.jsonl", chat)
    for max_len in (4, 512):  # cut from the left, and whole
        columns = PromptBatches(renderer, "q", max_len, "label")(records(rows))
        todays = tokenize_prompts(renderer, records(rows), "q", max_len)
        assert columns["ids"] == [prompt.ids for prompt in todays]
        assert columns["bos_added"] == [prompt.bos_added for prompt in todays]
        assert columns["text"] == [prompt.value for prompt in todays] and columns["label"] == list(range(40))


class _PRMConfig:
    input_key, label_key, reward_tokens, max_len = "input", "value", ["+", "-"], 20

    def __init__(self, placeholder_token: str):
        self.placeholder_token = placeholder_token


def test_step_labels_are_todays_and_a_bad_row_is_named_as_today(tokenizer):
    step = tokenizer.eos_token  # one token in every tokenizer here
    cfg = _PRMConfig(step)
    rows = [{"input": f" {step} ".join(text(i).split()[:1 + i % 4]) + f" {step}", "value": ["+", "-", "+"][:1 + i % 3]}
            for i in range(30)]
    job = StepLabelBatches("steps.jsonl", tokenizer, cfg)
    columns = job(records(rows))
    todays = tokenize_step_labels("steps.jsonl", records(rows), tokenizer, cfg)
    assert columns["input_ids"] == [sample.input_ids for sample in todays]
    assert columns["labels"] == [sample.labels for sample in todays]
    # a bad label in row 4 comes before a row without text in row 6: row 4's sentence, as one row at a time
    bad = rows[:3] + [{**rows[3], "value": ["?"]}, rows[4], {"value": ["+"]}]
    with pytest.raises(UserError, match="line 4: step label '\\?'"):
        job(records(bad))


def test_the_encoder_is_transformers_call(tokenizer):
    texts = [text(i) for i in range(30)] + ["", " ", "\n"]
    for max_len in (3, 16, None):
        limits = {} if max_len is None else {"truncation": True, "max_length": max_len}
        assert BatchEncoder(tokenizer, max_len)(texts) == [
            tokenizer(one, add_special_tokens=False, **limits).input_ids for one in texts]


def test_plain_messages_render_as_apply_chat_template(tokenizer):
    """The renderer's own render of plain {role, content} messages (transformers' conversion skipped) equals
    apply_chat_template, with and without the generation prompt; other messages go through transformers."""
    renderer = Renderer(tokenizer, "d.jsonl", True)
    conversations = [[user(text(i)), assistant(text(i + 1))] for i in range(5)] + [[SYSTEM, user("a b")],
                                                                                   [user("x"), {**assistant("y"),
                                                                                                "name": "n"}]]
    for conversation in conversations:
        for generation_prompt in (False, True):
            assert renderer.chat(conversation, generation_prompt) == tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=generation_prompt)
