"""A two-turn toy environment on the toy sort task, in OpenRLHF's agent form: the first answer earns nothing and
is answered by asking the prompt again; only the second answer is rewarded, with the gold score (the fraction
of positions holding the right digit). Deterministic: the same actions give the same feedback and reward."""

from rlhf_core.agent import AgentInstanceBase
from rlhf_core.toy import gold_score


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        self.prompt = states["observation"]
        return {"observation": self.prompt}

    async def step(self, states, **kwargs):
        self.turn += 1
        answer = states["action_text"].replace("</s>", " ")
        if self.turn == 1:
            self.first_score = gold_score(self.prompt, answer)
            return {"rewards": 0.0, "scores": 0.0, "environment_feedback": " " + self.prompt, "done": False,
                    "sampling_params": states["sampling_params"], "extra_logs": {}}
        reward = gold_score(self.prompt, answer)
        # OpenRLHF keeps the last step's extra_logs: both turns' scores are logged here
        return {"rewards": reward, "scores": reward, "environment_feedback": "", "done": True,
                "sampling_params": states["sampling_params"],
                "extra_logs": {"first_answer_score": self.first_score, "second_answer_score": reward}}
