"""The step-speed choices of issue 10 that hold without a DeepSpeed engine: the CPU optimizer is torch's
fused AdamW, and with `--param_dtype bf16` on a CPU every forward pass of SFT and RM (training, eval,
padded and packed) runs under bf16 autocast, and none does in fp32.

The trainers are built without `__init__` around a stand-in engine (the toy model, `backward` =
`loss.backward()`), so no DeepSpeed, Ray or torch.distributed is needed.
"""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_core.config import RunConfig
from rlhf_core.stages.rm import RMConfig
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.data.samples import TokenizedPair, TokenizedSample
from rlhf_core.rank.ds_config import deepspeed_config
from rlhf_core.models.precision import Precision
from rlhf_core.toy import build_model, build_tokenizer
from rlhf_core.data.pairs import Pair
from rlhf_core.rank.trainers.rm import RewardModelTrainer
from rlhf_core.rank.trainers.sft import SFTTrainer


def test_cpu_optimizer_is_torchs_fused_adamw_and_gpu_keeps_deepspeeds():
    cfg = SFTConfig(pretrain="m", dataset="d.jsonl", train_batch_size=8, micro_train_batch_size=4)
    cpu = deepspeed_config(cfg, 1, on_gpu=False)["optimizer"]["params"]
    gpu = deepspeed_config(cfg, 1, on_gpu=True)["optimizer"]["params"]
    assert cpu["torch_adam"] and cpu["fused"]
    assert not gpu["torch_adam"] and "fused" not in gpu


class StandInEngine:
    """What the trainers use of a DeepSpeed engine, around a plain module."""

    device = torch.device("cpu")

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, **batch):
        return self.module(**batch)

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.module.zero_grad()

    def get_lr(self):
        return [1e-3]


def autocast_seen(module: torch.nn.Module) -> list:
    """The autocast dtype (None: off) in effect at every Linear layer call of `module`, as they happen."""
    seen = []

    def record(_layer, _inputs):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)

    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_pre_hook(record)
    return seen


def bare_trainer(trainer_class, run: RunConfig, module, precision: Precision):
    trainer = trainer_class.__new__(trainer_class)
    trainer.run, trainer.cfg = run, run.stage_config(trainer.stage)
    trainer.total_steps, trainer.rank, trainer.world_size, trainer.step = 4, 0, 1, 0
    trainer.precision, trainer.tokenizer = precision, build_tokenizer()
    trainer.engine = StandInEngine(module)
    trainer.engines = {"model": trainer.engine}
    return trainer


def random_ids(rng: random.Random) -> list[int]:
    return [1] + [rng.randrange(4, 19) for _ in range(rng.randint(3, 9))] + [2]


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("precision, expected", [(Precision(cpu_autocast_bf16=True), torch.bfloat16),
                                                 (Precision(), None)])
def test_every_sft_forward_runs_under_the_precisions_autocast(packing, precision, expected):
    run = RunConfig(sft=SFTConfig(pretrain="m", dataset="d.jsonl", train_batch_size=4, micro_train_batch_size=2,
                                  packing_samples=packing, eval_steps=1))
    model = build_model(len(build_tokenizer()), seed=0)
    trainer = bare_trainer(SFTTrainer, run, model, precision)
    rng = random.Random(0)
    trainer.samples = [TokenizedSample(ids, [0] * 3 + [1] * (len(ids) - 3)) for ids in
                       (random_ids(rng) for _ in range(8))]
    trainer.eval_samples = trainer.samples[:3]
    seen = autocast_seen(model)
    metrics = trainer.train_step()
    assert "eval_loss" in metrics  # training and eval forwards both recorded
    assert seen and set(seen) == {expected}


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("precision, expected", [(Precision(cpu_autocast_bf16=True), torch.bfloat16),
                                                 (Precision(), None)])
def test_every_reward_model_forward_runs_under_the_precisions_autocast(packing, precision, expected):
    from transformers import LlamaForSequenceClassification

    run = RunConfig(stages=["rm"], rm=RMConfig(pretrain="m", dataset="d.jsonl", train_batch_size=4,
                                               micro_train_batch_size=2, packing_samples=packing, eval_steps=1))
    torch.manual_seed(0)
    config = build_model(len(build_tokenizer()), seed=0).config
    config.num_labels = 1  # a reward model's one score, as load_scalar_model builds it
    model = LlamaForSequenceClassification(config)
    trainer = bare_trainer(RewardModelTrainer, run, model, precision)
    rng = random.Random(0)
    trainer.train_pairs = [Pair(TokenizedPair(random_ids(rng), random_ids(rng)), 0.0) for _ in range(8)]
    trainer.eval_pairs = trainer.train_pairs[:3]
    seen = autocast_seen(model)
    metrics = trainer.train_step()
    assert "eval_accuracy" in metrics
    assert seen and set(seen) == {expected}
