"""What every DeepSpeed stage trainer shares (`DeepSpeedTrainer`): its engines, precision, the training and
evaluation loops of a stage that trains one model on items (`train_on`, `evaluate`), saving and loading one
checkpoint (DeepSpeed's state under `ds/`, a Hugging Face copy under `hf/`).
docs/design-notes.md ("The trainers' checkpoints and precision") has the checkpoint's layout and bf16 on a CPU.
"""

from __future__ import annotations

import abc
import contextlib
import glob
import json
import os
import time
from typing import TYPE_CHECKING, Any, Generic, Sequence, TypeVar

import torch
import torch.distributed as dist

from rlhf_core.config import RunConfig
from rlhf_core.data.determinism import derive_seed, step_sample_indices
from rlhf_core.data.records import rank_micro_batches
from rlhf_core.errors import UserError
from rlhf_core.rank.collectives import mean_over_ranks, sum_over_ranks
from rlhf_core.rank.signals import RankSignals
from rlhf_core.rank.ds_config import deepspeed_config, lr_scheduler_factory
from rlhf_core.models.precision import resolve_precision
from rlhf_core.notices import warn_once
from rlhf_core.faults import fault_point
from rlhf_core.storage.manifest import DEEPSPEED_STATE_DIR, HF_WEIGHTS_DIR, TRAINER_STATE_NAME, UNIVERSAL_STATE_DIR
from rlhf_core.stages import STAGES
from rlhf_core.stages.base import StageConfig
from rlhf_core.storage.safe_load import guard_checkpoint_loads, reading_checkpoint

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

    from rlhf_core.data.tokenizer_ref import LazyTokenizer

# A trainer's settings: its stage's config class. Covariant, since `cfg` is only read after __init__: any trainer
# is a DeepSpeedTrainer[StageConfig] to the code that hosts it (`rlhf_core.rank.worker`).
ConfigT = TypeVar("ConfigT", bound=StageConfig, covariant=True)


def configure_gradient_checkpointing(model, cfg) -> None:
    """Apply --gradient_checkpointing_use_reentrant (models load with the non-reentrant variant). The
    reentrant variant only back-propagates into checkpointed blocks whose inputs require grad, which
    frozen embeddings (LoRA) do not give, hence enable_input_require_grads."""
    if cfg.gradient_checkpointing and cfg.gradient_checkpointing_use_reentrant:
        from rlhf_core.models.load import enable_activation_checkpointing

        enable_activation_checkpointing(model, use_reentrant=True)
        model.enable_input_require_grads()


def gathered(engine, modifier_rank: int | None = None):
    """A context in which a ZeRO-3 engine's parameters are whole on every rank (no-op for ZeRO 0-2); with
    `modifier_rank`, that rank's changes are partitioned back to every rank on exit."""
    if engine.zero_optimization_stage() != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=modifier_rank)


def chained_model(location: str | None, flag: str) -> str:
    """A model input a section may leave to an earlier stage's output (`--ref_pretrain`, `--reward_pretrain`), as
    the run filled it (`StageSettings.chained`) by the time a trainer reads it."""
    if location is None:
        raise UserError(f"{flag} is not set: give it, or run the stage that produces it before this one")
    return location


class DeepSpeedTrainer(abc.ABC, Generic[ConfigT]):
    """One rank of a stage: DeepSpeed engines over its trained models, at optimizer step `self.step`.

    A stage's trainer declares `train_step()` (one optimizer step, returning its metrics); its facts (how its data
    is counted, items per step, the model folder its export reads) are in its `Stage` (`rlhf_core.stages`). A stage
    training one engine (`self.engine`) on items steps with `train_on(items)`, giving the loss of a micro-batch
    (`train_loss`); one evaluating on items (`eval_items`) gives an eval micro-batch's sums (`eval_sums`) and, when
    they are not plain means, its metrics of their totals (`eval_metrics`). Values are reduced over the ranks with
    `rlhf_core.rank.collectives`.
    """

    stage: str = ""
    evaluates_each_epoch = True  # --eval_steps -1 evaluates at each epoch's end (PPO: never, as OpenRLHF)
    evaluates_at_epoch_end = False  # with --eval_steps N too (OpenRLHF's reward model)
    config_class: type[ConfigT]  # the stage's config class (`Stage.config`): `self.cfg` is its section of the run
    tokenizer: PreTrainedTokenizerBase | LazyTokenizer  # the lazy one loads the tokenizer only where a call needs it
    engine: DeepSpeedEngine  # a stage training one model (`train_on`); PPO has `actor` and `critic` instead
    signals: RankSignals = RankSignals()  # nobody listens, until the rank hosting it sets its own
    steps_per_epoch = 0  # optimizer steps in one pass over the training items (`train_on` knows them)
    eval_seconds = 0.0  # spent evaluating so far, for the goodput ledger (`evaluation`)

    @property
    def export_model_dir(self) -> str:
        """The checkpoint folder (`actor_model`, `reward_model`) whose `hf/` is the stage's output."""
        return STAGES[self.stage].export_model_dir

    @abc.abstractmethod
    def train_step(self) -> dict[str, float]:
        """One optimizer step (or PPO step); returns its metrics, already averaged over ranks."""

    def __init__(self, run: RunConfig, chunk_ends: list[int], rank: int, world_size: int, load_universal: bool = False):
        """`chunk_ends`: the steps the driver's plan commits at (`StagePlan.targets`), the last the stage's last."""
        self.run, self.cfg = run, run.section(self.stage, self.config_class)
        self.total_steps, self.rank, self.world_size = chunk_ends[-1], rank, world_size
        self._chunk_ends = frozenset(chunk_ends)
        self.load_universal = load_universal
        self.on_gpu = torch.cuda.is_available()
        self.precision = resolve_precision(self.cfg.param_dtype, self.on_gpu)
        self.engines: dict[str, DeepSpeedEngine] = {}
        self.step = 0

    def autocast(self):
        """The context for forward passes: bf16 autocast on a CPU run with --param_dtype bf16, else nothing."""
        if self.precision.cpu_autocast_bf16:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def build_engine(self, name: str, model: torch.nn.Module, learning_rate: float | None = None,
                     num_optimizer_steps: int | None = None) -> DeepSpeedEngine:
        """A DeepSpeed engine for `model`, saved under `{name}/` in each checkpoint."""
        import deepspeed

        cfg = self.cfg if learning_rate is None else self.cfg.model_copy(update={"learning_rate": learning_rate})
        configure_gradient_checkpointing(model, cfg)
        hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
        config = deepspeed_config(cfg, self.world_size, self.load_universal, self.on_gpu, hidden_size)
        schedule = lr_scheduler_factory(cfg.lr_scheduler, cfg.lr_warmup_ratio, num_optimizer_steps or self.total_steps,
                                        cfg.min_lr_ratio)
        trainable = [param for param in model.parameters() if param.requires_grad]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config,
                                               lr_scheduler=schedule)
        if self.world_size == 1 and engine.zero_optimization_stage() == 0:
            # Without ZeRO, DeepSpeed all-reduces the gradients after each backward by flattening, reducing,
            # dividing and copying them back: on one rank an identity costing ~4 passes over the gradients.
            # (ZeRO 1-3 move gradients into their partitions in that call, so they keep it.)
            engine.enable_backward_allreduce = False
        guard_checkpoint_loads(engine)
        self.engines[name] = engine
        return engine

    def controller_state(self) -> dict[str, Any]:
        """Extra state saved with the step (e.g. the KL controller); stages override both methods."""
        return {}

    def restore_controller_state(self, state: dict[str, Any]) -> None:
        pass

    def save(self, directory: str) -> None:
        """All ranks write DeepSpeed state (unless disable_ds_ckpt) and gather ZeRO-3 weights; rank 0
        writes the HF copies (and the tokenizer if save_hf_ckpt)."""
        if not self.cfg.disable_ds_ckpt:
            self.save_state(directory)
        elif self.rank == 0:
            with open(os.path.join(directory, TRAINER_STATE_NAME), "w") as handle:
                json.dump({"step": self.step, "controller": self.controller_state(),
                           "global_steps": {name: engine.global_steps for name, engine in self.engines.items()}},
                          handle)
        fault_point("local_save", self.step)
        for name, engine in self.engines.items():
            self.save_hf(engine, os.path.join(directory, name, HF_WEIGHTS_DIR))
        dist.barrier()

    def save_state(self, directory: str) -> None:
        """Every engine's DeepSpeed state, with the step and the controller state: all a resume on the same world
        size needs (a snapshot between commits saves only this; a collective, as DeepSpeed's save is)."""
        client_state = {"step": self.step, "controller": self.controller_state(),
                        "universal_checkpoint_info": {"universal_checkpoint_version": 0.2}}
        for name, engine in self.engines.items():
            engine.save_checkpoint(os.path.join(directory, name), tag=DEEPSPEED_STATE_DIR,
                                   client_state=client_state, save_latest=False)

    def save_hf(self, engine, hf_dir: str) -> None:
        with gathered(engine):
            if self.rank == 0:
                engine.module.save_pretrained(hf_dir, safe_serialization=True)
                if self.cfg.save_hf_ckpt:
                    self.tokenizer.save_pretrained(hf_dir)

    def load(self, directory: str, universal: bool = False, weights_only: bool = False) -> int:
        """Restore the state saved in `directory`; with `weights_only` (or a checkpoint saved without
        DeepSpeed state), fresh optimizers whose LR schedules continue at the saved step (a restarted
        warmup would be a second shock)."""
        first = next(iter(self.engines))
        if not os.path.isdir(os.path.join(directory, first, DEEPSPEED_STATE_DIR)):
            return self.load_hf_weights(directory)
        client_states = []
        tag = UNIVERSAL_STATE_DIR if universal else DEEPSPEED_STATE_DIR
        for name, engine in self.engines.items():
            if weights_only and engine.zero_optimization_stage() == 3:
                # ZeRO-3's module-only load consolidates the fp32 partitions through zero_to_fp32, which
                # finds the tag in the `latest` file only (we save without it). Each rank loads from a
                # folder of its own.
                with open(os.path.join(directory, name, "latest"), "w") as handle:
                    handle.write(tag)
            dist.barrier()
            with reading_checkpoint(directory):
                _, client_state = engine.load_checkpoint(
                    os.path.join(directory, name), tag=tag,
                    load_optimizer_states=not weights_only, load_lr_scheduler_states=not weights_only,
                    load_module_only=weights_only,
                )
            client_states.append(client_state)
            if weights_only:  # DeepSpeed leaves the step count in the client state when loading the module only
                continue_schedule(engine, int(client_state["global_steps"]))
            else:
                apply_schedule(engine)
        self.step = int(client_states[0]["step"])
        self.restore_controller_state(client_states[0].get("controller", {}))
        return self.step

    def load_hf_weights(self, directory: str) -> int:
        """Resume a checkpoint saved with --disable_ds_ckpt: its `hf/` weights, a fresh optimizer."""
        with open(os.path.join(directory, TRAINER_STATE_NAME)) as handle:
            state = json.load(handle)
        if self.rank == 0:
            warn_once(f"resuming step {state['step']} from a checkpoint without DeepSpeed state (--disable_ds_ckpt): "
                      "weights restored, optimizer state starts fresh (as --load_weights_only).")
        for name, engine in self.engines.items():
            load_hf_into(engine, os.path.join(directory, name, HF_WEIGHTS_DIR))
            continue_schedule(engine, int(state["global_steps"][name]))  # PPO takes several per step
        self.step = int(state["step"])
        self.restore_controller_state(state.get("controller", {}))
        return self.step

    def is_chunk_end(self, step: int | None = None) -> bool:
        """Whether `step` (default: the current one) ends a chunk, where a checkpoint commits (the plan's)."""
        return (self.step if step is None else step) in self._chunk_ends

    def is_eval_step(self) -> bool:
        """OpenRLHF's schedule: every --eval_steps steps; with -1, once per epoch, at its last step (never for a
        stage that does not evaluate per epoch, PPO); the reward model also at every epoch's end. Not tied to the
        checkpoints: OpenRLHF evaluates and saves independently (`save_logs_and_checkpoints`)."""
        cfg, step = self.cfg, self.step
        epoch_end = self.steps_per_epoch > 0 and step % self.steps_per_epoch == 0
        if cfg.eval_steps > 0:
            return step % cfg.eval_steps == 0 or (self.evaluates_at_epoch_end and epoch_end)
        return self.evaluates_each_epoch and epoch_end

    def train_on(self, items: Sequence) -> dict[str, float]:
        """One optimizer step of `self.engine` on this step's global batch of `items` (`step_sample_indices`), its
        dropout seeded by (seed, stage, step, rank): each of this rank's micro-batches goes through `train_loss`.
        The step's metrics: the loss and `train_loss`'s metrics, each averaged over every rank's micro-batches,
        the LR, and the evaluation's when due (`evaluation`)."""
        cfg = self.cfg
        torch.manual_seed(derive_seed(self.run.seed, self.stage, self.step, self.rank, "dropout"))
        self.steps_per_epoch = len(items) // cfg.train_batch_size
        indices = step_sample_indices(self.step, cfg.train_batch_size, len(items), self.run.seed)
        self.engine.train()
        logs: dict[str, list[float]] = {}
        micro_batches = rank_micro_batches(indices, self.rank, self.world_size, cfg.micro_train_batch_size)
        for number, micro_batch in enumerate(micro_batches, 1):
            loss, values = self.train_loss([items[i] for i in micro_batch])
            self.engine.backward(loss)
            self.engine.step()
            self.signals.work_done("train", number, len(micro_batches))  # a step of many micro-batches moves too
            for name, value in {"loss": loss.item(), **values}.items():
                logs.setdefault(name, []).append(value)
        self.step += 1
        metrics = {"step": self.step, "loss": mean_over_ranks(logs.pop("loss")), "lr": self.engine.get_lr()[0]}
        metrics.update((name, mean_over_ranks(values)) for name, values in logs.items())
        return {**metrics, **self.evaluation()}

    def train_loss(self, batch: list) -> tuple[torch.Tensor, dict[str, float]]:
        """For `train_on`: the loss of one micro-batch of items, and its metrics by name (the same names on
        every call)."""
        raise NotImplementedError(f"{type(self).__name__} trains without train_on")

    def eval_items(self) -> Sequence:
        """What the stage evaluates on; none (the default): no evaluation."""
        return []

    def evaluation(self) -> dict[str, float]:
        """The evaluation's metrics when one is due (`is_eval_step`) and the stage has eval items, else none; its
        time goes to `eval_seconds`."""
        if not (self.is_eval_step() and self.eval_items()):
            return {}
        started = time.perf_counter()
        try:
            return self.evaluate()
        finally:
            self.eval_seconds += time.perf_counter() - started

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The eval metrics (`eval_metrics`) of the sums `eval_sums` gives for the eval items, over every rank.
        Each batch is progress for the hang watch and the driver's bar; a stop agreed by the ranks (Ctrl-C,
        SIGTERM) ends it at once, with no metrics, so that the emergency commit of the steps trained fits in
        --stop_grace_s."""
        for engine in self.engines.values():
            engine.eval()
        items = self.eval_items()
        batches = self.eval_micro_batches(items)
        per_round = self.cfg.micro_train_batch_size * self.world_size
        totals: dict[str, float] = {}
        for done, (batch, counted) in enumerate(batches, start=1):
            fault_point("eval_batch", done, tag=self.stage)  # entering the evaluation's batch `done`
            if self.signals.stop_agreed():
                if self.rank == 0:
                    warn_once(f"the evaluation at step {self.step} was stopped after {done - 1} of {len(batches)} "
                              "batches (a stop was requested): no eval metrics for that step.")
                return {}
            sums = self.eval_sums(batch)  # every pass runs, counted or not: see eval_micro_batches
            for name, value in sums.items():
                totals[name] = totals.get(name, 0.0) + (value if counted else 0.0)
            self.signals.work_done("eval", min(done * per_round, len(items)), len(items))
        return self.eval_metrics(dict(zip(totals, sum_over_ranks(*totals.values()))))

    def eval_sums(self, batch: list) -> dict[str, float]:
        """One eval micro-batch's sums by name (the same names on every call), the number of what they sum
        (items, tokens) as "count"."""
        raise NotImplementedError(f"{type(self).__name__} evaluates without eval_sums")

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """The metrics of the eval sums (`eval_sums`, summed over every micro-batch of every rank): each sum's
        mean over the count."""
        count = max(totals["count"], 1)
        return {name: total / count for name, total in totals.items() if name != "count"}

    def eval_micro_batches(self, items: Sequence) -> list[tuple[list, bool]]:
        """This rank's micro-batches of `items`, as (batch, counted). Every rank runs the same number of
        forward passes (ZeRO-3 gathers parameters collectively): a rank whose share ran out repeats the
        first item, and that pass is not counted."""
        size = self.cfg.micro_train_batch_size
        rounds = -(-len(items) // (size * self.world_size))
        batches = []
        for round_index in range(rounds):
            start = (round_index * self.world_size + self.rank) * size
            share = list(items[start : start + size])
            batches.append((share, True) if share else (list(items[:1]), False))
        return batches


def load_hf_into(engine, hf_dir: str) -> None:
    """Copy the safetensors weights of `hf_dir` into the engine's module (an adapter into a LoRA model),
    then refresh the optimizer's fp32 master copy from them."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        weights.update(load_file(path))
    module = engine.module
    with gathered(engine, modifier_rank=0):
        if hasattr(module, "peft_config"):
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(module, weights)
        else:
            unexpected = module.load_state_dict(weights, strict=False).unexpected_keys
            if unexpected:
                raise RuntimeError(f"{hf_dir} holds weights the model does not have: {unexpected[:5]}")
    for refresh in ("refresh_fp32_params", "_restore_from_bit16_weights"):
        if hasattr(engine.optimizer, refresh):
            getattr(engine.optimizer, refresh)()
            break


def apply_schedule(engine) -> None:
    """Put the schedule's current LR into the optimizer: a restored scheduler does not touch it."""
    for group, lr in zip(engine.lr_scheduler.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
        group["lr"] = lr


def continue_schedule(engine, global_steps: int) -> None:
    """A fresh optimizer whose LR schedule (a LambdaLR) continues after `global_steps` optimizer steps."""
    scheduler = engine.lr_scheduler
    engine.global_steps = scheduler.last_epoch = global_steps
    scheduler._last_lr = [base * factor(global_steps) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    apply_schedule(engine)
