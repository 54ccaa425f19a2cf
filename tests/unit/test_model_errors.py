"""Model folders a user got wrong: each is one UserError sentence naming the flag and the culprit file."""

from __future__ import annotations

import logging
import shutil

import pytest

from rlhf_core.errors import UserError
from rlhf_core.driver.export import merge_lora
from rlhf_core.storage.writable import check_writable
from rlhf_core.models.load import LoadOptions, load_causal_lm, load_scalar_model
from rlhf_core.storage.locate import load_tokenizer, local_model_dir

# An endpoint nothing listens on (loopback), asked once: botocore and s3fs would otherwise retry for ~10 s.
UNREACHABLE = {"endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"retries": {"max_attempts": 1}}}


@pytest.fixture
def model_copy(tmp_path, toy_assets):
    return shutil.copytree(toy_assets["model"], tmp_path / "model")


def one_sentence(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_folder_without_tokenizer_names_it_and_the_flag(tmp_path, model_copy):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model_copy / name).unlink(missing_ok=True)
    with pytest.raises(UserError, match=r"^--pretrain: .*model has no tokenizer \(tokenizer.json, ") as error:
        load_tokenizer(str(model_copy))
    assert "sentencepiece" not in one_sentence(error)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"^--reward_pretrain: .*empty has no tokenizer"):
        load_tokenizer(str(tmp_path / "empty"), flag="--reward_pretrain")


def test_empty_folder_as_model_names_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"^--pretrain: .*empty has no config.json"):
        load_causal_lm(str(tmp_path / "empty"))


def test_truncated_safetensors_is_named_and_not_retried(model_copy):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(UserError, match=r"^--pretrain: .*model\.safetensors is truncated or corrupt") as error:
        load_causal_lm(str(model_copy))
    one_sentence(error)


def test_corrupt_config_names_file_and_line(model_copy):
    (model_copy / "config.json").write_text('{\n  "model_type": "llama",\n  oops\n}')
    with pytest.raises(UserError, match=r"^--critic_pretrain: .*config\.json is not valid JSON \(line 3"):
        load_scalar_model(str(model_copy), pad_token_id=0, flag="--critic_pretrain")


def test_unknown_architecture_names_model_type(model_copy):
    config = (model_copy / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "llamma"')
    (model_copy / "config.json").write_text(config)
    with pytest.raises(UserError, match=r"^--pretrain: .*config\.json has model_type 'llamma', an architecture"):
        load_causal_lm(str(model_copy))


def test_bad_lora_path_blames_lora_path(tmp_path, toy_assets):
    output = str(tmp_path / "merged")
    with pytest.raises(UserError, match=r"^--lora_path: .*nope is not a model folder"):
        merge_lora(toy_assets["model"], str(tmp_path / "nope"), output)
    with pytest.raises(UserError, match=r"^--lora_path: .* holds no LoRA adapter"):
        merge_lora(toy_assets["model"], toy_assets["model"], output)
    load_causal_lm(toy_assets["model"], LoadOptions(lora_rank=4, lora_alpha=8)).save_pretrained(tmp_path / "adapter")
    with pytest.raises(UserError, match=r"^--model_path: .*nope is not a model folder"):
        merge_lora(str(tmp_path / "nope"), str(tmp_path / "adapter"), output)


def test_unreachable_s3_endpoint_names_flag_url_and_endpoint(monkeypatch):
    pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    with pytest.raises(UserError, match=r"^--pretrain: cannot reach the store of s3://bucket/model at "
                                        r"http://127\.0\.0\.1:9 \(EndpointConnectionError\)"):
        local_model_dir("s3://bucket/model", UNREACHABLE)
    with pytest.raises(UserError, match=r"^--save_path: cannot reach the store of s3://bucket/out"):
        check_writable("s3://bucket/out", "--save_path", UNREACHABLE)


def test_model_from_s3_uses_the_storage_options(s3_endpoint, toy_assets, monkeypatch):
    """The endpoint comes from storage_options only (no AWS_ENDPOINT_URL): proof that they reach the reads."""
    import fsspec

    from tests.conftest import make_bucket

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    make_bucket(s3_endpoint, "models")
    options = {"endpoint_url": s3_endpoint}
    filesystem = fsspec.filesystem("s3", **options)
    filesystem.put(toy_assets["model"].rstrip("/") + "/", "models/toy/", recursive=True)
    tokenizer = load_tokenizer("s3://models/toy", storage_options=options)
    model = load_causal_lm("s3://models/toy", storage_options=options)
    assert model.config.vocab_size == len(tokenizer)


def test_attention_fallback_warns_once_and_unknown_is_refused(toy_assets, caplog):
    from rlhf_core.models import load as models

    models._warn_attention_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="rlhf_core.models.load"):
        first = load_causal_lm(toy_assets["model"], LoadOptions(attn_implementation="flash_attention_2"))
        load_scalar_model(toy_assets["model"], 0, LoadOptions(attn_implementation="flash_attention_2"))
    assert first.config._attn_implementation == "sdpa"
    warnings = [record.getMessage() for record in caplog.records if "flash_attention_2" in record.getMessage()]
    assert len(warnings) == 1 and "using sdpa" in warnings[0]
    assert load_causal_lm(toy_assets["model"], LoadOptions(attn_implementation="eager")).config._attn_implementation == "eager"
    with pytest.raises(UserError, match=r"^--attn_implementation 'flash_attn' is not one of eager, "):
        load_causal_lm(toy_assets["model"], LoadOptions(attn_implementation="flash_attn"))


def test_lora_dropout_reaches_the_adapters(toy_assets):
    model = load_causal_lm(toy_assets["model"], LoadOptions(lora_rank=4, lora_alpha=8, lora_dropout=0.25))
    assert model.peft_config["default"].lora_dropout == 0.25


def test_unwritable_output_is_refused_early(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(UserError, match=r"^--save_path: .*file is a file; give a folder"):
        check_writable(str(a_file), "--save_path")
    with pytest.raises(UserError, match=r"^--output_path: .*file/sub cannot be a folder because .*file is a file") as error:
        check_writable(str(a_file / "sub"), "--output_path")  # a parent that is a file: even root cannot
    one_sentence(error)
    with pytest.raises(UserError, match=r"^--save_path: cannot write to /proc/rlhf-probe"):
        check_writable("/proc/rlhf-probe", "--save_path")  # read-only for root too
    check_writable(str(tmp_path / "new" / "out"), "--save_path")
    assert list((tmp_path / "new" / "out").iterdir()) == []  # the probe is gone
