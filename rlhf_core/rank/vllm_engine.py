"""vLLM generation for PPO on GPU (the optional `[vllm]` extra, imported lazily): one in-process engine per rank,
colocated with its models, given the actor's weights (LoRA merged in) before each rollout. Departs from OpenRLHF's
separate vLLM actors: one engine per rank, tensor parallel 1, always colocated; a resume with vLLM is statistically
equal, not exact. docs/design-notes.md ("vLLM engines, colocated") says why.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch

from rlhf_core.stages.ppo import PPOConfig
from rlhf_core.data.determinism import derive_seed
from rlhf_core.rank.rollout import SamplingSettings
from rlhf_core.storage.locate import is_lora_dir, local_model_dir, lora_base_dir


@torch.no_grad()
def inference_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under Hugging Face names, LoRA adapters merged in (what vLLM loads).

    The merge is computed out of place (base + delta per layer): merging into the trained weights and
    unmerging again, as `merge_adapter` does, would round them a little differently at every step in bf16.
    """
    if not hasattr(model, "peft_config"):
        yield from model.state_dict().items()
        return
    from peft.tuners.lora import LoraLayer

    merged = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            weight = module.base_layer.weight
            for adapter in module.active_adapters:
                # peft declares get_delta_weight on each concrete LoRA layer (Linear, Embedding...), not on LoraLayer
                weight = weight + module.get_delta_weight(adapter).to(weight.dtype)  # type: ignore[attr-defined]
            merged[f"{name}.base_layer.weight"] = weight
    for name, tensor in model.state_dict().items():
        if "lora_" not in name:
            hf_name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            yield hf_name, merged.get(name, tensor)


def _load_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs on vLLM's (in-process) worker: vLLM maps HF names onto its fused layers itself."""
    worker.model_runner.model.load_weights(weights=weights)


def _engine_model_dir(pretrain: str) -> str:
    """Where vLLM reads the architecture (config.json): the base model when `pretrain` is an adapter."""
    directory = local_model_dir(pretrain)
    if not is_lora_dir(directory):
        return directory
    return lora_base_dir(directory)


class FinishedRequests:
    """What vLLM's `generate(use_tqdm=...)` takes in place of tqdm: each request it finishes tells `on_finished`
    (a piece of work for the hang watch); nothing is drawn. vLLM's offline loop gives no per-token hook, so a piece
    is a finished request. Some versions also wrap the requests they add with it: then it only iterates."""

    def __init__(self, iterable: Iterable | None = None, *, on_finished: Callable[[], None], **_tqdm_options: Any):
        self.iterable, self.on_finished, self.postfix = iterable, on_finished, ""

    def __iter__(self) -> Iterator:
        return iter(self.iterable or ())

    def update(self, count: int = 1) -> None:
        for _ in range(count):
            self.on_finished()

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


class VLLMGenerator:
    """A colocated vLLM engine that samples responses for one rank's prompts."""

    def __init__(self, cfg: PPOConfig, seed: int, rank: int):
        # Imported here: the `[vllm]` extra is optional and GPU-only.
        from vllm import LLM

        from transformers import AutoConfig

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine stays in this process
        self.cfg, self.seed, self.rank = cfg, seed, rank
        model_dir = _engine_model_dir(cfg.start_model)
        longest = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)
        self.llm = LLM(
            model=model_dir,
            load_format="dummy",  # the actor's weights are loaded before the first rollout
            skip_tokenizer_init=True,  # prompts and responses travel as token ids
            dtype="bfloat16" if cfg.bf16 else "float32",
            tensor_parallel_size=1,
            distributed_executor_backend="external_launcher",
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            max_model_len=min(cfg.prompt_max_len + cfg.max_new_tokens, longest or 1 << 30),
            enable_sleep_mode=cfg.vllm_enable_sleep,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enforce_eager=True,
            seed=seed,
        )
        if cfg.vllm_enable_sleep:
            self.llm.sleep(level=2)

    @contextmanager
    def serving(self, actor: torch.nn.Module) -> Iterator[None]:
        """The engine awake with the actor's current weights inside; asleep again after (with vllm_enable_sleep)."""
        if self.cfg.vllm_enable_sleep:
            self.llm.wake_up()
        self.llm.collective_rpc(_load_weights, args=(list(inference_weights(actor)),))
        try:
            yield
        finally:
            if self.cfg.vllm_enable_sleep:
                self.llm.sleep(level=2)

    def generate(self, actor: torch.nn.Module, prompts: list[list[int]], step: int, eos_token_id: int,
                 on_finished: Callable[[], None] | None = None) -> list[list[int]]:
        """One response per prompt, sampled with the actor's current weights; each ends at its first EOS.
        `on_finished()`: told as each request finishes."""
        seeds = [derive_seed(self.seed, "ppo", step, self.rank, "vllm", index) % 2**31 for index in range(len(prompts))]
        with self.serving(actor):
            sampling = SamplingSettings(self.cfg.max_new_tokens, self.cfg.temperature, self.cfg.top_p)
            return self.sample(prompts, seeds, sampling, eos_token_id, on_finished)

    def sample(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings, eos_token_id: int,
               on_finished: Callable[[], None] | None = None) -> list[list[int]]:
        """One response per prompt from the loaded weights (inside `serving`), one seed per prompt."""
        from vllm import SamplingParams

        params = [SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=sampling.max_new_tokens, stop_token_ids=[eos_token_id], detokenize=False,
                                 seed=seed) for seed in seeds]
        progress = functools.partial(FinishedRequests, on_finished=on_finished) if on_finished else False
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=progress)
        responses = []
        for output in outputs:
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            if eos_token_id in tokens:
                tokens = tokens[: tokens.index(eos_token_id) + 1]
            elif completion.finish_reason == "stop":  # stopped by the EOS id without returning it
                tokens.append(eos_token_id)
            responses.append(tokens)
        return responses
