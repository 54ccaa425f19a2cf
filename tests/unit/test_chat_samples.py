"""Chat data in every stage, held token for token against OpenRLHF's datasets.

`openrlhf_*` below transcribe what OpenRLHF 0.9.10 / 0.11 do (`preprocess_data`, `process_data`, `__getitem__`,
`get_loss_mask` of sft_dataset.py, reward_dataset.py and prompts_dataset.py), in their own terms: OpenRLHF's
loss mask is aligned with the logits (position i trains token i + 1), ours with the tokens, so token j is
trained here exactly when OpenRLHF's mask is 1 at j - 1. The fixtures are byte-level BPE tokenizers with a
ChatML template (Qwen2: no BOS token at all) and Llama-3's template (which writes BOS itself, while the
tokenizer also adds BOS to plain text).
"""

from __future__ import annotations

import copy
import json

import pytest

from rlhf_core.data.records import Record
from rlhf_core.data.stream import RecordStream, read_records
from rlhf_core.errors import UserError
from rlhf_core.data.samples import PairKeys, Renderer, tokenize_pairs, tokenize_prompts, tokenize_sft
from tests.hub_cache import (LLAMA3_BASE, LLAMA3_INSTRUCT, QWEN2_CHATML, SYSTEM, assistant, build_tokenizer,
                             save_dataset, user)

MAX_LEN = 96
SPECS = {"chatml": QWEN2_CHATML, "llama3": LLAMA3_INSTRUCT, "llama3-base": LLAMA3_BASE}


@pytest.fixture(scope="module", params=list(SPECS))
def tokenizer(request):
    return build_tokenizer(SPECS[request.param])


def _ids(tokenizer, text: str, max_len: int = MAX_LEN) -> list[int]:
    return tokenizer(text, max_length=max_len, padding=False, truncation=True, add_special_tokens=False)["input_ids"]


def _openrlhf_sequence(tokenizer, text: str, max_len: int) -> list[int]:
    text = text.rstrip("\n")
    if not text.endswith(tokenizer.eos_token):
        text += " " + tokenizer.eos_token
    ids = _ids(tokenizer, text, max_len)
    ids[-1] = tokenizer.eos_token_id
    return ids


def openrlhf_sft(tokenizer, data: dict, input_key: str, output_key: str | None, multiturn: bool = False,
                 max_len: int = MAX_LEN):
    """(input_ids, our loss mask) as OpenRLHF's SFTDataset with --apply_chat_template, or None if it drops it."""
    apply, data = tokenizer.apply_chat_template, copy.deepcopy(data)
    ranges = []
    if multiturn:
        if output_key:
            data[input_key].append(data[output_key])
            output_key = None
        for idx, message in enumerate(data[input_key]):
            if message["role"] == "assistant":
                prompt = apply(data[input_key][:idx], tokenize=False, add_generation_prompt=True)
                response = apply(data[input_key][: idx + 1], tokenize=False)[len(prompt):]
                start = len(_ids(tokenizer, prompt, max_len))
                ranges.append((start, start + len(_ids(tokenizer, response, max_len)) - 1))
    if output_key:
        prompt_message, response_message = data[input_key], data[output_key]
        if isinstance(prompt_message, str) and isinstance(response_message, str):
            prompt_message = [{"role": "user", "content": prompt_message}]
            response_message = [{"role": "assistant", "content": response_message}]
        prompt = apply(prompt_message, tokenize=False, add_generation_prompt=True)
        response = apply(prompt_message + response_message, tokenize=False)[len(prompt):]
    else:
        prompt = apply(data[input_key][:-1], tokenize=False, add_generation_prompt=True)
        response = apply(data[input_key], tokenize=False)[len(prompt):]
    prompt_ids_len = len(_ids(tokenizer, prompt, max_len))
    if not prompt or not response or prompt_ids_len >= max_len - 2:
        return None
    input_ids = _openrlhf_sequence(tokenizer, prompt + response, max_len)
    mask = [0] * len(input_ids)
    if not multiturn:
        mask[prompt_ids_len - 1: -1] = [1] * len(mask[prompt_ids_len - 1: -1])
    for start, end in ranges:
        mask[start - 1: end] = [1] * len(mask[start - 1: end])
    return input_ids, [0] + mask[:-1]


def records_of(*rows: dict) -> list[Record]:
    return [Record(index, row, "row") for index, row in enumerate(rows, start=1)]


def ours_sft(tokenizer, rows, input_key, output_key, multiturn=False, max_len=MAX_LEN):
    renderer = Renderer(tokenizer, "data.parquet", True)
    return [(s.input_ids, s.loss_mask) for s in tokenize_sft(renderer, records_of(*rows), input_key, output_key,
                                                             max_len, multiturn)]


def trained_text(tokenizer, ids, mask) -> str:
    return tokenizer.decode([token for token, keep in zip(ids, mask) if keep])


SFT_SHAPES = {
    "strings": ({"q": "sort : 3 1 2 =", "a": "1 2 3"}, "q", "a"),
    "message lists": ({"q": [SYSTEM, user("sort : 3 1 2 =")], "a": [assistant("1 2 3")]}, "q", "a"),
    "a conversation, no output_key": ({"messages": [user("sort : 3 1 2 ="), assistant("1 2 3")]}, "messages", None),
}


@pytest.mark.parametrize("shape", list(SFT_SHAPES))
def test_sft_matches_openrlhf(tokenizer, shape):
    row, input_key, output_key = SFT_SHAPES[shape]
    [(ids, mask)] = ours_sft(tokenizer, [row], input_key, output_key)
    assert (ids, mask) == openrlhf_sft(tokenizer, row, input_key, output_key)
    trained = trained_text(tokenizer, ids, mask).replace(" ", "")
    assert trained.startswith("123") and trained.endswith(tokenizer.eos_token) and "sort" not in trained
    if tokenizer.bos_token is not None:  # Llama-3: the template's BOS, and no second one
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    else:
        assert tokenizer.convert_ids_to_tokens(ids[0]) == "<|im_start|>"


def test_multiturn_trains_every_assistant_turn(tokenizer):
    conversation = [user("sort : 2 1 ="), assistant("1 2"), user("sort : 9 8 7 ="), assistant("7 8 9")]
    row = {"messages": conversation}
    [(ids, mask)] = ours_sft(tokenizer, [row], "messages", None, multiturn=True)
    assert (ids, mask) == openrlhf_sft(tokenizer, row, "messages", None, multiturn=True)
    trained = trained_text(tokenizer, ids, mask)
    assert trained.replace(" ", "").startswith("12") and "789" in trained.replace(" ", "") and "sort" not in trained
    [(_, last_only)] = ours_sft(tokenizer, [row], "messages", None)
    assert sum(last_only) < sum(mask)
    # OpenRLHF's other multiturn shape: the last reply in --output_key, appended to the conversation
    split = {"messages": conversation[:-1], "reply": conversation[-1]}
    assert ours_sft(tokenizer, [split], "messages", "reply", multiturn=True) == [(ids, mask)]


def test_sft_drops_what_openrlhf_drops(tokenizer):
    long_prompt = {"q": "sort : " + " ".join("9" * 60) + " =", "a": "9"}
    assert openrlhf_sft(tokenizer, long_prompt, "q", "a", max_len=32) is None
    fitting = {"q": "sort : 1 =", "a": "1"}
    assert len(ours_sft(tokenizer, [long_prompt, fitting], "q", "a", max_len=32)) == 1
    with pytest.raises(UserError, match="no sample fits --max_len 32"):
        ours_sft(tokenizer, [long_prompt], "q", "a", max_len=32)


def openrlhf_pair(tokenizer, data, prompt_key, max_len=MAX_LEN):
    apply = tokenizer.apply_chat_template
    if prompt_key:
        prompt = apply(data[prompt_key], tokenize=False, add_generation_prompt=True)
        chosen = apply(data[prompt_key] + data["chosen"], tokenize=False)[len(prompt):]
        rejected = apply(data[prompt_key] + data["rejected"], tokenize=False)[len(prompt):]
    else:
        prompt, chosen, rejected = "", apply(data["chosen"], tokenize=False), apply(data["rejected"], tokenize=False)
    return (_openrlhf_sequence(tokenizer, prompt + chosen, max_len),
            _openrlhf_sequence(tokenizer, prompt + rejected, max_len))


@pytest.mark.parametrize("prompt_key", [None, "prompt"])
def test_reward_pairs_match_openrlhf(tokenizer, prompt_key):
    question = [SYSTEM, user("sort : 3 1 2 =")]
    if prompt_key is None:  # OpenRLHF's default: the prompt lives inside each conversation
        row = {"chosen": question + [assistant("1 2 3")], "rejected": question + [assistant("3 2 1")]}
    else:
        row = {"prompt": question, "chosen": [assistant("1 2 3")], "rejected": [assistant("3 2 1")]}
    [pair] = tokenize_pairs(Renderer(tokenizer, "prefs.parquet", True), records_of(row),
                            PairKeys(prompt_key, "chosen", "rejected"), MAX_LEN)
    assert (pair.chosen_ids, pair.rejected_ids) == openrlhf_pair(tokenizer, row, prompt_key)
    assert pair.chosen_ids[-1] == tokenizer.eos_token_id and pair.chosen_ids != pair.rejected_ids
    assert pair.chosen_ids.count(tokenizer.bos_token_id) == (tokenizer.bos_token_id is not None)


def test_dpo_pairs_of_whole_conversations_are_cut_after_their_prompt_as_openrlhf(tokenizer):
    """OpenRLHF's train_dpo_llama.sh: conversations without --prompt_key. OpenRLHF's `is_dpo` renders every message
    of chosen but the last with the generation prompt as the prompt, and cuts both replies at its length: the
    loss covers the replies only (the RM scores the conversations whole)."""
    question = [SYSTEM, user("sort : 3 1 2 =")]
    row = {"chosen": question + [assistant("1 2 3")], "rejected": question + [assistant("3 2 1")]}
    apply = tokenizer.apply_chat_template
    prompt = apply(row["chosen"][:-1], tokenize=False, add_generation_prompt=True)
    chosen, rejected = (apply(row[key], tokenize=False)[len(prompt):] for key in ("chosen", "rejected"))
    [pair] = tokenize_pairs(Renderer(tokenizer, "prefs.parquet", True), records_of(row),
                            PairKeys(None, "chosen", "rejected", split_prompt=True), MAX_LEN)
    assert (pair.chosen_ids, pair.rejected_ids) == (_openrlhf_sequence(tokenizer, prompt + chosen, MAX_LEN),
                                                    _openrlhf_sequence(tokenizer, prompt + rejected, MAX_LEN))
    assert pair.prompt_len == len(_ids(tokenizer, prompt)) > 0


def test_reward_pairs_of_strings_through_the_chat_template(tokenizer):
    """Strings with --prompt_key and --apply_chat_template: each string is one message (OpenRLHF would hand the
    template a concatenated string), so the pair equals the conversation form token for token."""
    strings = {"prompt": "sort : 3 1 2 =", "chosen": "1 2 3", "rejected": "3 2 1"}
    messages = {"prompt": [user("sort : 3 1 2 =")], "chosen": [assistant("1 2 3")], "rejected": [assistant("3 2 1")]}
    renderer = Renderer(tokenizer, "prefs.jsonl", True)
    [from_strings] = tokenize_pairs(renderer, records_of(strings), PairKeys("prompt", "chosen", "rejected"), MAX_LEN)
    assert (from_strings.chosen_ids, from_strings.rejected_ids) == openrlhf_pair(tokenizer, messages, "prompt")


@pytest.mark.parametrize("value", [[SYSTEM, user("sort : 3 1 2 ="), assistant("1 2 3"), user("and 5 4 =")],
                                   "sort : 3 1 2 ="])
def test_ppo_prompts_match_openrlhf(tokenizer, value):
    chat = [{"role": "user", "content": value}] if isinstance(value, str) else value
    expected = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False).input_ids
    [prompt] = tokenize_prompts(Renderer(tokenizer, "prompts.parquet", True), records_of({"context_messages": value}),
                                "context_messages", 256)
    assert prompt.ids == expected and prompt.value == value and not prompt.bos_added
    [short] = tokenize_prompts(Renderer(tokenizer, "prompts.parquet", True), records_of({"context_messages": value}),
                               "context_messages", 8)
    assert short.ids == expected[-8:]  # the end holds the question (a departure: OpenRLHF keeps the start)


def test_plain_text_gets_the_bos_its_tokenizer_adds():
    """Without a chat template: BOS where the tokenizer itself adds one (Llama-3), none where it has none (Qwen)."""
    row = {"q": "sort : 3 1 2 =", "a": "1 2 3"}
    for spec, has_bos in ((LLAMA3_BASE, True), (QWEN2_CHATML, False)):
        tokenizer = build_tokenizer(spec)
        [sample] = tokenize_sft(Renderer(tokenizer, "d.jsonl", False), records_of(row), "q", "a", MAX_LEN)
        assert (sample.input_ids[0] == tokenizer.bos_token_id) == has_bos
        assert sample.input_ids.count(tokenizer.bos_token_id) == has_bos
        [prompt] = tokenize_prompts(Renderer(tokenizer, "d.jsonl", False), records_of(row), "q", MAX_LEN)
        assert prompt.bos_added == has_bos


def test_a_replacement_chat_template_renders_message_lists(caplog):
    """--tokenizer_chat_template's template renders the messages. This one's generation prompt ends in a space,
    which BPE merges into the first response token: OpenRLHF then leaves that token untrained; so do we (the
    same tokens), with a warning."""
    tokenizer = build_tokenizer(QWEN2_CHATML)
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}" \
                              "{% if add_generation_prompt %}[assistant] {% endif %}"
    row = {"messages": [user("sort : 2 1 ="), assistant("1 2")]}
    [(ids, mask), _] = ours_sft(tokenizer, [row, {"messages": [user("sort : 3 1 ="), assistant("1 3")]}],
                                "messages", None)
    assert (ids, mask) == openrlhf_sft(tokenizer, row, "messages", None)
    assert tokenizer.decode(ids).startswith("[user] sort : 2 1 =\n[assistant] 1 2")
    assert trained_text(tokenizer, ids, mask).strip() == "2 <|im_end|>"
    assert caplog.text.count("the prompt's last token merges with the response's first") == 1  # not one per row


MALFORMED = [
    ({"messages": {"role": "user", "content": "hi"}}, r"'messages' must be a non-empty list of \{role, content\}"),
    ({"messages": []}, r"'messages' must be a non-empty list .* got an empty list"),
    ({"messages": [user("hi"), {"content": "x"}]}, r"'messages' message 2 is not a \{role, content\} object"),
    ({"messages": [user("hi"), {"role": "bot", "content": "x"}]}, r"'messages' message 2 has role 'bot'; expected"),
    ({"messages": [user("hi"), assistant("")]}, r"'messages' message 2 \(assistant\) has empty content"),
    ({"messages": [user("hi")]}, r"'messages' holds one message"),
    ({"messages": "just text"}, r"'messages' is a string; without --output_key"),
]


@pytest.mark.parametrize("row, message", MALFORMED)
def test_malformed_messages_name_file_line_and_field(tmp_path, row, message):
    path = tmp_path / "chat.jsonl"
    good = {"messages": [user("sort : 1 ="), assistant("1")]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(UserError, match=rf"^{path} line 2: {message}"):
        tokenize_sft(Renderer(build_tokenizer(QWEN2_CHATML), str(path), True), read_records(str(path)), "messages",
                     None, MAX_LEN)


def test_message_lists_need_the_chat_template(tmp_path):
    tokenizer = build_tokenizer(QWEN2_CHATML)
    rows = records_of({"context_messages": [user("sort : 1 =")]})
    with pytest.raises(UserError, match=r"row 1: 'context_messages' is a list of messages; add --apply_chat_template"):
        tokenize_prompts(Renderer(tokenizer, "p.parquet", False, "Q: {}"), rows, "context_messages", 64)
    with pytest.raises(UserError, match=r"^--output_key: SFT without --apply_chat_template needs the key"):
        tokenize_sft(Renderer(tokenizer, "p.parquet", False), rows, "context_messages", None, 64)
    with pytest.raises(UserError, match=r"^--multiturn needs --apply_chat_template"):
        tokenize_sft(Renderer(tokenizer, "p.parquet", False), rows, "context_messages", None, 64, multiturn=True)
    no_template = build_tokenizer(QWEN2_CHATML)
    no_template.chat_template = None
    with pytest.raises(UserError, match=r"^--apply_chat_template: the tokenizer of --pretrain has no chat template"):
        Renderer(no_template, "p.parquet", True)


def test_hub_dataset_splits_and_data_dir_from_the_cache(tmp_path, monkeypatch):
    """A dataset repository as the hub stores it (parquet shards under data/, one per split, and a folder of its
    own for a subset), read offline from the local cache: --dataset_split / --eval_split, and name@data_dir."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    home = tmp_path / "hf"
    snapshot = save_dataset(home, "OpenRLHF/preference_dataset_mixture2_and_safe_pku", {
        "train": [{"chosen": [user("a"), assistant("b")], "rejected": [user("a"), assistant("c")]}] * 3,
        "test": [{"chosen": [user("t"), assistant("u")], "rejected": [user("t"), assistant("v")]}]})
    (snapshot / "safe").mkdir()
    pq.write_table(pa.Table.from_pylist([{"chosen": [user("s"), assistant("1")], "rejected": [user("s"),
                                                                                             assistant("2")]}]),
                   snapshot / "safe" / "train-00000-of-00001.parquet")
    for name, value in {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}.items():
        monkeypatch.setenv(name, value)
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    name = "OpenRLHF/preference_dataset_mixture2_and_safe_pku"
    assert len(read_records(name)) == 3
    [test_row] = read_records(RecordStream(name, None, split="test", flag="--eval_dataset"))
    assert test_row.fields["chosen"][0]["content"] == "t" and test_row.unit == "row"
    [safe] = read_records(f"{name}@safe")
    assert safe.fields["chosen"][1]["content"] == "1"
    [pair] = tokenize_pairs(Renderer(build_tokenizer(QWEN2_CHATML), name, True), [safe],
                            PairKeys(None, "chosen", "rejected"), MAX_LEN)
    assert pair.chosen_ids[-1] != pair.rejected_ids[-2]
    with pytest.raises(UserError, match=r"--dataset: OpenRLHF/preference_dataset_mixture2_and_safe_pku@nope: the "
                                        r"cached dataset has no folder 'nope'"):
        read_records(f"{name}@nope")
