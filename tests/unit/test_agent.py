"""Multi-turn agent rollouts (`--agent_func_path`): OpenRLHF's agent files run with one import changed, only the
model's own tokens carry loss, the length budget cuts an episode, episodes replay exactly from their seeds, and a
broken agent file is named in one sentence."""

from __future__ import annotations

import asyncio
import random
import textwrap
from pathlib import Path

import pytest
import torch

from rlhf_core.agent import CompletionOutput, RequestOutput
from rlhf_core.errors import UserError
from rlhf_core.rank import ppo_math
from rlhf_core.rank.agent_rollout import AgentRollout, TransformersEngine
from rlhf_core.stages.ppo import PPOConfig
from rlhf_core.toy import build_model, build_tokenizer

OPENRLHF_EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "openrlhf" / "v0.9.0" / "agent_func.py"
OPENRLHF_IMPORT = "from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase"
OUR_IMPORT = "from rlhf_core.agent import AgentExecutorBase, AgentInstanceBase"

# Two turns: the first action is answered with " user : again", the second ends the episode with reward 1.
TWO_TURNS = textwrap.dedent('''
    from rlhf_core.agent import AgentInstanceBase

    class AgentInstance(AgentInstanceBase):
        def __init__(self, *args, **kwargs):
            self.turn = 0

        async def reset(self, states, **kwargs):
            return {"observation": states["observation"]}

        async def step(self, states, **kwargs):
            self.turn += 1
            done = self.turn == 2
            return {"rewards": 1.0 if done else 0.25, "scores": 1.0 if done else 0.0,
                    "environment_feedback": "" if done else " user : again", "done": done,
                    "sampling_params": states["sampling_params"], "extra_logs": {"turns": self.turn}}
''')


class ScriptedEngine(TransformersEngine):
    """The engine with its sampling replaced by fixed actions, one per turn, so the expected mask is known."""

    def __init__(self, tokenizer, actions: list[list[int]]):
        super().__init__(None, tokenizer, tokenizer.eos_token_id)
        self.actions, self.budgets = actions, []

    async def generate(self, prompt_ids, params):
        self.budgets.append(params.max_tokens)
        tokens = self.actions[(len(self.budgets) - 1) % len(self.actions)][: params.max_tokens]
        return RequestOutput([CompletionOutput(tokens, self.tokenizer.decode(tokens))])


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def agent_file(tmp_path: Path, text: str, name: str = "agent.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def prompt(tokenizer, text: str = "sort : 5 3 8 =") -> tuple[str, list[int], str]:
    return text, tokenizer(text).input_ids, ""  # the ids as PPO's prompt items hold them: BOS added


def test_only_the_models_tokens_carry_loss(tokenizer, tmp_path):
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    first, second = ids("3 5") + [tokenizer.eos_token_id], ids("3 5 8") + [tokenizer.eos_token_id]
    engine = ScriptedEngine(tokenizer, [first, second])
    rollout = AgentRollout(agent_file(tmp_path, TWO_TURNS), tokenizer, max_length=64, top_p=1.0)
    text, prompt_ids, label = prompt(tokenizer)
    [episode] = rollout.run(engine, [(text, prompt_ids, label)], seeds=[0], temperature=1.0)
    feedback = ids(" user : again")
    assert episode.prompt == prompt_ids  # the tokens PPO's prompt item holds (BOS kept), not a re-tokenization
    assert episode.response == first + feedback + second
    assert episode.action_mask == [1] * len(first) + [0] * len(feedback) + [1] * len(second)
    assert (episode.reward, episode.score, episode.extra_logs) == (1.25, 1.0, {"turns": 2.0})
    assert engine.budgets == [64 - len(prompt_ids), 64 - len(prompt_ids) - len(first) - len(feedback)]


def test_the_length_budget_cuts_the_episode_and_its_mask(tokenizer, tmp_path):
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    text, prompt_ids, label = prompt(tokenizer)
    budget = len(prompt_ids) + 3 + 2  # the first action (3 tokens), then 2 of the feedback's 4
    engine = ScriptedEngine(tokenizer, [ids("3 5 8"), ids("3 5 8")])
    rollout = AgentRollout(agent_file(tmp_path, TWO_TURNS), tokenizer, max_length=budget, top_p=1.0)
    [episode] = rollout.run(engine, [(text, prompt_ids, label)], seeds=[0], temperature=1.0)
    assert len(engine.budgets) == 1  # no room left for a second action
    assert episode.response == ids("3 5 8") + ids(" user : again")[:2]
    assert episode.action_mask == [1, 1, 1, 0, 0]


def test_openrlhfs_example_runs_with_its_import_changed_and_replays_from_its_seeds(tokenizer, tmp_path):
    """OpenRLHF's v0.9.0 agent_func.py draws its number of turns with random.randint (in an async __init__) and
    its final reward with torch.randint: seeded per episode, both replay whatever the process drew before."""
    source = OPENRLHF_EXAMPLE.read_text()
    assert OPENRLHF_IMPORT in source
    path = agent_file(tmp_path, source.replace(OPENRLHF_IMPORT, OUR_IMPORT), "agent_func.py")
    rollout = AgentRollout(path, tokenizer, max_length=48, top_p=1.0)
    prompts = [prompt(tokenizer, f"sort : {a} {b} =") for a, b in [(3, 1), (7, 2), (5, 5), (9, 0)] * 2]
    one_token = ScriptedEngine(tokenizer, [[tokenizer.eos_token_id]] * 100)  # short actions: the turns decide

    random.seed(1), torch.manual_seed(1)
    first = rollout.run(one_token, prompts, list(range(8)), 1.0)
    random.seed(2), torch.manual_seed(2)
    one_token.budgets.clear()
    assert rollout.run(one_token, prompts, list(range(8)), 1.0) == first
    assert len({sum(episode.action_mask) for episode in first}) > 1  # 2 to 4 turns, as randint(1, 3) drew
    assert {episode.reward for episode in first} == {0.0, 1.0}

    model = build_model(len(tokenizer), seed=0).eval()  # and transformers sampling, seeded the same way
    sampled = [rollout.run(TransformersEngine(model, tokenizer, tokenizer.eos_token_id), prompts[:2], seeds, 1.0)
               for seeds in ([1, 2], [1, 2], [3, 4])]
    assert sampled[0] == sampled[1] != sampled[2]
    assert all(len(e.prompt) + len(e.response) <= 48 and sum(e.action_mask) >= 1 for e in sampled[0])


def test_an_unchanged_openrlhf_import_is_named_with_the_line_to_write(tokenizer, tmp_path):
    path = agent_file(tmp_path, OPENRLHF_EXAMPLE.read_text(), "agent_func.py")
    with pytest.raises(UserError, match=f"{path}: cannot load it .*openrlhf.*change its import to `{OUR_IMPORT}`"):
        AgentRollout(path, tokenizer, max_length=48, top_p=1.0)


@pytest.mark.parametrize("body, problem", [
    ("x = 1\n", "the file defines neither AgentExecutor"),
    ("def broken(:\n", "cannot load it \\(SyntaxError"),
])
def test_a_file_without_an_agent_is_refused_in_one_sentence(tokenizer, tmp_path, body, problem):
    path = agent_file(tmp_path, body)
    with pytest.raises(UserError, match=f"--agent_func_path {path}: {problem}"):
        AgentRollout(path, tokenizer, max_length=48, top_p=1.0)


def test_an_exception_in_the_environment_names_the_agent_file(tokenizer, tmp_path):
    path = agent_file(tmp_path, TWO_TURNS.replace("self.turn += 1", "raise KeyError('answer')"))
    engine = ScriptedEngine(tokenizer, [[tokenizer.eos_token_id]])
    rollout = AgentRollout(path, tokenizer, max_length=48, top_p=1.0)
    with pytest.raises(UserError, match=f"--agent_func_path {path}: the agent raised KeyError: 'answer'"):
        rollout.run(engine, [prompt(tokenizer)], seeds=[0], temperature=1.0)


def test_an_async_init_and_a_sync_step_are_both_accepted(tokenizer, tmp_path):
    text = (TWO_TURNS.replace("def __init__(self, *args, **kwargs):", "async def __init__(self, *args, **kwargs):")
            .replace("async def step", "def step"))
    engine = ScriptedEngine(tokenizer, [[tokenizer.eos_token_id]] * 2)
    [episode] = AgentRollout(agent_file(tmp_path, text), tokenizer, 48, 1.0).run(engine, [prompt(tokenizer)], [0], 1.0)
    assert episode.reward == 1.25


def test_the_first_turns_actions_get_the_last_turns_reward_across_the_environments_tokens():
    """gae and the critic-free estimators over a mask with a hole (two actions around feedback): the reward on
    the last action token reaches the first action's tokens, as in OpenRLHF."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]]).repeat(2, 1)  # two episodes: rewards 1 and 0
    kl = torch.zeros_like(mask)
    for estimator, values in (("gae", torch.zeros_like(mask)), ("reinforce", None), ("group_norm", None)):
        settings = ppo_math.AdvantageSettings(estimator, kl_coef=0.0, gamma=1.0, lambd=1.0, group_size=2)
        advantages, _ = ppo_math.advantages_and_returns(settings, torch.tensor([1.0, 0.0]), kl, mask, values)
        assert advantages[0, :2].min() > 0 and advantages[:, [2, 3, 6]].abs().max() == 0, estimator


def test_the_agent_rewards_its_episodes_so_no_reward_model_is_chained():
    from rlhf_core.config import RunConfig
    from rlhf_core.stages.sft import SFTConfig

    run = RunConfig(stages=["sft", "ppo"], sft=SFTConfig(pretrain="m", dataset="d.jsonl"),
                    ppo=PPOConfig(prompt_data="p.jsonl", agent_func_path="agent.py", train_batch_size=16))
    assert run.ppo.reward_pretrain is None and run.ppo.pretrain == run.sft.save_path
    with pytest.raises(ValueError, match="agent_func_path's environment rewards each episode"):
        PPOConfig(prompt_data="p.jsonl", agent_func_path="agent.py", reward_fn="rlhf_core.toy:gold_reward",
                  train_batch_size=16)


def test_the_event_loop_is_the_rollouts_own(tokenizer, tmp_path):
    """A rank may call the rollout from any thread; it never needs (or disturbs) a running loop."""
    rollout = AgentRollout(agent_file(tmp_path, TWO_TURNS), tokenizer, 48, 1.0)
    engine = ScriptedEngine(tokenizer, [[tokenizer.eos_token_id]] * 2)

    async def inside_a_loop():
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: rollout.run(engine, [prompt(tokenizer)], [0], 1.0))

    assert asyncio.run(inside_a_loop())[0].reward == 1.25
