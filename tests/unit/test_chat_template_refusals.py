"""A chat template that raises on a row (Gemma's "System role not supported", Mistral's rule that roles alternate)
is a UserError naming the row and the fields and quoting the template, in every stage that renders chat data;
so is a template that is not valid Jinja. tests/integration/test_bad_input.py runs the same through `rlhf`."""

from __future__ import annotations

import pytest

from rlhf_core.data.records import Record
from rlhf_core.data.samples import PairKeys, Renderer, tokenize_pairs, tokenize_prompts, tokenize_sft
from rlhf_core.errors import UserError
from tests.families import FAMILIES
from tests.hub_cache import assistant, build_tokenizer, user

URL = "chat.jsonl"
SYSTEM = {"role": "system", "content": "You sort digits."}
GOOD = [user("sort : 2 1 ="), assistant("1 2")]


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {name: build_tokenizer(FAMILIES[name].tokenizer) for name in ("gemma", "mistral")}


def rows(*fields: dict) -> list[Record]:
    return [Record(line, row) for line, row in enumerate(fields, start=1)]


def refusal(call) -> str:
    with pytest.raises(UserError) as raised:
        call()
    return str(raised.value)


def test_sft_rows_the_template_refuses_name_the_row_the_field_and_the_template_words(tokenizers):
    gemma = Renderer(tokenizers["gemma"], URL, apply_chat_template=True)
    message = refusal(lambda: tokenize_sft(gemma, rows({"messages": GOOD}, {"messages": [SYSTEM, *GOOD]}),
                                           "messages", None, 64))
    assert message == ("chat.jsonl line 2: the tokenizer's chat template refused 'messages' with \"System role not "
                       "supported\"; change the row to a conversation the template accepts.")
    mistral = Renderer(tokenizers["mistral"], URL, apply_chat_template=True)
    message = refusal(lambda: tokenize_sft(mistral, rows({"prompt": [user("a"), user("b")], "response": "c"}),
                                           "prompt", "response", 64))
    assert message.startswith("chat.jsonl line 1: the tokenizer's chat template refused 'prompt' and 'response' "
                              "with \"After the optional system message, conversation roles must alternate")
    multiturn = rows({"messages": [*GOOD, assistant("3 4")]})
    assert "line 1" in refusal(lambda: tokenize_sft(mistral, multiturn, "messages", None, 64, multiturn=True))


def test_reward_pairs_and_ppo_prompts_the_template_refuses(tokenizers):
    gemma = Renderer(tokenizers["gemma"], URL, apply_chat_template=True)
    pairs = rows({"chosen": GOOD, "rejected": [SYSTEM, *GOOD]})
    assert "line 1: the tokenizer's chat template refused 'rejected' with" in refusal(
        lambda: tokenize_pairs(gemma, pairs, PairKeys(None, "chosen", "rejected"), 64))
    prompted = rows({"prompt": [SYSTEM, user("sort : 2 1 =")], "chosen": "1 2", "rejected": "2 1"})
    assert "'prompt' and 'chosen' with \"System role not supported\"" in refusal(
        lambda: tokenize_pairs(gemma, prompted, PairKeys("prompt", "chosen", "rejected"), 64))
    prompts = rows({"prompt": "sort : 2 1 ="}, {"prompt": [SYSTEM, user("sort : 3 1 =")]})
    assert "chat.jsonl line 2: the tokenizer's chat template refused 'prompt'" in refusal(
        lambda: tokenize_prompts(gemma, prompts, "prompt", 32))


def test_a_template_that_breaks_is_one_sentence_too(tokenizers):
    tokenizer = build_tokenizer(FAMILIES["qwen2"].tokenizer)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] + 1 }}{% endfor %}"
    renderer = Renderer(tokenizer, URL, apply_chat_template=True)
    message = refusal(lambda: tokenize_prompts(renderer, rows({"prompt": "a"}), "prompt", 32))
    assert message.startswith("chat.jsonl line 1: the tokenizer's chat template refused 'prompt' with \"TypeError: ")
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}"  # no endfor
    message = refusal(lambda: tokenize_prompts(renderer, rows({"prompt": "a"}), "prompt", 32))
    assert message.startswith("the tokenizer's chat template (--pretrain's, or --tokenizer_chat_template) is not "
                              "valid Jinja: ") and message.endswith(".")
