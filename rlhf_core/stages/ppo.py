"""PPO and its relatives (REINFORCE++, RLOO, GRPO, Dr. GRPO): OpenRLHF's `train_ppo_ray`; its trainer is
`rlhf_core.rank.trainers.ppo`."""

from __future__ import annotations

import importlib.util
import re
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rlhf_core.errors import UserError
from rlhf_core.stages.base import DataSource, Earlier, Ref, Stage, StageConfig, input_location, operational, restated


class PPOConfig(StageConfig):
    """PPO and its critic-free variants (REINFORCE++, RLOO, GRPO) on prompts, rewarded by a reward
    model or a Python function. One optimizer "step" here is one PPO step: a rollout and its update."""

    pretrain: str | None = Field(None, **input_location("Actor (and reference) to start from; default: the SFT output.",
                                                role="model"))
    reward_pretrain: str | None = Field(None, **input_location("Reward model; default: the RM output of this run.",
                                                       role="model"))
    reward_fn: str | None = Field(None, description="A Python reward function 'package.module:function', used instead "
                                                    "of a reward model (verifiable rewards): OpenRLHF's form "
                                                    "(queries, prompts, labels, **kwargs) or fn(prompts, responses), "
                                                    "told apart by its signature.")
    critic_pretrain: str | None = Field(None, **input_location("Critic to start from (gae only); default: the reward model, "
                                                       "else the actor (a new value head).", role="model"))
    prompt_data: str = Field(**input_location("Prompts, in any form --dataset takes (several, comma-separated, are mixed by "
                                      "dataset_probs).", role="data"))
    input_key: str = Field("input", description="Key of the prompt in each sample.")
    apply_chat_template: bool = Field(False, description="Wrap the prompt in the tokenizer's chat template.")
    advantage_estimator: Literal["gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo"] = Field(
        "gae", description="gae (PPO with a critic), reinforce (REINFORCE++), rloo, reinforce_baseline, group_norm "
                           "(GRPO), dr_grpo (GRPO without std normalization).")
    n_samples_per_prompt: int = Field(1, ge=1, description="Responses sampled per prompt.")
    rollout_batch_size: int = Field(1024, ge=1, description="Prompts per PPO step (all ranks).")
    micro_rollout_batch_size: int = Field(8, ge=1, description="Sequences per generation / scoring pass per rank.")
    num_episodes: int = Field(1, ge=1, description="Passes over the prompt data.")
    # train_ppo_ray's (the actor's learning rate; 0.11's micro batch is 1, see flows.openrlhf_flags)
    learning_rate: float = restated("learning_rate", 1e-6)
    micro_train_batch_size: int = restated("micro_train_batch_size", 4)
    max_samples: int | None = restated("max_samples", 100_000_000)
    max_epochs: int = Field(1, ge=1, description="Optimisation passes over each rollout.")
    prompt_max_len: int = Field(128, ge=1, description="Prompts are truncated to this many tokens (from the left).")
    max_new_tokens: int = Field(64, ge=1, description="Maximum tokens generated per response.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    init_kl_coef: float = Field(0.01, ge=0, description="KL penalty coefficient (initial, if kl_target is set).")
    kl_target: float | None = Field(None, gt=0, description="Adaptive KL controller target; default: fixed coefficient.")
    kl_horizon: int = Field(10000, ge=1, description="Adaptive KL controller horizon (samples).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="KL estimator: k1 (log ratio), k2, k3 (Schulman).")
    eps_clip: float = Field(0.2, gt=0, description="PPO policy ratio clip.")
    eps_clip_low_high: tuple[float, float] | None = Field(
        None, description="Asymmetric ratio clip (low high), e.g. DAPO's clip-higher 0.2 0.28; default: eps_clip "
                          "both ways.")
    entropy_loss_coef: float | None = Field(
        None, allow_inf_nan=False,
        description="Entropy bonus of the actor loss (OpenRLHF's): unset, none; 0, the policy's mean entropy over "
                    "the response tokens is logged as entropy_loss and the loss is unchanged; otherwise the loss "
                    "minus coef x that entropy.")
    value_clip: float = Field(0.5, gt=0, description="PPO value clip (gae).")
    gamma: float = Field(1.0, gt=0, le=1, description="Discount factor.")
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    critic_learning_rate: float = Field(9e-6, gt=0, description="Critic learning rate (gae).")
    remote_rm_url: str | None = Field(None, **input_location("OpenRLHF's reward function: a .py file defining "
                                                        "reward_func(queries, prompts, labels, **kwargs) (or "
                                                        "reward_func(prompts, responses)), or an HTTP reward server "
                                                        "URL (as serve_remote_rm.sh); replaces the reward model.",
                                                        role="path"))
    agent_func_path: str | None = Field(None, **input_location(
        "OpenRLHF's multi-turn agent: a .py file defining AgentInstance (and optionally AgentExecutor) on the base "
        "classes of rlhf_core.agent; its episodes replace sampling and their rewards replace the reward model. "
        "max_new_tokens is then each episode's budget after the prompt, feedback included.", role="path"))
    label_key: str | None = Field(None, description="Key of each prompt's label (e.g. the answer), passed to the "
                                                    "reward function as `labels`.")
    prompt_split: str = Field("train", description="Split of prompt_data when it is a hub dataset name.")
    normalize_reward: bool = Field(False, description="Normalize reward-model scores with the mean and std the "
                                                      "reward model recorded in its config at training time.")
    reward_clip_range: tuple[float, float] = Field((-10.0, 10.0), description="Rewards are clipped to [low, high].")
    use_kl_loss: bool = Field(False, description="Put the KL to the reference in the loss (GRPO style, with "
                                                 "kl_estimator) instead of in the reward.")
    dynamic_filtering: bool = Field(False, description="Drop prompts whose samples' mean score lies outside "
                                                       "dynamic_filtering_reward_range (all right or all wrong).")
    dynamic_filtering_reward_range: tuple[float, float] = Field(
        (0.0, 1.0), description="Keep a prompt only when its samples' mean score is strictly inside (low, high).")
    freezing_actor_steps: int = Field(-1, description="Train only the critic for the first N PPO steps (gae).")
    save_value_network: bool = Field(False, **operational("Also export the critic, to {save_path}_critic."))
    eval_temperature: float = Field(0.6, gt=0, **operational("Sampling temperature of the evaluation rollouts."))
    eval_n_samples_per_prompt: int = Field(4, ge=1, **operational("Samples per evaluation prompt."))
    vllm_num_engines: int = Field(0, ge=0, description="vLLM engines for generation (GPU, `[vllm]` extra), one per rank: "
                                                        "equal to num_workers; 0: transformers generate.")
    vllm_tensor_parallel_size: int = Field(1, ge=1, description="Tensor parallel size of each vLLM engine "
                                                                      "(1: engines are colocated one per rank).")
    vllm_gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="GPU memory fraction vLLM may take.")
    enable_prefix_caching: bool = Field(False, description="vLLM's prefix caching (with vllm_num_engines): a "
                                                          "multi-turn agent's every turn repeats the episode so far.")
    vllm_enable_sleep: bool = Field(False, description="Let vLLM release GPU memory while the models train.")
    save_path: str = Field("./out/ppo", **operational("Where the final policy is exported (an adapter if LoRA).",
                                                       role="output"))

    earlier_defaults = {"learning_rate": 5e-6, "micro_train_batch_size": 8, "max_samples": None,
                        "rollout_batch_size": 16, "value_clip": 0.2, "lambd": 0.95}
    step_size_field: ClassVar[str] = "rollout_batch_size"  # prompts per PPO step

    def items_per_step(self) -> int:
        return self.rollout_batch_size

    def num_passes(self) -> int:
        return self.num_episodes

    def data_source(self) -> DataSource:
        """The prompts, in their own split setting."""
        return DataSource(self.prompt_data, self.prompt_split, "--prompt_data")

    def extra_exports(self) -> dict[str, str]:
        """With --save_value_network, the critic (gae's) in {save_path}_critic, as OpenRLHF."""
        if self.save_value_network and self.advantage_estimator == "gae":
            return {"critic_model": f"{self.save_path.rstrip('/')}_critic"}
        return {}

    @model_validator(mode="after")
    def _cross_field_checks(self) -> "PPOConfig":
        if self.reward_fn is not None and not re.fullmatch(r"[\w.]+:\w+", self.reward_fn):
            raise ValueError(f"reward_fn {self.reward_fn!r} must look like 'package.module:function'")
        low, high = self.dynamic_filtering_reward_range
        if self.dynamic_filtering and (self.n_samples_per_prompt < 2 or not low < high):
            raise ValueError("dynamic_filtering compares the samples of one prompt: set n_samples_per_prompt >= 2 "
                             "and dynamic_filtering_reward_range LOW HIGH with LOW < HIGH")
        if self.reward_fn is not None and self.remote_rm_url is not None:
            raise ValueError("reward_fn and remote_rm_url both replace the reward model: give one of them")
        if self.agent_func_path is not None and (self.reward_fn or self.remote_rm_url):
            raise ValueError("agent_func_path's environment rewards each episode: drop reward_fn and remote_rm_url")
        if self.advantage_estimator in ("rloo", "reinforce_baseline", "group_norm", "dr_grpo") and self.n_samples_per_prompt < 2:
            raise ValueError(f"{self.advantage_estimator} compares samples of one prompt: set n_samples_per_prompt >= 2")
        if self.vllm_num_engines and self.vllm_tensor_parallel_size != 1:
            raise ValueError("vllm_tensor_parallel_size must be 1: each rank hosts a whole vLLM engine next to its "
                             "models (use more num_workers for more engines)")
        if (self.rollout_batch_size * self.n_samples_per_prompt) % self.train_batch_size:
            raise ValueError(f"rollout_batch_size x n_samples_per_prompt ({self.rollout_batch_size * self.n_samples_per_prompt})"
                             f" must be a multiple of train_batch_size ({self.train_batch_size})")
        return self

    def chained(self, earlier: Earlier) -> PPOConfig:
        """The actor starts from the SFT output, the reward model is the RM output; as OpenRLHF, a gae critic
        starts from the reward model, or from the actor when a function rewards."""
        updates: dict[str, str | None] = {}
        if self.pretrain is None:
            updates["pretrain"] = earlier.output("sft")
        if self.reward_pretrain is None and not (self.reward_fn or self.remote_rm_url or self.agent_func_path):
            updates["reward_pretrain"] = earlier.output("rm")
        reward_model = updates.get("reward_pretrain", self.reward_pretrain)
        if reward_model is not None and earlier.ran("prm") and reward_model == earlier.output("prm"):
            raise ValueError("ppo.reward_pretrain is the output of prm, a process reward model (a language model "
                             "that labels each step at its placeholder tokens), not a reward model with a score "
                             "head: run rm for PPO's reward, or give reward_fn")
        if self.advantage_estimator == "gae" and self.critic_pretrain is None:
            produced_rm = earlier.output("rm") if earlier.ran("rm") else None
            updates["critic_pretrain"] = reward_model or produced_rm or updates.get("pretrain", self.pretrain)
        return self.model_copy(update=updates)

    def check_in_run(self, stage: str, num_workers: int) -> None:
        super().check_in_run(stage, num_workers)
        if self.rollout_batch_size % num_workers:
            raise ValueError(f"{stage}.rollout_batch_size ({self.rollout_batch_size}) must be a multiple of num_workers")
        if self.vllm_num_engines not in (0, num_workers):
            raise ValueError(f"{stage}.vllm_num_engines ({self.vllm_num_engines}) must be 0 or num_workers "
                             f"({num_workers}): each rank hosts its own vLLM engine")



def require_vllm(num_engines: int) -> None:
    """vLLM generation needs CUDA and the `[vllm]` extra; say so before any worker starts."""
    if num_engines == 0:
        return
    import torch  # here, not at the top: the stage tables load in every command, torch only where it runs

    if not torch.cuda.is_available():
        raise UserError("--vllm_num_engines needs a GPU; use 0 (transformers generation) on this machine.")
    if importlib.util.find_spec("vllm") is None:
        raise UserError("--vllm_num_engines needs vLLM: pip install 'rlhf-pipeline[vllm]'.")

STAGE = Stage("ppo", PPOConfig, "train", position=30, description="Settings of the PPO stage.",
              trainer=Ref("rlhf_core.rank.trainers.ppo", "PPOTrainer"), openrlhf_module="train_ppo_ray",
              headline_metrics=("eval_reward", "mean_reward", "reward"), higher_is_better=True,
              stall_hint="the learning rate, the KL coefficient or the reward", is_policy=True,
              world_size_dependent=True, count_items=Ref("rlhf_core.data.prompts", "count_ppo_prompts"))
