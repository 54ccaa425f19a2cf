"""LoRA targets come from the model's own architecture: the default (`all-linear`) adapts every linear layer of
each family but its output head, and `--target_modules` names that a family does not have (a Llama list on
Phi-3's fused qkv_proj, or on GPT-2's Conv1D layers) are one sentence naming the flag and the layers it has,
before any rank starts, instead of peft's error inside a rank or, worse, adapters on only the names that happen
to match."""

from __future__ import annotations

import pytest

from rlhf_core.errors import UserError
from rlhf_core.driver.preflight import check_lora_targets
from rlhf_core.models.load import LoadOptions, load_causal_lm, load_scalar_model
from tests.families import FAMILIES, tiny_model
from tests.hub_cache import build_tokenizer

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPECTED_DEFAULT = {  # the linear layers of one decoder block, by family
    "qwen2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gemma": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "gpt2": {"c_attn", "c_proj", "c_fc"},
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """The tiny model and tokenizer of a few families, each saved as a model folder."""
    dirs = {}
    for name in EXPECTED_DEFAULT:
        tokenizer = build_tokenizer(FAMILIES[name].tokenizer)
        directory = tmp_path_factory.mktemp(name)
        tiny_model(FAMILIES[name], tokenizer).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        dirs[name] = str(directory)
    return dirs


def adapted_layers(model) -> set[str]:
    from peft.tuners.lora import LoraLayer

    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, LoraLayer)}


@pytest.mark.parametrize("family", sorted(EXPECTED_DEFAULT))
def test_the_default_adapts_every_linear_layer_of_the_family_but_its_head(family, family_dirs):
    policy = load_causal_lm(family_dirs[family], LoadOptions(lora_rank=4))
    assert adapted_layers(policy) == EXPECTED_DEFAULT[family]  # never lm_head, tied to the embeddings or not
    scorer = load_scalar_model(family_dirs[family], pad_token_id=0, options=LoadOptions(lora_rank=4))
    assert adapted_layers(scorer) == EXPECTED_DEFAULT[family]  # the new score head is trained whole, not adapted


def test_the_family_own_names_are_accepted(family_dirs):
    policy = load_causal_lm(family_dirs["phi3"], LoadOptions(lora_rank=4, target_modules=["qkv_proj", "gate_up_proj"]))
    assert adapted_layers(policy) == {"qkv_proj", "gate_up_proj"}
    check_lora_targets(family_dirs["gpt2"], ["c_attn"])  # preflight's check, on the folder


@pytest.mark.parametrize(("family", "missing"), [
    ("gpt2", "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
    ("phi3", "q_proj, k_proj, v_proj, gate_proj, up_proj"),  # o_proj and down_proj alone would match
])
def test_llama_names_on_another_family_are_one_sentence_naming_the_flag(family, missing, family_dirs):
    for check in (lambda: load_causal_lm(family_dirs[family], LoadOptions(lora_rank=4, target_modules=LLAMA_TARGETS)),
                  lambda: check_lora_targets(family_dirs[family], LLAMA_TARGETS)):
        with pytest.raises(UserError) as error:
            check()
        message = str(error.value)
        assert message.startswith(f"--target_modules: {missing} name no module of ") and "\n" not in message
        assert f"({family}); its linear layers are " in message and "all-linear" in message
        for layer in EXPECTED_DEFAULT[family]:
            assert layer in message


def test_preflight_refuses_them_for_a_stage_that_starts_from_an_earlier_stage_output(family_dirs, toy_assets,
                                                                                     tmp_path):
    """PPO's --pretrain is the SFT output, which does not exist yet: its architecture is SFT's --pretrain's."""
    from rlhf_core.driver.plan import resolve_paths
    from rlhf_core.config import RunConfig
    from rlhf_core.stages.ppo import PPOConfig
    from rlhf_core.stages.sft import SFTConfig
    from rlhf_core.driver.preflight import preflight

    run = resolve_paths(RunConfig(
        stages=["sft", "ppo"], ckpt_path=str(tmp_path / "ckpt"),
        sft=SFTConfig(pretrain=family_dirs["gpt2"], dataset=toy_assets["sft"], input_key="prompt",
                      output_key="response", max_len=64, train_batch_size=8, micro_train_batch_size=8,
                      save_path=str(tmp_path / "sft")),
        ppo=PPOConfig(prompt_data=toy_assets["prompts"], input_key="prompt", reward_fn="rlhf_core.toy:gold_reward",
                      advantage_estimator="reinforce", train_batch_size=16, micro_train_batch_size=8, lora_rank=4,
                      target_modules=["q_proj", "v_proj"],
                      save_path=str(tmp_path / "ppo"))))
    with pytest.raises(UserError, match=rf"^--target_modules: q_proj, v_proj name no module of "
                                        rf"{family_dirs['gpt2']} \(gpt2\); its linear layers are c_attn, c_proj, c_fc"):
        preflight(run)
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written
