"""PPO with its critic-free variants, one rank's share of a step: rollout, score, advantages, update, evaluation.
Rewards come from a reward model, `--reward_fn` / `--remote_rm_url`, or an agent's environment. Departs from
OpenRLHF: every model colocated on each rank; --dynamic_filtering masks samples out instead of drawing more prompts.
docs/design-notes.md ("PPO, one rank's share") has OpenRLHF's options as built here, and what the rank count changes.
"""

from __future__ import annotations

from collections.abc import Sequence
import contextlib
import logging
import math

import torch

from rlhf_core.rank import ppo_math
from rlhf_core.rank.agent_rollout import (AgentRollout, Episode, TransformersEngine, VLLMEngine, prompt_texts)
from rlhf_core.config import RunConfig
from rlhf_core.stages.ppo import PPOConfig
from rlhf_core.data.determinism import derive_seed, generator, step_sample_indices
from rlhf_core.models.load import LoadOptions, load_causal_lm, load_scalar_model, sequence_scores, token_values
from rlhf_core.storage.locate import load_tokenizer
from rlhf_core.rank.collectives import (agreed, all_reduce_sum, max_over_ranks, mean_extra_logs_over_ranks,
                                        mean_over_ranks, sum_over_ranks)
from rlhf_core.rank.experience import Experience, episode_rewards, pad_rows
from rlhf_core.rewards import RewardBatch, reward_function, reward_inputs
from rlhf_core.rank.rollout import (GenerationPieces, SamplingSettings, collate_sequences, generate, on_device,
                                    response_logits, response_logprobs)
from rlhf_core.data.prompts import PromptItem, load_prompts
from rlhf_core.rank.trainers.base import DeepSpeedTrainer, chained_model, gathered

logger = logging.getLogger(__name__)


def optimizer_steps_per_ppo_step(cfg: PPOConfig) -> int:
    return cfg.rollout_batch_size * cfg.n_samples_per_prompt // cfg.train_batch_size * cfg.max_epochs


class PPOTrainer(DeepSpeedTrainer[PPOConfig]):
    stage, config_class = "ppo", PPOConfig
    evaluates_each_epoch = False  # OpenRLHF's PPO: --eval_steps -1 never evaluates

    def __init__(self, run: RunConfig, chunk_ends: list[int], rank: int, world_size: int, load_universal: bool = False):
        super().__init__(run, chunk_ends, rank, world_size, load_universal)
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.start_model, run.storage_options)
        self.prompts = load_prompts(run, self.tokenizer)
        self.eval_prompts = load_prompts(run, self.tokenizer, eval_data=True) if cfg.eval_dataset else []
        self.kl = ppo_math.KLController(cfg.init_kl_coef, cfg.kl_target, cfg.kl_horizon)
        self.equal_rewards_chunk: int | None = None  # the chunk whose equal rewards were warned about
        num_optimizer_steps = self.total_steps * optimizer_steps_per_ppo_step(cfg)
        torch.manual_seed(derive_seed(run.seed, self.stage, "init"))
        frozen, storage_options = LoadOptions.frozen(cfg), run.storage_options
        actor = load_causal_lm(cfg.start_model, LoadOptions.trained(cfg), storage_options=storage_options)
        self.actor = self.build_engine("actor_model", actor, num_optimizer_steps=num_optimizer_steps)
        # The frozen models follow the actor onto its device and precision (bf16 on GPU if asked).
        placement = {"device": self.actor.device, "dtype": next(self.actor.module.parameters()).dtype}
        self.reference = None
        if cfg.init_kl_coef > 0:
            reference = load_causal_lm(cfg.start_model, frozen, storage_options=storage_options)
            self.reference = reference.eval().requires_grad_(False).to(**placement)
        self.scores_old_logprobs = self.reference is not None or optimizer_steps_per_ppo_step(cfg) > 1
        self.critic = None
        if cfg.advantage_estimator == "gae":
            critic = load_scalar_model(chained_model(cfg.critic_pretrain, "--critic_pretrain"),
                                       self.tokenizer.pad_token_id, frozen, storage_options=storage_options,
                                       flag="--critic_pretrain")
            self.critic = self.build_engine("critic_model", critic, cfg.critic_learning_rate, num_optimizer_steps)
        self.reward_fn = reward_function(cfg.reward_fn, cfg.remote_rm_url)
        self.agent = None  # with --agent_func_path, the environment rewards its episodes
        if cfg.agent_func_path:
            self.agent = AgentRollout(cfg.agent_func_path, self.tokenizer, cfg.prompt_max_len + cfg.max_new_tokens,
                                      cfg.top_p)
        self.reward_model, self.reward_normalization = None, None
        if self.reward_fn is None and self.agent is None:
            reward_model = load_scalar_model(chained_model(cfg.reward_pretrain, "--reward_pretrain"),
                                             self.tokenizer.pad_token_id, frozen, storage_options=storage_options,
                                             flag="--reward_pretrain")
            self.reward_model = reward_model.eval().requires_grad_(False).to(**placement)
            self.reward_normalization = self.recorded_reward_statistics(reward_model) if cfg.normalize_reward else None
        self.vllm = None
        if cfg.vllm_num_engines:
            from rlhf_core.rank.vllm_engine import VLLMGenerator

            self.vllm = VLLMGenerator(cfg, run.seed, rank)

    def recorded_reward_statistics(self, reward_model) -> tuple[float, float] | None:
        """(mean, std) the RM stage recorded in the reward model's config.json, or None (warned once)."""
        mean, std = (getattr(reward_model.config, name, None) for name in ("mean", "std"))
        if mean is None or std is None or not std > 0:
            if self.rank == 0:
                logger.warning("--normalize_reward: %s records no reward mean/std in its config.json; scores are "
                               "used as they are.", self.cfg.reward_pretrain)
            return None
        return float(mean), float(std)

    def controller_state(self) -> dict:
        return {"kl_coef": self.kl.coef}

    def restore_controller_state(self, state: dict) -> None:
        self.kl.coef = state.get("kl_coef", self.kl.coef)

    def whole(self, engine):
        """With ZeRO-3, each rank holds a slice of every parameter: gather them for generation and scoring."""
        return contextlib.nullcontext() if engine is None else gathered(engine)

    def rank_prompts(self) -> list[PromptItem]:
        indices = step_sample_indices(self.step, self.cfg.rollout_batch_size, len(self.prompts), self.run.seed)
        share = len(indices) // self.world_size
        return [self.prompts[i] for i in indices[self.rank * share : (self.rank + 1) * share]]

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        with self.autocast():  # bf16 autocast on a CPU run with --param_dtype bf16, as SFT and RM
            experience = self.make_experience()
        self.warn_if_rewards_equal(experience.rewards)
        # Whitening and KL statistics are over every rank's samples (all_reduce_sum).
        mask = experience.mask * experience.keep[:, None]  # filtered samples leave the update
        kl_in_reward = torch.zeros_like(experience.kl) if cfg.use_kl_loss else experience.kl
        settings = ppo_math.AdvantageSettings(cfg.advantage_estimator, self.kl.coef, cfg.gamma, cfg.lambd,
                                              cfg.n_samples_per_prompt, cfg.reward_clip_range)
        advantages, returns = ppo_math.advantages_and_returns(settings, experience.rewards, kl_in_reward, mask,
                                                              experience.values, reduce=all_reduce_sum)
        experience = experience.with_advantages(advantages, returns, mask)
        [kept] = sum_over_ranks(experience.keep.sum().item())
        losses = self.update(experience) if kept > 0 else {}
        # The global batch's KL and sample count: every rank's controller takes the same step.
        observed_kl, num_samples = ppo_math.batch_kl(experience.kl, experience.mask, all_reduce_sum)
        self.kl.update(observed_kl, num_samples)
        self.step += 1
        metrics = {**mean_extra_logs_over_ranks(experience.extra_logs),
                   "step": self.step, "reward": mean_over_ranks(experience.rewards.tolist()),
                   "kl": observed_kl, "kl_coef": self.kl.coef,
                   "response_length": mean_over_ranks(experience.mask.sum(-1).tolist()),
                   "lr": self.actor.get_lr()[0], **{k: mean_over_ranks(v) for k, v in losses.items()}}
        if cfg.dynamic_filtering:
            metrics["dynamic_filtering_pass_rate"] = 100 * kept / sum_over_ranks(len(experience.keep))[0]
        return {**metrics, **self.evaluation()}

    def warn_if_rewards_equal(self, rewards: torch.Tensor) -> None:
        """A rollout batch (every rank's samples) whose rewards are all equal: one warning, at most once per chunk,
        since no response scores better than another (a reward function in the wrong form, a broken one)."""
        highest, negated_lowest = max_over_ranks(
            [rewards.max().item(), -rewards.min().item()] if rewards.numel() else [-math.inf, -math.inf])
        chunk = self.step // self.cfg.save_steps if self.cfg.save_steps > 0 else 0
        if self.rank != 0 or highest != -negated_lowest or chunk == self.equal_rewards_chunk:
            return
        self.equal_rewards_chunk = chunk
        logger.warning("ppo step %d: every reward of the rollout batch is %.4g, so its advantages carry no reward "
                       "signal and the policy learns nothing from it; check the reward function or model (shown "
                       "at most once per chunk).", self.step + 1, highest)

    @torch.no_grad()
    def make_experience(self) -> Experience:
        """Sample, then score: old and reference log-probs, values, rewards, per-token KL, filtering."""
        cfg = self.cfg
        torch.manual_seed(derive_seed(self.run.seed, self.stage, self.step, self.rank, "rollout"))
        items = [item for item in self.rank_prompts() for _ in range(cfg.n_samples_per_prompt)]
        first = self.rank * len(items)  # the global index of this rank's first sample: its episodes' seeds
        seeds = [derive_seed(self.run.seed, self.stage, self.step, "episode", first + i) for i in range(len(items))]
        self.actor.eval()
        prompts, responses, action_masks, episodes = self.roll_out(items, seeds, cfg.temperature, use_vllm=True)
        rows: dict[str, list] = {"old_logprobs": [], "ref_logprobs": [], "values": []}
        with self.whole(self.actor), self.whole(self.critic):
            for start in range(0, len(prompts), cfg.micro_rollout_batch_size):
                part = slice(start, start + cfg.micro_rollout_batch_size)
                self.score_micro_batch(prompts[part], responses[part], rows)
                self.signals.work_done("score", min(part.stop, len(prompts)), len(prompts))  # progress too
        rewarded = self.rollout_rewards(items, responses, episodes)
        lengths = [len(response) for response in responses]
        # A model's rows (None: not scored), cut to each response's length.
        scored = {name: pad_rows([row[:n] for row, n in zip(model_rows, lengths)]) if model_rows else None
                  for name, model_rows in rows.items()}
        mask = pad_rows([torch.tensor(mask, dtype=torch.float32) for mask in action_masks])
        keep = torch.ones(len(items))
        if cfg.dynamic_filtering:
            keep = ppo_math.group_filter(torch.tensor(rewarded.scores), cfg.n_samples_per_prompt,
                                         *cfg.dynamic_filtering_reward_range)
        kl = torch.zeros_like(mask)
        old_logprobs, ref_logprobs = scored["old_logprobs"], scored["ref_logprobs"]
        if old_logprobs is not None and ref_logprobs is not None:  # a reference model (the actor then scores too)
            kl = ppo_math.kl_estimate(old_logprobs, ref_logprobs, cfg.kl_estimator) * mask
        return Experience(prompts, responses, torch.tensor(rewarded.rewards), mask, keep, kl, rewarded.extra_logs,
                          **scored)

    def roll_out(self, items: list[PromptItem], seeds: list[int], temperature: float, use_vllm: bool):
        """(prompts, responses, action masks, episodes) of `items`: sampled responses (every token the model's,
        episodes None), or with --agent_func_path the agent's episodes, each seeded with its seed."""
        if self.agent is None:
            responses = self.sample([item.ids for item in items], temperature, use_vllm)
            return [item.ids for item in items], responses, [[1] * len(r) for r in responses], None
        agent, vllm, eos_token_id = self.agent, self.vllm if use_vllm else None, self.tokenizer.eos_token_id
        with self.whole(self.actor), vllm.serving(self.actor.module) if vllm is not None else contextlib.nullcontext():
            engine = (VLLMEngine(vllm, self.tokenizer, eos_token_id) if vllm is not None
                      else TransformersEngine(self.actor.module, self.tokenizer, eos_token_id))
            pieces = GenerationPieces(self.signals, len(items), agent.max_length)  # an episode, told by token blocks
            engine.on_tokens = pieces.tokens
            episodes = agreed(lambda: agent.run(engine, prompt_texts(self.tokenizer, items), seeds, temperature,
                                                on_episode=pieces.part_done))
        return ([e.prompt for e in episodes], [e.response for e in episodes], [e.action_mask for e in episodes],
                episodes)

    def sample(self, prompts: list[list[int]], temperature: float, use_vllm: bool) -> list[list[int]]:
        """One response per prompt. Each block of TOKEN_BLOCK tokens of a micro-batch (with vLLM: each finished
        request) is progress for the hang watch and the driver's bar: a rollout of minutes is no hang."""
        cfg, eos_token_id, batch_size = self.cfg, self.tokenizer.eos_token_id, self.cfg.micro_rollout_batch_size
        with self.whole(self.actor):
            if self.vllm is not None and use_vllm:
                requests = GenerationPieces(self.signals, len(prompts), 1)
                return self.vllm.generate(self.actor.module, prompts, self.step, eos_token_id, requests.part_done)
            pieces = GenerationPieces(self.signals, math.ceil(len(prompts) / batch_size), cfg.max_new_tokens)
            sampling, responses = SamplingSettings(cfg.max_new_tokens, temperature, cfg.top_p), []
            for start in range(0, len(prompts), batch_size):
                responses += generate(self.actor.module, prompts[start : start + batch_size],
                                      self.tokenizer.pad_token_id, eos_token_id, sampling, on_tokens=pieces.tokens)
                pieces.part_done()
        return responses

    def score_micro_batch(self, prompts, responses, rows: dict) -> None:
        # Experience is kept on the CPU in float32, whatever device and precision the models use.
        batch = collate_sequences(prompts, responses, self.tokenizer.pad_token_id)
        if self.scores_old_logprobs:
            rows["old_logprobs"] += list(response_logprobs(self.actor.module, batch).cpu())
        if self.reference is not None:
            rows["ref_logprobs"] += list(response_logprobs(self.reference, batch).cpu())
        if self.critic is not None:
            values = token_values(self.critic.module, batch["input_ids"], batch["attention_mask"])
            rows["values"] += list(values[:, batch["prompt_len"] - 1 : -1].float().cpu())

    def rollout_rewards(self, items: list[PromptItem], responses: list[list[int]],
                        episodes: list[Episode] | None) -> RewardBatch:
        """The rewards of a rollout (`roll_out`): the agent's episodes', else the reward model's or function's."""
        return self.rewards(items, responses) if episodes is None else episode_rewards(episodes)

    @torch.no_grad()
    def rewards(self, items: list[PromptItem], responses: list[list[int]]) -> RewardBatch:
        """Rewards of this rank's samples. A reward function's mistake on any rank stops every rank with the
        same sentence (a rank left behind would wait in the next collective forever)."""
        def score() -> RewardBatch:
            if self.reward_fn is not None:
                return self.reward_fn(reward_inputs(self.tokenizer, items, responses)) if items else RewardBatch([], [])
            scores = self.reward_model_scores([item.ids for item in items], responses)
            return RewardBatch(scores, list(scores))

        return agreed(score)

    def reward_model_scores(self, prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
        assert self.reward_model is not None, "loaded when neither a reward function nor an agent rewards"
        scores = []
        for start in range(0, len(prompts), self.cfg.micro_rollout_batch_size):
            part = slice(start, start + self.cfg.micro_rollout_batch_size)
            inputs = on_device(collate_sequences(prompts[part], responses[part], self.tokenizer.pad_token_id),
                               self.reward_model.device)
            scores += sequence_scores(self.reward_model, inputs["input_ids"], inputs["attention_mask"]).float().tolist()
            self.signals.work_done("score", len(scores), len(prompts))
        if self.reward_normalization is not None:
            mean, std = self.reward_normalization
            scores = [(score - mean) / std for score in scores]
        return scores

    def update(self, experience: Experience) -> dict[str, list[float]]:
        """max_epochs passes of micro-batch updates; DeepSpeed steps at each accumulation boundary."""
        cfg, num_rows = self.cfg, len(experience.prompts)
        train_actor = self.step >= cfg.freezing_actor_steps  # OpenRLHF: global step (1-based) > N
        names = (["policy_loss", "clip_fraction"] if train_actor else []) + (
            ["entropy_loss"] if train_actor and cfg.entropy_loss_coef is not None else []) + (
            ["critic_loss"] if self.critic else [])
        losses: dict[str, list[float]] = {name: [] for name in names}
        self.actor.train()
        per_epoch = math.ceil(num_rows / cfg.micro_train_batch_size)
        for epoch in range(cfg.max_epochs):
            order = torch.randperm(num_rows, generator=generator(self.run.seed, self.stage, self.step, self.rank,
                                                                  epoch)).tolist()
            for number, start in enumerate(range(0, num_rows, cfg.micro_train_batch_size), 1):
                rows = order[start : start + cfg.micro_train_batch_size]
                for name, value in self.update_micro_batch(experience, rows, train_actor).items():
                    losses[name].append(value)
                self.signals.work_done("train", epoch * per_epoch + number, cfg.max_epochs * per_epoch)
        return losses

    def update_micro_batch(self, experience: Experience, rows: list[int], train_actor: bool) -> dict[str, float]:
        cfg = self.cfg
        batch = collate_sequences([experience.prompts[i] for i in rows],
                                  [experience.responses[i] for i in rows], self.tokenizer.pad_token_id)
        width = batch["action_mask"].shape[1]

        def take(tensor: torch.Tensor) -> torch.Tensor:
            """The micro-batch's rows of a per-token tensor, cut to its responses' width, on the actor's device."""
            return tensor[rows, :width].to(self.actor.device)

        advantages, returns, loss_mask = experience.update_tensors()
        mask = take(loss_mask)
        result = {}
        if train_actor:
            with self.autocast():
                logprobs, entropy = self.actor_logprobs(batch)
            eps_low, eps_high = cfg.eps_clip_low_high or (cfg.eps_clip, cfg.eps_clip)
            # Without sampling-time log-probs (`scores_old_logprobs`), the update's own stand in for them.
            old_logprobs = logprobs.detach() if experience.old_logprobs is None else take(experience.old_logprobs)
            loss, clip_fraction = ppo_math.policy_loss(logprobs, old_logprobs, take(advantages), mask,
                                                       eps_low, eps_high)
            if cfg.use_kl_loss and experience.ref_logprobs is not None:  # GRPO: the KL in the loss, not the reward
                loss = loss + self.kl.coef * ppo_math.masked_mean(
                    ppo_math.kl_estimate(logprobs, take(experience.ref_logprobs), cfg.kl_estimator), mask)
            result = {"policy_loss": loss.item(), "clip_fraction": clip_fraction.item()}
            if entropy is not None and cfg.entropy_loss_coef is not None:  # 0 measures the entropy, else adds the bonus
                loss, mean_entropy = ppo_math.entropy_bonus(loss, entropy, mask, cfg.entropy_loss_coef)
                result["entropy_loss"] = mean_entropy.item()
            self.actor.backward(loss)
            self.actor.step()
        if self.critic is not None and experience.values is not None:  # values: the critic's, at sampling
            with self.autocast():
                values = token_values(self.critic.module, batch["input_ids"], batch["attention_mask"])
            values = values[:, batch["prompt_len"] - 1 : -1].float()
            critic_loss = ppo_math.value_loss(values, take(experience.values), take(returns), mask, cfg.value_clip)
            self.critic.backward(critic_loss)
            self.critic.step()
            result["critic_loss"] = critic_loss.item()
        return result

    def actor_logprobs(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The actor's log-probs of the response tokens and, with --entropy_loss_coef set, the entropy of each
        response position's distribution (from the same forward pass; detached when the coefficient is 0)."""
        coef = self.cfg.entropy_loss_coef
        if coef is None:
            return response_logprobs(self.actor, batch), None
        logits, tokens = response_logits(self.actor, batch)
        entropy = ppo_math.token_entropy(logits if coef else logits.detach())
        return ppo_math.token_logprobs(logits, tokens), entropy

    def eval_items(self) -> Sequence[PromptItem]:
        return self.eval_prompts

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """`eval_reward`: the mean reward of eval_n_samples_per_prompt samples per eval prompt at eval_temperature,
        over every rank (a rollout, not the base's loop over micro-batches)."""
        cfg = self.cfg
        torch.manual_seed(derive_seed(self.run.seed, self.stage, self.step, self.rank, "eval"))
        items = [item for item in self.eval_prompts[self.rank :: self.world_size]
                 for _ in range(cfg.eval_n_samples_per_prompt)]
        self.actor.eval()
        # Every rank samples, even with no prompt left to it: with ZeRO-3 the gather is a collective.
        per_prompt = cfg.eval_n_samples_per_prompt  # seeded by (the prompt's place in the eval data, the sample)
        seeds = [derive_seed(self.run.seed, self.stage, self.step, "eval-episode",
                             self.rank + index // per_prompt * self.world_size, index % per_prompt)
                 for index in range(len(items))]
        with self.autocast():  # the same precision as the training rollouts
            _, responses, _, episodes = self.roll_out(items, seeds, cfg.eval_temperature, use_vllm=False)
        return {"eval_reward": mean_over_ranks(self.rollout_rewards(items, responses, episodes).rewards)}
