"""The trainers' one contract with the ranks (issue 31): the collectives of `rlhf_core.rank.collectives`, on one
process and over a group of two gloo ranks, and the base trainer's loops (`train_on`, `evaluate`) around stub
trainers, whose evaluation over two ranks equals the one rank's."""

from __future__ import annotations

import multiprocessing
import os
import queue
import time

import pytest
import torch

from rlhf_core.config import RunConfig
from rlhf_core.errors import UserError
from rlhf_core.rank import collectives
from rlhf_core.rank.trainers.base import DeepSpeedTrainer
from rlhf_core.stages.sft import SFTConfig


def test_on_one_process_each_collective_is_its_own_values():
    assert not torch.distributed.is_initialized()
    assert collectives.world_size() == 1
    assert collectives.sum_over_ranks(1.5, 2) == [1.5, 2.0]
    assert collectives.mean_over_ranks([1.0, 2.0, 4.0]) == 7 / 3
    assert collectives.max_over_ranks([3.0, -1.0]) == [3.0, -1.0]
    totals = torch.tensor([1.0, 2.0], dtype=torch.float64)
    summed = collectives.all_reduce_sum(totals)
    assert torch.equal(summed, totals) and summed is not totals and summed.dtype == torch.float64
    assert collectives.agreed(lambda: 42) == 42
    with pytest.raises(UserError, match="^bad reward$"):
        collectives.agreed(lambda: (_ for _ in ()).throw(UserError("bad reward")))
    assert collectives.mean_extra_logs_over_ranks({"b": [1.0, 3.0], "a": [], "c": [2.0]}) == {"b": 2.0, "c": 2.0}


class StubEngine:
    """What the base loops use of an engine: train/eval modes, backward, step and the LR."""

    def __init__(self):
        self.mode, self.steps = None, 0

    def train(self):
        self.mode = "train"

    def eval(self):
        self.mode = "eval"

    def backward(self, loss):
        pass

    def step(self):
        self.steps += 1

    def get_lr(self):
        return [0.5]


class StubTrainer(DeepSpeedTrainer):
    """Items are numbers; a micro-batch's loss is its sum, its "size" metric its length, and its eval sums the
    items and the items above 2, over the count of items."""

    stage = "sft"

    def train_step(self):
        return self.train_on(self.items)

    def train_loss(self, batch):
        return torch.tensor(float(sum(batch))), {"size": float(len(batch))}

    def eval_items(self):
        return self.eval_data

    def eval_sums(self, batch):
        self.passes.append(batch)
        return {"eval_value": float(sum(batch)), "eval_above_2": sum(item > 2 for item in batch), "count": len(batch)}


def stub_trainer(rank: int, world_size: int, eval_data: list[float], eval_steps: int = 1) -> StubTrainer:
    run = RunConfig(sft=SFTConfig(pretrain="m", dataset="d.jsonl", train_batch_size=4, micro_train_batch_size=2,
                                  eval_steps=eval_steps))
    trainer = StubTrainer.__new__(StubTrainer)
    trainer.run, trainer.cfg = run, run.sft
    trainer.rank, trainer.world_size, trainer.step, trainer._chunk_ends = rank, world_size, 0, frozenset([4])
    trainer.engine = StubEngine()
    trainer.engines = {"actor_model": trainer.engine}
    trainer.items, trainer.eval_data, trainer.passes = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], eval_data, []
    return trainer


def test_evaluate_runs_every_micro_batch_counts_the_rank_s_share_and_returns_means_over_the_count():
    trainer = stub_trainer(rank=0, world_size=1, eval_data=[1.0, 2.0, 3.0, 4.0, 6.0])
    assert trainer.evaluate() == {"eval_value": 16 / 5, "eval_above_2": 3 / 5}
    assert trainer.passes == [[1.0, 2.0], [3.0, 4.0], [6.0]] and trainer.engine.mode == "eval"
    # Rank 1 of 2 (as the ranks split it; no torch.distributed here, so its own sums): its share is the second
    # micro-batch of each round, and the round it has none of it repeats the first item, not counted.
    second = stub_trainer(rank=1, world_size=2, eval_data=[1.0, 2.0, 3.0, 4.0, 6.0])
    assert second.evaluate() == {"eval_value": 7 / 2, "eval_above_2": 2 / 2}
    assert second.passes == [[3.0, 4.0], [1.0]]


def test_train_on_averages_each_metric_over_micro_batches_and_adds_the_evaluation_when_due():
    trainer = stub_trainer(rank=0, world_size=1, eval_data=[5.0], eval_steps=2)
    first = trainer.train_step()
    assert list(first) == ["step", "loss", "lr", "size"] and trainer.engine.steps == 2
    assert first["step"] == 1 and first["lr"] == 0.5 and first["size"] == 2.0
    assert trainer.train_step()["eval_value"] == 5.0  # step 2: every eval_steps
    assert "eval_value" not in trainer.train_step() and "eval_value" in trainer.train_step()  # 3; 4 ends a chunk
    assert not stub_trainer(rank=0, world_size=1, eval_data=[]).evaluation()  # nothing to evaluate on


def two_ranks(rank: int, store_path: str, eval_data: list[float], results) -> None:
    """Rank `rank` of a two-rank gloo group: each collective on its own values, and the stub's evaluation."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        def reward_function():
            if rank == 1:
                raise UserError("rank 1's reward function failed")
            return "scored"

        try:
            collectives.agreed(reward_function)
            stopped = ""
        except UserError as error:
            stopped = str(error)
        trainer = stub_trainer(rank, 2, eval_data)
        results.put((rank, {
            "world_size": collectives.world_size(),
            "sum": collectives.sum_over_ranks(1.0 + rank, 10),
            "all_reduce_sum": collectives.all_reduce_sum(torch.tensor([0.5, rank], dtype=torch.float32)).tolist(),
            "mean": collectives.mean_over_ranks([1.0, 2.0] if rank == 0 else [6.0]),
            "max": collectives.max_over_ranks([float(rank), -float(rank)]),
            "stopped": stopped,
            "extra_logs": collectives.mean_extra_logs_over_ranks({"format": [1.0], "length": [4.0, 6.0]} if rank
                                                                 else {"format": [0.0, 0.0]}),
            "evaluation": trainer.evaluate(),
        }))
    finally:
        torch.distributed.destroy_process_group()


def test_over_two_gloo_ranks_every_rank_gets_the_same_result_and_the_evaluation_is_the_one_rank_s(tmp_path):
    eval_data = [1.0, 2.0, 3.0, 4.0, 6.0]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store = os.path.join(tmp_path, "store")
    processes = [context.Process(target=two_ranks, args=(rank, store, eval_data, results)) for rank in (0, 1)]
    for process in processes:
        process.start()
    gathered: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + 120
        while len(gathered) < len(processes) and time.monotonic() < deadline:
            try:
                rank, result = results.get(timeout=1)
                gathered[rank] = result
            except queue.Empty:  # a rank that failed leaves the other waiting in a collective: stop now
                assert all(process.exitcode in (None, 0) for process in processes), "a rank failed (see its stderr)"
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.exitcode is None:
                process.kill()
    assert [process.exitcode for process in processes] == [0, 0]
    assert gathered[0] == gathered[1]
    assert gathered[0] == {
        "world_size": 2, "sum": [3.0, 20.0], "all_reduce_sum": [1.0, 1.0], "mean": 3.0, "max": [1.0, 0.0],
        "stopped": "rank 1's reward function failed",
        "extra_logs": {"format": 1 / 3, "length": 5.0},
        "evaluation": stub_trainer(0, 1, eval_data).evaluate(),
    }
