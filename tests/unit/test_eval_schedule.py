"""When a stage evaluates, as OpenRLHF does (v0.9.10 `save_logs_and_checkpoints`): every --eval_steps steps, with -1
once per epoch (PPO never), the reward model also at each epoch's end, never because a checkpoint commits; what the
reward model evaluates on without an eval set; an evaluation reports its batches as progress and stops when the
ranks agree to stop."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from rlhf_core.data.columns import subset
from rlhf_core.data.pairs import eval_pairs_of_rm
from rlhf_core.rank.signals import RankSignals
from rlhf_core.rank.trainers.base import DeepSpeedTrainer
from rlhf_core.rank.trainers.ppo import PPOTrainer
from rlhf_core.rank.trainers.rm import RewardModelTrainer
from rlhf_core.rank.trainers.sft import SFTTrainer


def bare(trainer_class, eval_steps: int, steps_per_epoch: int, chunk_ends=(2, 4, 6, 8, 10, 12)):
    """A trainer of `trainer_class` with only what the schedule reads: no model, no data."""
    trainer = object.__new__(trainer_class)
    trainer.cfg = SimpleNamespace(eval_steps=eval_steps, micro_train_batch_size=2)
    trainer.steps_per_epoch, trainer._chunk_ends = steps_per_epoch, frozenset(chunk_ends)
    return trainer


def eval_steps_of(trainer, last_step: int = 12) -> list[int]:
    steps = []
    for step in range(1, last_step + 1):
        trainer.step = step
        if trainer.is_eval_step():
            steps.append(step)
    return steps


def test_eval_steps_minus_one_is_once_per_epoch_and_not_at_each_checkpoint():
    assert eval_steps_of(bare(SFTTrainer, -1, steps_per_epoch=5)) == [5, 10]
    assert eval_steps_of(bare(RewardModelTrainer, -1, steps_per_epoch=5)) == [5, 10]


def test_eval_steps_n_is_every_n_steps_and_the_reward_model_also_at_each_epochs_end():
    assert eval_steps_of(bare(SFTTrainer, 3, steps_per_epoch=5)) == [3, 6, 9, 12]
    assert eval_steps_of(bare(RewardModelTrainer, 3, steps_per_epoch=5)) == [3, 5, 6, 9, 10, 12]


def test_ppo_never_evaluates_with_eval_steps_minus_one():
    assert eval_steps_of(bare(PPOTrainer, -1, steps_per_epoch=5)) == []
    assert eval_steps_of(bare(PPOTrainer, 4, steps_per_epoch=5)) == [4, 8, 12]


def test_the_reward_model_without_an_eval_set_evaluates_on_its_first_percent_of_training_pairs():
    pairs = subset(list(range(1000)), np.arange(1000))
    assert list(eval_pairs_of_rm(pairs)) == list(range(10))
    assert len(eval_pairs_of_rm(subset(list(range(99)), np.arange(99)))) == 0  # int(0.99): none, as OpenRLHF


class Recorder(RankSignals):
    def __init__(self, stop_after: int | None = None):
        self.pieces: list[tuple[str, int, int]] = []
        self.stop_after = stop_after

    def work_done(self, phase: str, done: int, total: int) -> None:
        self.pieces.append((phase, done, total))

    def stop_agreed(self) -> bool:
        return self.stop_after is not None and len(self.pieces) >= self.stop_after


class CountingTrainer(DeepSpeedTrainer):
    """Evaluates items 0..N-1 in micro-batches of 2 on one rank: eval_loss is their mean."""

    stage = "sft"

    def train_step(self):
        raise NotImplementedError

    def eval_items(self):
        return list(range(7))

    def eval_sums(self, batch):
        return {"eval_loss": float(sum(batch)), "count": len(batch)}


def counting_trainer(signals: RankSignals) -> CountingTrainer:
    trainer = bare(CountingTrainer, -1, steps_per_epoch=1)
    trainer.engines, trainer.rank, trainer.world_size, trainer.step = {}, 0, 1, 1
    trainer.signals, trainer.eval_seconds = signals, 0.0
    return trainer


def test_each_eval_batch_is_progress_with_its_count_of_items():
    signals = Recorder()
    metrics = counting_trainer(signals).evaluation()
    assert metrics == {"eval_loss": 3.0}
    assert signals.pieces == [("eval", 2, 7), ("eval", 4, 7), ("eval", 6, 7), ("eval", 7, 7)]


def test_an_evaluation_stops_when_the_ranks_agree_to_stop_and_reports_no_metrics():
    signals = Recorder(stop_after=2)
    trainer = counting_trainer(signals)
    assert trainer.evaluation() == {}
    assert len(signals.pieces) == 2  # the third batch never ran
    assert trainer.eval_seconds > 0
