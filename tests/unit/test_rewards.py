"""Reward functions in every form (module, OpenRLHF file, OpenRLHF HTTP server on loopback), every
accepted return shape, and every mistake stopping with one sentence that names the function."""

from __future__ import annotations

import json
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlhf_core import rewards
from rlhf_core.errors import UserError
from rlhf_core.data.prompts import count_ppo_prompts
from rlhf_core.rewards import RewardInputs, parse_reward_output, reward_function

INPUTS = RewardInputs(raw_prompts=["sort : 2 1 =", "sort : 3 1 ="], prompts=["sort : 2 1 =", "sort : 3 1 ="],
                      queries=["sort : 2 1 = 1 2 </s>", "sort : 3 1 = 3 1 </s>"], responses=["1 2", "3 1"],
                      labels=["1 2", "1 3"])

REWARD_FILE = '''
import torch

def reward_func(queries, prompts, labels, **kwargs):
    answers = [query[len(prompt):].replace("</s>", "").strip() for query, prompt in zip(queries, prompts)]
    correct = torch.tensor([float(answer == label) for answer, label in zip(answers, labels)])
    return {"rewards": correct * 2, "scores": correct, "extra_logs": {"accuracy": correct, "batch": correct.mean()}}
'''


def write_reward_file(tmp_path, body: str) -> str:
    path = tmp_path / "reward_func.py"
    path.write_text(body)
    return str(path)


def test_openrlhf_reward_file_gets_queries_prompts_labels_and_returns_the_dict_form(tmp_path):
    function = reward_function(None, write_reward_file(tmp_path, REWARD_FILE))
    result = function(INPUTS)
    assert result.rewards == [2.0, 0.0] and result.scores == [1.0, 0.0]
    assert result.extra_logs == {"accuracy": [1.0, 0.0], "batch": [0.5]}


@pytest.mark.parametrize("output", [torch.tensor([0.5, 1.0]), [0.5, 1], torch.tensor([[0.5], [1.0]]),
                                    {"rewards": [0.5, 1.0]}])
def test_tensor_list_and_dict_forms_are_accepted_and_scores_default_to_rewards(output):
    result = parse_reward_output("f", output, 2)
    assert result.rewards == result.scores == [0.5, 1.0] and result.extra_logs == {}


def test_module_reward_fn_keeps_our_form():
    function = reward_function("rlhf_core.toy:gold_reward", None)
    assert function(INPUTS).rewards == [1.0, 0.0]  # gold_reward(raw prompts, responses)


@pytest.mark.parametrize("output, problem", [
    ([1.0], "returned 1 rewards for 2 samples"),
    (torch.tensor([1.0, math.nan]), "rewards[1] = nan"),
    ([1.0, math.inf], "rewards[1] = inf"),
    (["good", 1.0], "rewards[0] = 'good', not a number"),
    ([None, 1.0], "rewards[0] = None, not a number"),
    (None, "returned rewards of type NoneType"),
    ({"scores": [1.0, 1.0]}, "a dict without 'rewards'"),
    ({"rewards": [1.0, 1.0], "scores": [1.0]}, "returned 1 scores for 2 samples"),
    ({"rewards": [1.0, 1.0], "extra_logs": {"x": [math.nan]}}, "extra_logs['x'][0] = nan"),
])
def test_malformed_rewards_are_one_sentence_naming_the_function(tmp_path, output, problem):
    path = write_reward_file(tmp_path, "def reward_func(queries, prompts, labels, **kwargs):\n    return OUTPUT\n")
    function = reward_function(None, path)
    function._call = lambda inputs: output  # the same checks whatever the output came from
    with pytest.raises(UserError) as error:
        function(INPUTS)
    message = str(error.value)
    assert problem in message and path in message and "reward_func" in message and "\n" not in message


def test_an_exception_in_the_function_names_the_file_and_the_error(tmp_path):
    path = write_reward_file(tmp_path, "def reward_func(queries, prompts, labels, **kwargs):\n    return 1 / 0\n")
    with pytest.raises(UserError, match=r"--remote_rm_url .*reward_func\.py \(reward_func\) raised "
                                        r"ZeroDivisionError: division by zero\."):
        reward_function(None, path)(INPUTS)


@pytest.mark.parametrize("body, problem", [
    ("def reward_func(:\n", "cannot load it (SyntaxError"),
    ("import no_such_module_here\n", "cannot load it (ModuleNotFoundError"),
    ("def other(queries, prompts, labels):\n    return queries\n", "defines no function reward_func"),
    ("reward_func = 3\n", "defines no function reward_func"),
])
def test_a_reward_file_that_does_not_load_is_refused_at_load(tmp_path, body, problem):
    with pytest.raises(UserError) as error:
        reward_function(None, write_reward_file(tmp_path, body))
    assert problem in str(error.value) and "--remote_rm_url" in str(error.value)


def test_a_missing_reward_file_or_module_is_refused(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        reward_function(None, str(tmp_path / "missing.py"))
    with pytest.raises(UserError, match=r"--reward_fn no_such_module:f: cannot import it \(ModuleNotFoundError"):
        reward_function("no_such_module:f", None)
    with pytest.raises(UserError, match="--reward_fn rlhf_core.toy:DIGITS: DIGITS is a list, not a function"):
        reward_function("rlhf_core.toy:DIGITS", None)


# --- either form through either flag, told apart by the signature ---

OPENRLHF_BODY = """
def {name}(queries, prompts, labels, **kwargs):
    return [float(query.startswith(prompt) and label == "1 2") for query, prompt, label in zip(queries, prompts, labels)]
"""
OURS_BODY = """
def {name}(prompts, responses):
    return [float(response == " ".join(sorted(prompt.split()[2:-1]))) for prompt, response in zip(prompts, responses)]
"""


def reward_module(tmp_path, monkeypatch, body: str) -> str:
    """`body` as an importable module of its own (a fresh name each time: imports are cached); its spec."""
    name = f"user_rewards_{len(list(tmp_path.glob('user_rewards_*.py')))}_{abs(hash(body))}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize("flag", ["reward_fn", "remote_rm_url"])
@pytest.mark.parametrize("body", [OPENRLHF_BODY, OURS_BODY], ids=["openrlhf-form", "our-form"])
def test_either_form_through_either_flag_is_called_in_its_own_form(tmp_path, monkeypatch, flag, body):
    if flag == "reward_fn":
        module = reward_module(tmp_path, monkeypatch, body.format(name="score"))
        function = reward_function(f"{module}:score", None)
    else:
        function = reward_function(None, write_reward_file(tmp_path, body.format(name="reward_func")))
    # OpenRLHF's: each query starts with its prompt and sample 0's label is right; ours: "1 2" sorts "2 1"
    assert function(INPUTS).rewards == [1.0, 0.0]


OPENRLHF_FORM, OUR_FORM = ("queries", "prompts", "labels"), ("prompts", "responses")


def sig(source: str):
    namespace: dict = {}
    exec(source, namespace)
    return namespace["f"]


@pytest.mark.parametrize("source, form", [
    ("def f(queries, prompts, labels, **kwargs): pass", OPENRLHF_FORM),
    ("def f(queries, prompts, labels, /): pass", OPENRLHF_FORM),  # positional-only: names still count
    ("def f(queries, prompts, labels=None): pass", OPENRLHF_FORM),  # 2 arguments fit, but `queries` first
    ("def f(q, p, l): pass", OPENRLHF_FORM),  # unnamed: only three positional arguments fit
    ("def f(queries, prompts, *rest): pass", OPENRLHF_FORM),
    ("def f(prompts, responses): pass", OUR_FORM),
    ("def f(prompts, responses, **kwargs): pass", OUR_FORM),
    ("def f(prompts, responses, labels=None): pass", OUR_FORM),  # 3 fit, but `prompts` first
    ("def f(prompts, completions): pass", OUR_FORM),
    ("def f(a, b, *, scale=1.0): pass", OUR_FORM),
])
def test_the_form_is_read_from_the_signature(source, form):
    assert rewards.reward_form("fn", sig(source)) == form


@pytest.mark.parametrize("source, which", [
    ("def f(*args, **kwargs): pass", "fits both"),
    ("def f(a, b, c=None): pass", "fits both"),
    ("def f(prompts, queries, labels): pass", "fits neither"),  # OpenRLHF's names in the wrong places
    ("def f(completions, **kwargs): pass", "fits neither"),  # TRL's form
    ("def f(*, queries, prompts, labels): pass", "fits neither"),  # keyword-only: OpenRLHF calls positionally
    ("def f(a, b, c, d): pass", "fits neither"),
])
def test_a_signature_that_fits_both_forms_or_neither_is_refused_naming_both(source, which):
    with pytest.raises(UserError) as error:
        rewards.reward_form("--reward_fn m:f", sig(source))
    message = str(error.value)
    assert message.startswith("--reward_fn m:f: its signature f(") and which in message and "\n" not in message
    assert "reward_func(queries, prompts, labels, **kwargs)" in message and "fn(prompts, responses)" in message


def test_an_ambiguous_reward_fn_is_refused_before_training_with_exit_2_and_no_traceback(
        toy_assets, tmp_path, monkeypatch, capsys):
    """`rlhf train ppo` in-process: preflight refuses it; should it get past preflight, the run fails instead
    of starting its flow."""
    import flows.pipeline
    from flows.cli import main
    from rlhf_core.ops import console

    def past_preflight(*args, **kwargs):
        raise AssertionError("an ambiguous reward function got past preflight")

    monkeypatch.setattr(flows.pipeline, "StageRunner", past_preflight)
    module = reward_module(tmp_path, monkeypatch, "def score(*args, **kwargs):\n    return [1.0] * len(args[0])\n")
    try:
        code = main(["train", "ppo", "--pretrain", toy_assets["model"], "--prompt_data", toy_assets["prompts"],
                     "--input_key", "prompt", "--reward_fn", f"{module}:score", "--rollout_batch_size", "4",
                     "--train_batch_size", "4", "--micro_train_batch_size", "4", "--advantage_estimator",
                     "reinforce", "--ckpt_path", str(tmp_path / "ckpt"), "--save_path", str(tmp_path / "out")])
    finally:
        console.reset_console()  # a run that got further leaves the quiet console on: the next tests' logging
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("rlhf: error:")]
    assert errors == [f"rlhf: error: --reward_fn {module}:score: its signature score(*args, **kwargs) fits both "
                      f"reward-function forms, so which arguments it wants cannot be told; define it as OpenRLHF's "
                      f"reward_func(queries, prompts, labels, **kwargs) or ours, fn(prompts, responses)."], stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "out").exists()


def test_our_form_gets_the_last_user_message_of_a_prompt_given_as_messages(toy_assets):
    from rlhf_core.storage.locate import load_tokenizer
    from rlhf_core.data.prompts import PromptItem
    from rlhf_core.rewards import reward_inputs

    tokenizer = load_tokenizer(toy_assets["model"])
    messages = [{"role": "system", "content": "sort the digits"}, {"role": "user", "content": "sort : 3 1 ="},
                {"role": "assistant", "content": "1 3"}, {"role": "user", "content": "sort : 2 1 ="}]
    items = [PromptItem(messages, tokenizer("sort : 2 1 =").input_ids, "", bos_added=True),
             PromptItem([{"role": "system", "content": "only a system turn"}], [4, 5], ""),
             PromptItem("sort : 4 1 =", [4, 5], "")]
    inputs = reward_inputs(tokenizer, items, [[2], [2], [2]])
    assert inputs.raw_prompts == ["sort : 2 1 =", "only a system turn", "sort : 4 1 ="]
    assert inputs.prompts[0] == "sort : 2 1 ="  # OpenRLHF's: the prompt as the model saw it, not the messages


class RewardServer:
    """OpenRLHF's serve_rm reply format on loopback; `reply` decides each answer (status, body)."""

    def __init__(self, reply):
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "body": body})
                status, answer = reply(body, len(server.requests))
                data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_rm_reply(body, _):
    """What openrlhf.cli.serve_rm answers: rewards, scores and extra_logs."""
    scores = [float(len(query)) for query in body["query"]]
    return 200, {"rewards": scores, "scores": scores, "extra_logs": {"dummy_scores": scores}}


def test_http_reward_server_gets_openrlhf_body_and_its_reply_is_read():
    with RewardServer(serve_rm_reply) as server:
        result = reward_function(None, server.url)(INPUTS)
    assert server.requests == [{"path": "/get_reward", "body": {"query": INPUTS.queries, "prompts": INPUTS.prompts,
                                                                 "labels": INPUTS.labels}}]
    lengths = [float(len(query)) for query in INPUTS.queries]
    assert result.rewards == result.scores == lengths and result.extra_logs == {"dummy_scores": lengths}


def test_http_server_errors_are_retried_then_answered(monkeypatch):
    monkeypatch.setattr(rewards, "HTTP_RETRY_DELAY_S", 0.0)
    with RewardServer(lambda body, n: (503, "busy") if n < 3 else (200, [1.0, 2.0])) as server:
        assert reward_function(None, server.url)(INPUTS).rewards == [1.0, 2.0]
    assert len(server.requests) == 3


def test_http_server_that_keeps_failing_stops_with_one_sentence(monkeypatch):
    monkeypatch.setattr(rewards, "HTTP_RETRY_DELAY_S", 0.0)
    with RewardServer(lambda body, n: (500, "boom")) as server:
        expected = rf"reward server {server.url} did not answer after 5 attempts \(HTTP 500\)"
        with pytest.raises(UserError, match=expected):
            reward_function(None, server.url)(INPUTS)
    assert len(server.requests) == rewards.HTTP_ATTEMPTS


@pytest.mark.parametrize("reply, problem", [
    (lambda body, n: (404, "no such route"), "answered HTTP 404"),
    (lambda body, n: (200, "<html>"), "not JSON"),
    (lambda body, n: (200, {"rewards": [1.0]}), "returned 1 rewards for 2 samples"),
    (lambda body, n: (200, {"rewards": [1.0, "NaN"]}), "rewards[1] = 'NaN', not a number"),
])
def test_http_refusals_and_bad_replies_stop_without_retry(monkeypatch, reply, problem):
    monkeypatch.setattr(rewards, "HTTP_RETRY_DELAY_S", 0.0)
    with RewardServer(reply) as server:
        with pytest.raises(UserError) as error:
            reward_function(None, server.url)(INPUTS)
    assert problem in str(error.value) and server.url in str(error.value) and len(server.requests) == 1


def test_unreachable_reward_server_is_named(monkeypatch):
    import socket

    monkeypatch.setattr(rewards, "HTTP_RETRY_DELAY_S", 0.0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/get_reward"  # bound, not listening: refused
        with pytest.raises(UserError, match=rf"reward server {url} did not answer after 5 attempts \(ConnectionError"):
            reward_function(None, url)(INPUTS)


# --- the PPO trainer's side: what the function is given, labels, and the check before training ---

def ppo_run(toy_assets, tmp_path, **settings):
    from rlhf_core.config import RunConfig
    from rlhf_core.stages.ppo import PPOConfig

    prompt_data = settings.pop("prompt_data", toy_assets["prompts"])
    ppo = PPOConfig(pretrain=toy_assets["model"], prompt_data=prompt_data,
                    input_key="prompt", rollout_batch_size=4, train_batch_size=4, micro_train_batch_size=4,
                    advantage_estimator="reinforce", reward_pretrain=toy_assets["model"], save_path=str(tmp_path / "out"), **settings)
    return RunConfig(stages=["ppo"], ckpt_path=str(tmp_path / "ckpt"), ppo=ppo)


def test_openrlhf_arguments_query_is_prompt_plus_response_with_special_tokens(toy_assets, tmp_path):
    from rlhf_core.storage.locate import load_tokenizer
    from rlhf_core.data.prompts import PromptItem
    from rlhf_core.rewards import reward_inputs

    tokenizer = load_tokenizer(toy_assets["model"])
    ids = tokenizer("sort : 2 1 =").input_ids
    assert ids[0] == tokenizer.bos_token_id
    item = PromptItem("sort : 2 1 =", ids, "1 2", bos_added=True)
    response = tokenizer("1 2", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    inputs = reward_inputs(tokenizer, [item], [response])
    assert inputs.prompts == ["sort : 2 1 ="] and inputs.queries == ["sort : 2 1 = 1 2 </s>"]
    assert inputs.responses == ["1 2"] and inputs.raw_prompts == ["sort : 2 1 ="] and inputs.labels == ["1 2"]


def test_labels_come_from_label_key_and_a_missing_one_names_the_line(toy_assets, tmp_path):
    from rlhf_core.storage.locate import load_tokenizer
    from rlhf_core.data.prompts import load_prompts

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "sort : 2 1 =", "answer": "1 2"}\n{"prompt": "sort : 3 1 ="}\n')
    tokenizer = load_tokenizer(toy_assets["model"])
    assert [item.label for item in load_prompts(ppo_run(toy_assets, tmp_path, prompt_data=str(data)), tokenizer)] \
        == ["", ""]  # no --label_key: "" as OpenRLHF's prompts dataset gives
    with pytest.raises(UserError, match=rf"{data} line 2: no key 'answer' \(choose the key with --label_key\)"):
        load_prompts(ppo_run(toy_assets, tmp_path, prompt_data=str(data), label_key="answer"), tokenizer)
    data.write_text('{"prompt": "sort : 2 1 =", "answer": "1 2"}\n')
    items = load_prompts(ppo_run(toy_assets, tmp_path, prompt_data=str(data), label_key="answer"), tokenizer)
    assert [item.label for item in items] == ["1 2"]


def test_a_broken_reward_function_fails_before_training(toy_assets, tmp_path):
    calls = tmp_path / "calls.txt"
    path = write_reward_file(tmp_path, f"def reward_func(queries, prompts, labels, **kwargs):\n"
                                       f"    open({str(calls)!r}, 'a').write(repr((queries, prompts, labels)))\n"
                                       f"    return [float('nan')] * len(queries)\n")
    with pytest.raises(UserError, match=r"\(reward_func\) returned rewards\[0\] = nan"):
        count_ppo_prompts(ppo_run(toy_assets, tmp_path, remote_rm_url=path))
    queries, prompts, labels = eval(calls.read_text())
    assert len(queries) == 1 and queries[0] == prompts[0] + " </s>" and prompts[0].startswith("sort :")


def test_normalize_reward_with_a_reward_function_warns_that_it_does_nothing(toy_assets, tmp_path, caplog):
    run = ppo_run(toy_assets, tmp_path, reward_fn="rlhf_core.toy:gold_reward", normalize_reward=True)
    assert count_ppo_prompts(run) == 256
    assert "--normalize_reward has no effect with a reward function (--reward_fn rlhf_core.toy:gold_reward)" \
        in caplog.text


def test_a_rollout_batch_of_equal_rewards_warns_once_per_chunk(caplog):
    """The check of the global batch (every rank's rewards: the max of max and of -min over ranks, one rank
    here): steps 1-2 form chunk 1 and 3-4 chunk 2 at --save_steps 2."""
    from rlhf_core.stages.ppo import PPOConfig
    from rlhf_core.rank.trainers.ppo import PPOTrainer

    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.cfg = PPOConfig(pretrain="m", prompt_data="p.jsonl", save_steps=2, rollout_batch_size=2, train_batch_size=2,
                            micro_train_batch_size=2)
    trainer.rank, trainer.equal_rewards_chunk = 0, None
    warned_at = []
    for step, rewards in enumerate([[0.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.5, 0.5]]):
        trainer.step = step
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rlhf_core"):
            trainer.warn_if_rewards_equal(torch.tensor(rewards))
        if caplog.records:
            warned_at.append(step + 1)
            message = caplog.records[0].getMessage()
            assert f"ppo step {step + 1}: every reward of the rollout batch is {rewards[0]:g}" in message
            assert "nothing" in message and len(caplog.records) == 1
    assert warned_at == [1, 4, 5]  # chunk 1 once (not step 2), nothing for unequal rewards, chunk 2, chunk 3
