"""The DeepSpeed config mapping, LR schedules, precision choice, packing maths and error transport.

No DeepSpeed engine and no Ray here: the pure functions the ranks build their engines from, and the
packed-vs-padded equality on the toy model (sdpa and eager attention).
"""

from __future__ import annotations

import io
import logging
import pickle

import pytest
import torch

from rlhf_core.stages.rm import RMConfig
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.data.samples import TokenizedPair, TokenizedSample, collate_pairs, collate_sft
from rlhf_core.rank.ds_config import deepspeed_config, lr_scheduler_factory, resolve_zero_stage
from rlhf_core.models.precision import resolve_precision
from rlhf_core.errors import CorruptCheckpoint, UnsafeCheckpoint, UserError
from rlhf_core.models.load import sequence_scores
from rlhf_core.rank.packing import pack_sequences, pack_sft, packed_scores
from rlhf_core.rank.trainers.base import DeepSpeedTrainer, continue_schedule


def sft_config(**overrides) -> SFTConfig:
    return SFTConfig(pretrain="m", dataset="d.jsonl", train_batch_size=8, micro_train_batch_size=2, **overrides)


def test_deepspeed_config_maps_the_flags():
    cfg = sft_config(zero_stage=3, adam_betas=(0.8, 0.99), adam_eps=1e-6, l2=0.1, max_norm=0.5)
    config = deepspeed_config(cfg, num_workers=2, load_universal=True, on_gpu=False, hidden_size=64)
    assert config["gradient_accumulation_steps"] == 2
    assert config["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 640}
    assert config["optimizer"]["params"]["betas"] == [0.8, 0.99] and config["optimizer"]["params"]["eps"] == 1e-6
    assert config["optimizer"]["params"]["weight_decay"] == 0.1 and config["optimizer"]["params"]["torch_adam"]
    assert config["gradient_clipping"] == 0.5 and config["checkpoint"] == {"load_universal": True}
    assert "scheduler" not in config  # the schedule is a torch LambdaLR passed to deepspeed.initialize


@pytest.mark.parametrize("configured, num_workers, adam_offload, saved, expected", [
    (None, 1, False, None, 0),  # one rank: nothing to partition
    (None, 2, False, None, 2),  # OpenRLHF's default
    (None, 1, True, None, 2),  # DeepSpeed offloads with ZeRO 1-3 only
    (None, 2, False, 0, 0),  # a resumed line keeps its layout at any world size
    (None, 1, False, 2, 2),
    (3, 1, False, 0, 3),  # an explicit stage wins (check_zero_stage refuses what cannot load)
])
def test_zero_stage_default_is_zero_on_one_rank_and_a_resume_keeps_the_saved_one(
        configured, num_workers, adam_offload, saved, expected):
    assert resolve_zero_stage(configured, num_workers, adam_offload, saved) == expected
    if saved is None:
        cfg = sft_config(zero_stage=configured, adam_offload=adam_offload)
        assert deepspeed_config(cfg, num_workers)["zero_optimization"]["stage"] == expected


def test_precision_on_gpu_is_deepspeeds_and_on_cpu_never():
    for dtype, key in (("bf16", "bf16"), ("fp16", "fp16")):
        on_gpu = deepspeed_config(sft_config(param_dtype=dtype), 1, on_gpu=True)
        on_cpu = deepspeed_config(sft_config(param_dtype=dtype), 1, on_gpu=False)
        assert on_gpu[key]["enabled"] and not on_cpu[key]["enabled"]
        assert not on_gpu["optimizer"]["params"]["torch_adam"]


def test_adam_offload_offloads_on_gpu_and_warns_once_on_cpu(caplog):
    on_gpu = deepspeed_config(sft_config(adam_offload=True), 1, on_gpu=True)
    assert on_gpu["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    with caplog.at_level(logging.WARNING, logger="rlhf_core"):
        for _ in range(3):
            on_cpu = deepspeed_config(sft_config(adam_offload=True), 1, on_gpu=False)
    assert "offload_optimizer" not in on_cpu["zero_optimization"]
    assert [r.getMessage() for r in caplog.records].count(
        "--adam_offload has no effect here: the optimizer states already live in CPU memory (no GPU).") <= 1


def test_resolve_precision(caplog):
    with pytest.raises(UserError, match="--param_dtype fp16 needs a GPU"):
        resolve_precision("fp16", on_gpu=False)
    assert resolve_precision("bf16", on_gpu=False, cpu_bf16=True).cpu_autocast_bf16
    with caplog.at_level(logging.WARNING, logger="rlhf_core"):
        assert resolve_precision("bf16", on_gpu=False, cpu_bf16=False) == resolve_precision("fp32", False)
    assert any("no native bf16" in r.getMessage() for r in caplog.records)
    assert resolve_precision("bf16", on_gpu=True).deepspeed_bf16


def lrs(name: str, total: int = 10, warmup_ratio: float = 0.2, min_lr_ratio: float = 0.1) -> list[float]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = lr_scheduler_factory(name, warmup_ratio, total, min_lr_ratio)(optimizer)
    values = []
    for _ in range(total):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values + [optimizer.param_groups[0]["lr"]]


def test_lr_schedules_follow_openrlhf():
    assert lrs("cosine_with_min_lr")[:3] == [0.0, 0.5, 1.0]  # warmup ceil(0.2 x 10) = 2 steps
    assert lrs("cosine_with_min_lr")[-1] == pytest.approx(0.1)
    assert lrs("cosine_with_min_lr", min_lr_ratio=0.25)[-1] == pytest.approx(0.25)  # OpenRLHF 0.11's --min_lr_ratio
    assert lrs("cosine")[-1] == pytest.approx(0.0) and lrs("linear")[-1] == pytest.approx(0.0)
    assert lrs("linear")[6] == pytest.approx(0.5)
    assert lrs("constant") == [1.0] * 11
    assert lrs("constant_with_warmup")[:3] == [0.0, 0.5, 1.0] and lrs("constant_with_warmup")[-1] == 1.0
    assert lrs("cosine")[2:] == sorted(lrs("cosine")[2:], reverse=True)


def test_schedule_state_survives_a_weights_only_load_and_continues():
    """What DeepSpeed saves of the schedule unpickles with weights_only=True (the checkpoint scan) and
    continues exactly; a fresh schedule fast-forwarded (load_weights_only) lands on the same LR."""
    def scheduler():
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        return lr_scheduler_factory("cosine_with_min_lr", 0.1, 20)(optimizer)

    trained = scheduler()
    for _ in range(7):
        trained.optimizer.step()
        trained.step()
    buffer = io.BytesIO()
    torch.save(trained.state_dict(), buffer)
    restored = scheduler()
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert restored.get_last_lr() == trained.get_last_lr()
    engine = type("Engine", (), {})()
    engine.lr_scheduler = scheduler()
    continue_schedule(engine, 7)
    assert engine.lr_scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(trained.get_last_lr()[0], rel=1e-12)
    assert engine.global_steps == 7


def test_trainer_base_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        DeepSpeedTrainer(None, [1], 0, 1)  # type: ignore[arg-type]
    assert {"train_step"} <= DeepSpeedTrainer.__abstractmethods__


@pytest.mark.parametrize("error", [UserError("bad flag."), UnsafeCheckpoint("bad file."),
                                   CorruptCheckpoint("bad bytes.", 5, "sha256 mismatch")])
def test_user_errors_survive_pickling(error):
    """Ray pickles a rank's exception to the driver; it must come back as the same class and sentence."""
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)


def test_pack_sft_restarts_positions_and_ignores_each_first_token():
    samples = [TokenizedSample([1, 5, 6, 2], [0, 0, 1, 1]), TokenizedSample([1, 7, 2], [1, 1, 1])]
    packed = pack_sft(samples)
    assert packed["input_ids"].tolist() == [[1, 5, 6, 2, 1, 7, 2]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert packed["labels"].tolist() == [[-100, -100, 6, 2, -100, 7, 2]]
    assert pack_sequences([[1, 2], [3], [4, 5, 6]])["ends"].tolist() == [1, 2, 5]


def toy_samples(toy_assets, count: int = 6):
    from rlhf_core.data.stream import RecordStream, read_records
    from rlhf_core.storage.locate import load_tokenizer
    from rlhf_core.data.samples import Renderer, tokenize_sft

    tokenizer = load_tokenizer(toy_assets["model"])
    records = read_records(RecordStream(toy_assets["sft"], None, max_samples=count))
    return tokenizer, tokenize_sft(Renderer(tokenizer, toy_assets["sft"], False), records, "prompt", "response", 64)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_sft_loss_equals_padded_loss(toy_assets, attention):
    from transformers import AutoModelForCausalLM

    tokenizer, samples = toy_samples(toy_assets)
    assert len({len(s.input_ids) for s in samples}) > 1  # padding really happens
    model = AutoModelForCausalLM.from_pretrained(toy_assets["model"], attn_implementation=attention).eval()
    with torch.no_grad():
        padded = model(**collate_sft(samples, tokenizer.pad_token_id)).loss
        packed = model(**pack_sft(samples), use_cache=False).loss
        leaked = model(input_ids=pack_sft(samples)["input_ids"], labels=pack_sft(samples)["labels"],
                       use_cache=False).loss
    assert packed.item() == pytest.approx(padded.item(), abs=1e-5)
    assert abs(leaked.item() - padded.item()) > 1e-4  # without position_ids attention crosses samples


def test_packed_rewards_equal_padded_rewards(toy_assets):
    from transformers import AutoModelForSequenceClassification

    tokenizer, samples = toy_samples(toy_assets)
    pairs = [TokenizedPair(a.input_ids, b.input_ids) for a, b in zip(samples[::2], samples[1::2])]
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(toy_assets["model"], num_labels=1).eval()
    model.config.pad_token_id = tokenizer.pad_token_id
    sequences = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    with torch.no_grad():
        padded = sequence_scores(model, **collate_pairs(pairs, tokenizer.pad_token_id))
        packed = pack_sequences(sequences)
        scores = packed_scores(model, packed["input_ids"], packed["position_ids"], packed["ends"])
    torch.testing.assert_close(scores, padded, atol=1e-5, rtol=0)


def test_rm_pairwise_losses():
    from rlhf_core.rank.trainers.rm import pairwise_loss

    chosen, rejected, margin = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.0])
    sigmoid = pairwise_loss("sigmoid", chosen, rejected, margin)
    assert sigmoid.item() == pytest.approx(-(torch.tensor([0.5, -1.0]).sigmoid().log().mean()).item())
    logexp = pairwise_loss("logexploss", chosen, rejected, margin)  # margins ignored, as OpenRLHF
    assert logexp.item() == pytest.approx(torch.log1p(torch.exp(torch.tensor([-1.0, 1.0]))).mean().item())
    assert RMConfig(dataset="p.jsonl", loss="logexploss").loss == "logexploss"


def test_an_explicit_zero_stage_that_cannot_load_the_checkpoint_is_one_sentence():
    from rlhf_core.storage.manifest import STATUS_COMMITTED, CheckpointInfo
    from rlhf_core.driver.resume import check_zero_stage
    from rlhf_core.storage.metadata import CheckpointMetadata

    info = CheckpointInfo(8, "step_8", "/ckpt/exp/sft/step_8", STATUS_COMMITTED, 1)
    for configured, saved, weights_only in ((None, 0, False), (0, 0, False), (2, None, False), (2, 0, True)):
        # loads: nothing raised
        check_zero_stage(configured, weights_only, info, CheckpointMetadata.from_json({"zero_stage": saved}))
    with pytest.raises(UserError, match=r"^/ckpt/exp/sft/step_8 was written with ZeRO stage 0 and --zero_stage 2 "
                                        r"cannot load it; pass --zero_stage 0 \(or leave it unset to keep it\), or "
                                        r"--load_weights_only to start fresh optimizers\.$"):
        check_zero_stage(2, False, info, CheckpointMetadata.from_json({"zero_stage": 0}))
    with pytest.raises(UserError, match=r"pass --zero_stage 3 \(or leave it unset to keep it\)\.$"):
        check_zero_stage(0, True, info, CheckpointMetadata.from_json({"zero_stage": 3}))
