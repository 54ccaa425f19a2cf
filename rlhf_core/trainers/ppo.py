"""PPO with its critic-free variants, one rank's share: rollout, score, advantages, update.

One PPO step takes `rollout_batch_size` prompts (from the (seed, episode) order; this rank takes its
contiguous share), samples `n_samples_per_prompt` responses each with the actor, scores them with the
reward model or `--reward_fn`, computes per-token KL to the frozen reference and the advantages of
`--advantage_estimator`, then runs `max_epochs` passes of clipped-surrogate updates (and clipped value
updates for gae). Models are colocated on each rank (actor, critic, reference, reward), a departure
from OpenRLHF's separate actor groups that keeps one readable path; fine for toy and small models.
Responses come from transformers `generate`, or on GPU from a colocated vLLM engine per rank
(`--vllm_num_engines`, see `rlhf_core.vllm_engine`).
"""

from __future__ import annotations

import torch

from rlhf_core import ppo_math
from rlhf_core.config import PPOConfig, RunConfig
from rlhf_core.data import read_records, tokenize_prompts
from rlhf_core.determinism import derive_seed, generator, step_sample_indices
from rlhf_core.models import load_causal_lm, load_scalar_model, load_tokenizer, token_values
from rlhf_core.rollout import (collate_sequences, generate, load_reward_fn, on_device, require_vllm,
                               response_logprobs)
from rlhf_core.trainers.base import DeepSpeedTrainer


def load_prompts(run: RunConfig, tokenizer) -> list[tuple[str, list[int]]]:
    cfg = run.ppo
    records = read_records(cfg.prompt_data, max_samples=cfg.max_samples)
    return tokenize_prompts(cfg.prompt_data, records, tokenizer, cfg.input_key, cfg.prompt_max_len,
                            cfg.apply_chat_template)


def optimizer_steps_per_ppo_step(cfg: PPOConfig) -> int:
    return cfg.rollout_batch_size * cfg.n_samples_per_prompt // cfg.train_batch_size * cfg.max_epochs


def pad_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True) if rows else torch.zeros(0, 0)


class PPOTrainer(DeepSpeedTrainer):
    stage = "ppo"
    export_model_dir = "actor_model"
    step_size_flag = "rollout_batch_size"

    @staticmethod
    def count_items(run: RunConfig) -> int:
        require_vllm(run.ppo.vllm_num_engines)
        if run.ppo.reward_fn:
            load_reward_fn(run.ppo.reward_fn)
        return len(load_prompts(run, load_tokenizer(run.ppo.pretrain)))

    @staticmethod
    def items_per_step(cfg: PPOConfig) -> int:
        return cfg.rollout_batch_size

    @staticmethod
    def num_passes(cfg: PPOConfig) -> int:
        return cfg.num_episodes

    def __init__(self, run: RunConfig, total_steps: int, rank: int, world_size: int, load_universal: bool = False):
        super().__init__(run, total_steps, rank, world_size, load_universal)
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.pretrain)
        self.prompts = load_prompts(run, self.tokenizer)
        self.kl = ppo_math.KLController(cfg.init_kl_coef, cfg.kl_target)
        num_optimizer_steps = total_steps * optimizer_steps_per_ppo_step(cfg)
        torch.manual_seed(derive_seed(run.seed, self.stage, "init"))
        actor = load_causal_lm(cfg.pretrain, cfg.lora_rank, cfg.lora_alpha, cfg.target_modules,
                               cfg.gradient_checkpointing)
        self.actor = self.build_engine("actor_model", actor, num_optimizer_steps=num_optimizer_steps)
        # The frozen models follow the actor onto its device and precision (bf16 on GPU if asked).
        placement = {"device": self.actor.device, "dtype": next(self.actor.module.parameters()).dtype}
        self.reference = load_causal_lm(cfg.pretrain).eval().requires_grad_(False).to(**placement)
        self.critic = None
        if cfg.advantage_estimator == "gae":
            critic = load_scalar_model(cfg.critic_pretrain, self.tokenizer.pad_token_id)
            self.critic = self.build_engine("critic_model", critic, cfg.critic_learning_rate, num_optimizer_steps)
        self.reward_fn = load_reward_fn(cfg.reward_fn) if cfg.reward_fn else None
        self.reward_model = None if self.reward_fn else \
            load_scalar_model(cfg.reward_pretrain, self.tokenizer.pad_token_id).eval().requires_grad_(False) \
            .to(**placement)
        self.vllm = None
        if cfg.vllm_num_engines:
            from rlhf_core.vllm_engine import VLLMGenerator

            self.vllm = VLLMGenerator(cfg, run.seed, rank)

    def controller_state(self) -> dict:
        return {"kl_coef": self.kl.coef}

    def restore_controller_state(self, state: dict) -> None:
        self.kl.coef = state.get("kl_coef", self.kl.coef)

    def rank_prompts(self) -> list[tuple[str, list[int]]]:
        indices = step_sample_indices(self.step, self.cfg.rollout_batch_size, len(self.prompts), self.run.seed)
        share = len(indices) // self.world_size
        return [self.prompts[i] for i in indices[self.rank * share : (self.rank + 1) * share]]

    def train_step(self) -> dict[str, float]:
        experience = self.make_experience()
        advantages, returns = ppo_math.advantages_and_returns(
            self.cfg.advantage_estimator, experience["scores"], experience["kl"], experience["mask"],
            experience.get("values"), self.kl.coef, self.cfg.gamma, self.cfg.lambd, self.cfg.n_samples_per_prompt)
        experience.update(advantages=advantages, returns=returns)
        losses = self.update(experience)
        observed_kl = ppo_math.masked_mean(experience["kl"], experience["mask"]).item()
        self.kl.update(observed_kl, len(experience["scores"]))
        self.step += 1
        return {"step": self.step, "reward": self.mean_over_ranks(experience["scores"].tolist()),
                "kl": self.mean_over_ranks([observed_kl]), "kl_coef": self.kl.coef,
                "response_length": self.mean_over_ranks(experience["mask"].sum(-1).tolist()),
                "lr": self.actor.get_lr()[0], **{k: self.mean_over_ranks(v) for k, v in losses.items()}}

    @torch.no_grad()
    def make_experience(self) -> dict:
        """Sample, then score: old and reference log-probs, values, rewards, per-token KL."""
        cfg = self.cfg
        torch.manual_seed(derive_seed(self.run.seed, self.stage, self.step, self.rank, "rollout"))
        texts, prompts = [], []
        for text, ids in self.rank_prompts():
            texts += [text] * cfg.n_samples_per_prompt
            prompts += [ids] * cfg.n_samples_per_prompt
        self.actor.eval()
        responses = self.sample(prompts)
        rows: dict[str, list] = {"old_logprobs": [], "ref_logprobs": [], "values": [], "scores": []}
        for start in range(0, len(prompts), cfg.micro_rollout_batch_size):
            part = slice(start, start + cfg.micro_rollout_batch_size)
            self.score_micro_batch(prompts[part], responses[part], texts[part], rows)
        lengths = [len(response) for response in responses]
        experience = {"prompts": prompts, "responses": responses, "scores": torch.tensor(rows["scores"]),
                      "mask": pad_rows([torch.ones(n) for n in lengths])}
        for name in ("old_logprobs", "ref_logprobs") + (("values",) if self.critic else ()):
            experience[name] = pad_rows([row[:n] for row, n in zip(rows[name], lengths)])
        experience["kl"] = ppo_math.kl_estimate(experience["old_logprobs"], experience["ref_logprobs"],
                                                cfg.kl_estimator) * experience["mask"]
        return experience

    def sample(self, prompts: list[list[int]]) -> list[list[int]]:
        cfg, eos_token_id = self.cfg, self.tokenizer.eos_token_id
        if self.vllm is not None:
            return self.vllm.generate(self.actor.module, prompts, self.step, eos_token_id)
        responses = []
        for start in range(0, len(prompts), cfg.micro_rollout_batch_size):
            responses += generate(self.actor.module, prompts[start : start + cfg.micro_rollout_batch_size],
                                  self.tokenizer.pad_token_id, eos_token_id, cfg.max_new_tokens, cfg.temperature,
                                  cfg.top_p)
        return responses

    def score_micro_batch(self, prompts, responses, texts, rows: dict) -> None:
        # Experience is kept on the CPU in float32, whatever device and precision the models use.
        batch = collate_sequences(prompts, responses, self.tokenizer.pad_token_id)
        rows["old_logprobs"] += list(response_logprobs(self.actor.module, batch).cpu())
        rows["ref_logprobs"] += list(response_logprobs(self.reference, batch).cpu())
        if self.critic is not None:
            values = token_values(self.critic.module, batch["input_ids"], batch["attention_mask"])
            rows["values"] += list(values[:, batch["prompt_len"] - 1 : -1].float().cpu())
        if self.reward_fn is not None:
            decoded = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
            rows["scores"] += [float(score) for score in self.reward_fn(texts, decoded)]
        else:
            inputs = on_device(batch, self.reward_model.device)
            rows["scores"] += self.reward_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
                                                ).logits.squeeze(-1).float().tolist()

    def update(self, experience: dict) -> dict[str, list[float]]:
        """max_epochs passes of micro-batch updates; DeepSpeed steps at each accumulation boundary."""
        cfg, num_rows = self.cfg, len(experience["prompts"])
        losses: dict[str, list[float]] = {"policy_loss": [], "clip_fraction": []} | (
            {"critic_loss": []} if self.critic else {})
        self.actor.train()
        for epoch in range(cfg.max_epochs):
            order = torch.randperm(num_rows, generator=generator(self.run.seed, self.stage, self.step, self.rank,
                                                                  epoch)).tolist()
            for start in range(0, num_rows, cfg.micro_train_batch_size):
                rows = order[start : start + cfg.micro_train_batch_size]
                for name, value in self.update_micro_batch(experience, rows).items():
                    losses[name].append(value)
        return losses

    def update_micro_batch(self, experience: dict, rows: list[int]) -> dict[str, float]:
        cfg = self.cfg
        batch = collate_sequences([experience["prompts"][i] for i in rows],
                                  [experience["responses"][i] for i in rows], self.tokenizer.pad_token_id)
        width = batch["action_mask"].shape[1]

        def take(name: str) -> torch.Tensor:
            return experience[name][rows, :width].to(self.actor.device)

        mask = batch["action_mask"].to(self.actor.device)
        logprobs = response_logprobs(self.actor, batch)
        loss, clip_fraction = ppo_math.policy_loss(logprobs, take("old_logprobs"), take("advantages"), mask,
                                                   cfg.eps_clip)
        if cfg.advantage_estimator == "group_norm":  # GRPO keeps the KL out of the reward, in the loss
            loss = loss + self.kl.coef * ppo_math.masked_mean(
                ppo_math.kl_estimate(logprobs, take("ref_logprobs"), "k3"), mask)
        self.actor.backward(loss)
        self.actor.step()
        result = {"policy_loss": loss.item(), "clip_fraction": clip_fraction.item()}
        if self.critic is not None:
            values = token_values(self.critic.module, batch["input_ids"], batch["attention_mask"])
            values = values[:, batch["prompt_len"] - 1 : -1].float()
            critic_loss = ppo_math.value_loss(values, take("values"), take("returns"), mask, cfg.value_clip)
            self.critic.backward(critic_loss)
            self.critic.step()
            result["critic_loss"] = critic_loss.item()
        return result
