"""A tokenizer snapshot (`rlhf_core.data.tokenizer_snapshot`) encodes as the tokenizer it was taken of, for every
family's tokenizer as `load_tokenizer` reads it from a folder (with and without BOS, extra special tokens, GPT-2's
one token for all); one whose encodings would differ is not taken; a `LazyTokenizer` answers from the recorded
snapshot until something needs the tokenizer itself, in the driver and in a preparation's worker alike."""

from __future__ import annotations

import pickle

import pytest

from rlhf_core.data.prepared import PreparedStore
from rlhf_core.data.tokenizer_ref import LazyTokenizer
from rlhf_core.data.tokenizer_snapshot import TOKEN_NAMES, snapshot_from, take_snapshot
from rlhf_core.storage.locate import load_tokenizer
from tests.families import GEMMA_IT, GPT2_PLAIN, MISTRAL_INST, PHI3_INSTRUCT
from tests.hub_cache import LLAMA3_BASE, LLAMA3_INSTRUCT, QWEN2_CHATML, build_tokenizer

SPECS = {"qwen2": QWEN2_CHATML, "llama3": LLAMA3_INSTRUCT, "llama3-base": LLAMA3_BASE, "mistral": MISTRAL_INST,
         "gemma": GEMMA_IT, "phi3": PHI3_INSTRUCT, "gpt2": GPT2_PLAIN}
TEXTS = ["", " ", "\n", "sort the numbers 3 1 2", "  leading and trailing  ", "ünïcödé ✓ 数字\n\n", "x" * 200,
         "please reply with the answer\nthen stop"]


@pytest.fixture(scope="module", params=list(SPECS))
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_tokenizer(SPECS[request.param]).save_pretrained(path)
    return str(path)


def test_a_snapshot_encodes_as_the_tokenizer_it_was_taken_of(folder):
    tokenizer = load_tokenizer(folder)
    snapshot = snapshot_from(take_snapshot(tokenizer))
    assert snapshot is not None
    specials = [token for token in tokenizer.all_special_tokens]
    texts = TEXTS + [f"{token}{text}{token}" for token in specials for text in TEXTS[3:5]]
    for kwargs in ({}, {"add_special_tokens": False}, {"add_special_tokens": False, "truncation": True, "max_length": 1},
                   {"truncation": True, "max_length": 3}, {"add_special_tokens": False, "truncation": True,
                                                             "max_length": 16}):
        assert snapshot(texts, **kwargs).input_ids == tokenizer(texts, **kwargs).input_ids, kwargs
        assert [snapshot(text, **kwargs).input_ids for text in texts] == [
            tokenizer(text, **kwargs).input_ids for text in texts], kwargs
    assert [snapshot.encode(text, add_special_tokens=False) for text in texts] == [
        tokenizer.encode(text, add_special_tokens=False) for text in texts]
    for name in (*TOKEN_NAMES, *(f"{name}_id" for name in TOKEN_NAMES), "special_tokens_map", "truncation_side"):
        assert getattr(snapshot, name) == getattr(tokenizer, name), name
    assert snapshot.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_a_tokenizer_whose_encodings_the_snapshot_would_not_match_gets_none(folder):
    tokenizer = load_tokenizer(folder)

    class AddsAToken:  # a tokenizer class whose own __call__ is not its backend's (say, a slow one's)
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, text, **kwargs):
            encoded = tokenizer(text, **kwargs)
            encoded["input_ids"] = [ids + [0] for ids in encoded.input_ids] if isinstance(text, list) \
                else encoded.input_ids + [0]
            return encoded

    assert take_snapshot(AddsAToken()) is None
    assert take_snapshot(type("Slow", (), {"backend_tokenizer": None})()) is None


def test_a_lazy_tokenizer_answers_from_the_snapshot_until_the_tokenizer_is_needed(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_TOKENIZER_CACHE", str(tmp_path / "cache"))
    first = LazyTokenizer(folder, None, PreparedStore(str(tmp_path / "run1")))
    identity = first.identity()
    first.keep_records()
    loads = []
    monkeypatch.setattr("rlhf_core.data.tokenizer_ref.load_tokenizer",
                        lambda *args, **kwargs: loads.append(args) or load_tokenizer(*args, **kwargs))
    second = LazyTokenizer(folder, None, PreparedStore(str(tmp_path / "run2")))
    assert second.identity() == identity
    assert second.eos_token_id == first.eos_token_id and second.special_tokens_map == first.special_tokens_map
    assert second(TEXTS[3], add_special_tokens=False).input_ids == first(TEXTS[3], add_special_tokens=False).input_ids
    in_worker = pickle.loads(pickle.dumps(second))  # a preparation's worker: the same record, no store
    assert in_worker(TEXTS, truncation=True, max_length=4).input_ids == first(TEXTS, truncation=True,
                                                                              max_length=4).input_ids
    assert loads == []
    second.keep_records()  # the record found in this machine's cache is written into the run's store too
    assert (tmp_path / "run2" / ".prepared" / "tokenizers").is_dir()
    assert second.decode([1, 2]) == first.decode([1, 2]) and len(loads) == 1  # what the snapshot has not: loaded
    assert in_worker.decode([1, 2]) == first.decode([1, 2]) and len(loads) == 2
