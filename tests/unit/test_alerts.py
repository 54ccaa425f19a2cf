"""The seed's alerts: each fires on a case built to trigger it and stays silent on healthy ones
(reward stagnation, checkpoint size, non-finite values), and the run's alerts.jsonl survives a garbled line."""

from __future__ import annotations

import logging
import math
import pickle
import uuid

import pytest
import torch

from rlhf_core.ops.alerts import (ALERT_CHECKPOINT_SIZE, ALERT_NON_FINITE, ALERT_REWARD_STAGNANT, Alert, AlertLog,
                                   NonFiniteTraining, PlateauRule, headline_metric, history_entry, metric_history,
                                   non_finite_metrics, non_finite_parameters, reward_stagnant_alert)
from rlhf_core.ops.commit_alerts import (AlertSettings, ModelSize, checkpoint_size_alert, commit_alerts,
                                         SaveLayout, expected_bytes_from_metadata, expected_checkpoint_bytes,
                                         model_size_report, repeats_previous_anomaly)
from rlhf_core.storage.metadata import CheckpointMetadata

# File sizes of real committed checkpoints of the toy model (84,672 fp32 parameters; `rlhf train sft` on
# `rlhf toy init` data, DeepSpeed 0.19.8, CPU), step_32 of each run, as `find -printf %s` listed them.
TOY_NUM_PARAMS = 84_672
TOY_ZERO2_ONE_RANK_FILES = {
    "MANIFEST.json": 1438, "actor_model/ds/mp_rank_00_model_states.pt": 346_521,
    "actor_model/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt": 1_021_587, "actor_model/hf/config.json": 713,
    "actor_model/hf/generation_config.json": 216, "actor_model/hf/model.safetensors": 340_816,
    "actor_model/zero_to_fp32.py": 38_580, "actor_model/zero_to_torch.py": 2490, "training_metadata.json": 1727,
}
TOY_ZERO3_TWO_RANKS_FILES = {
    "MANIFEST.json": 1834, "actor_model/ds/zero_pp_rank_0_mp_rank_00_model_states.pt": 12_393,
    "actor_model/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt": 512_019,
    "actor_model/ds/zero_pp_rank_1_mp_rank_00_model_states.pt": 12_393,
    "actor_model/ds/zero_pp_rank_1_mp_rank_00_optim_states.pt": 512_019, "actor_model/hf/config.json": 713,
    "actor_model/hf/generation_config.json": 216, "actor_model/hf/model.safetensors": 340_816,
    "actor_model/zero_to_fp32.py": 38_580, "actor_model/zero_to_torch.py": 2490, "training_metadata.json": 1730,
}


def _alert(stage="sft", step=4, name=ALERT_REWARD_STAGNANT, **details) -> Alert:
    return Alert(name, "exp1", stage, step, f"{stage} step {step} alert.", details, time=1_700_000_000.0)


# --- Alert ------------------------------------------------------------------------------------------------


def test_alert_round_trips_through_json_and_spells_non_finite_details_as_strings():
    alert = _alert(loss=float("nan"), best=[1.0, float("inf")], nested={"x": -math.inf})
    line = alert.to_json()
    assert "NaN" not in line and "Infinity" not in line  # strict JSON: Prefect event payloads reject NaN
    back = Alert.from_json(line)
    assert back == alert
    assert back.details == {"loss": "nan", "best": [1.0, "inf"], "nested": {"x": "-inf"}}


@pytest.mark.parametrize("line", ["{not json", "[1, 2]", '{"name": "rlhf.alert.non-finite"}',
                                  '{"name": "a", "run_name": "r", "stage": "s", "step": "x", "message": "m", "time": 1}'])
def test_alert_from_json_refuses_what_is_not_an_alert(line):
    with pytest.raises(ValueError):
        Alert.from_json(line)


# --- reward-stagnant --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage, metrics, expected", [
    ("ppo", {"reward": 0.1, "mean_reward": 0.2, "eval_reward": 0.3}, ("eval_reward", True)),
    ("ppo", {"reward": 0.1, "mean_reward": 0.2, "policy_loss": 1.0}, ("mean_reward", True)),
    ("ppo", {"reward": 0.1}, ("reward", True)),
    ("sft", {"loss": 2.0, "mean_loss": 2.1, "eval_loss": 2.2}, ("eval_loss", False)),
    ("rm", {"loss": 0.6, "mean_loss": 0.7, "accuracy": 0.5}, ("mean_loss", False)),
    ("rm", {"loss": 0.6}, ("loss", False)),
    ("sft", {"lr": 1e-3}, None),
    ("ppo", {"loss": 1.0}, None),
])
def test_headline_metric_prefers_held_out_then_chunk_mean_then_last_step(stage, metrics, expected):
    assert headline_metric(stage, metrics) == expected


def test_a_commit_without_an_evaluation_is_judged_by_the_chunks_mean_loss_over_every_commit():
    """Evaluation runs once per epoch, not at each commit: the commits between carry mean_loss, which the
    stagnation check falls back to, over the whole line (the epoch-end commit's mean_loss included)."""
    entries = [{"step": 8, "mean_loss": 2.0}, {"step": 16, "mean_loss": 1.9, "eval_loss": 2.5},
               {"step": 24, "mean_loss": 1.8}]
    assert metric_history("rm", entries) == ("mean_loss", False, [(8, 2.0), (16, 1.9), (24, 1.8)])


def _history(*values, first_step=4, every=4):
    return [(first_step + index * every, value) for index, value in enumerate(values)]


def test_flat_ppo_reward_over_the_last_three_checkpoints_fires():
    alert = reward_stagnant_alert("exp1", "ppo", _history(0.50, 0.50, 0.49, 0.50), "reward", True)
    assert alert is not None and alert.name == ALERT_REWARD_STAGNANT
    assert (alert.run_name, alert.stage, alert.step) == ("exp1", "ppo", 16)
    assert alert.details["checkpoints_without_improvement"] == 3
    assert (alert.details["best_step"], alert.details["best_value"]) == (4, 0.5)
    assert "ppo reward has not improved for 3 committed checkpoints (steps 8 to 16)" in alert.message


@pytest.mark.parametrize("values", [
    (0.1, 0.2, 0.3, 0.4),          # improving every time
    (0.5, 0.4, 0.4, 0.6),          # the newest improves on the best before it
    (0.5, 0.5, 0.5),               # too short: window 3 needs a baseline and 3 more
    (0.5,),
    (),
])
def test_reward_that_improves_or_a_short_history_stays_silent(values):
    assert reward_stagnant_alert("exp1", "ppo", _history(*values), "reward", True) is None


def test_lower_is_better_loss_fires_when_flat_and_not_when_it_falls():
    assert reward_stagnant_alert("exp1", "sft", _history(3.0, 2.5, 2.0, 1.5), "eval_loss", False) is None
    alert = reward_stagnant_alert("exp1", "sft", _history(3.0, 2.5, 2.6, 2.5, 2.7), "eval_loss", False)
    assert alert is not None and alert.details["best_value"] == 2.5 and alert.details["best_step"] == 8


def test_min_delta_counts_only_improvements_larger_than_it():
    creeping = _history(1.00, 1.01, 1.02, 1.03)
    assert reward_stagnant_alert("exp1", "ppo", creeping, "reward", True) is None
    tolerant = PlateauRule(min_delta=0.05)
    assert reward_stagnant_alert("exp1", "ppo", creeping, "reward", True, tolerant) is not None
    assert reward_stagnant_alert("exp1", "ppo", _history(1.0, 1.0, 1.0, 1.1), "reward", True, tolerant) is None


def _alerted_steps(values, **options) -> list[int]:
    """The steps at which the stagnant alert fires as checkpoints are committed one by one."""
    history = _history(*values)
    alerts = [reward_stagnant_alert("exp1", "ppo", history[:count], "reward", True, PlateauRule(**options))
              for count in range(1, len(history) + 1)]
    return [alert.step for alert in alerts if alert is not None]


def test_window_is_configurable_and_the_alert_fires_once_when_the_plateau_starts():
    values = (0.5, 0.6, 0.6, 0.6, 0.6, 0.6)
    assert reward_stagnant_alert("exp1", "ppo", _history(*values[:3]), "reward", True, PlateauRule(window=2)) is None
    alert = reward_stagnant_alert("exp1", "ppo", _history(*values[:4]), "reward", True, PlateauRule(window=2))
    assert alert is not None and "2 committed checkpoints (steps 12 to 16)" in alert.message
    # Committed one by one: the plateau after step 8 is reported at step 20 (window 3) or 16 (window 2), once.
    assert _alerted_steps(values) == [20]
    assert _alerted_steps(values, window=2) == [16]


def test_the_stagnant_alert_fires_again_only_after_an_improvement_cleared_it():
    # flat from step 4 (alert at 16), improves at step 24, flat again (alert at 36), never again after that.
    values = (0.5, 0.5, 0.5, 0.5, 0.5, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7)
    assert _alerted_steps(values) == [16, 36]
    # A dip is not an improvement: it neither clears the plateau nor starts a second alert.
    assert _alerted_steps((0.5, 0.5, 0.5, 0.5, 0.3, 0.5, 0.5, 0.5)) == [16]
    # Improvements no larger than min_delta do not clear it either.
    assert _alerted_steps((1.00, 1.00, 1.00, 1.00, 1.01, 1.02, 1.03, 1.04), min_delta=0.05) == [16]


def test_history_order_does_not_matter_and_non_finite_values_are_left_to_the_non_finite_alert():
    shuffled = [(16, 0.5), (4, 0.5), (12, 0.5), (8, 0.5)]
    assert reward_stagnant_alert("exp1", "ppo", shuffled, "reward", True).step == 16
    with_nan = _history(0.5, float("nan"), 0.5, 0.5)
    assert reward_stagnant_alert("exp1", "ppo", with_nan, "reward", True) is None  # 3 finite values only


@pytest.mark.parametrize("window, min_delta", [(0, 0.0), (3, -0.1)])
def test_nonsense_window_or_min_delta_is_refused(window, min_delta):
    with pytest.raises(ValueError):
        reward_stagnant_alert("exp1", "ppo", _history(1, 1, 1, 1), "reward", True, PlateauRule(window, min_delta))


def test_metric_history_follows_the_newest_checkpoints_headline():
    entries = [history_entry(4, {"reward": 0.1, "mean_reward": 0.1, "kl": 0.0}),
               history_entry(12, {"reward": 0.3, "mean_reward": 0.3, "eval_reward": 0.25}),
               history_entry(8, {"reward": 0.2, "mean_reward": 0.2, "eval_reward": float("nan")})]
    assert entries[0] == {"step": 4, "mean_reward": 0.1, "reward": 0.1}
    assert metric_history("ppo", entries) == ("eval_reward", True, [(12, 0.25)])
    assert metric_history("sft", [history_entry(4, {"loss": 2.0, "mean_loss": 2.2}),
                                  history_entry(8, {"loss": 1.9, "mean_loss": 2.1})]) == \
        ("mean_loss", False, [(4, 2.2), (8, 2.1)])
    assert metric_history("sft", []) is None
    assert metric_history("sft", [{"step": 4, "lr": 1e-3}]) is None


EXP1 = AlertSettings("exp1")  # the alerts' defaults


# --- checkpoint-size --------------------------------------------------------------------------------------

GB = 10**9


def test_prediction_by_hand_full_fine_tune_and_lora():
    # 70B, bf16 on GPUs, ZeRO-3: fp32 master + 2 moments (12 B) in the shards, the bf16 HF copy (2 B).
    zero3 = expected_checkpoint_bytes(ModelSize(70 * GB, 70 * GB, 2), SaveLayout(3, world_size=8))
    assert zero3 == pytest.approx(70 * GB * (12 + 2), rel=1e-6)
    # ZeRO-2 adds rank 0's bf16 module weights (2 B): 16 B per parameter, ~1.1 TB.
    assert expected_checkpoint_bytes(ModelSize(70 * GB, 70 * GB, 2), SaveLayout(2, world_size=8)) \
        == pytest.approx(70 * GB * 16, rel=1e-6)
    # LoRA (0.1B adapter): the frozen bf16 base once, the adapter's optimizer state, the adapter as HF copy:
    # about the seed's "a 70B model is about 140 GB".
    lora = expected_checkpoint_bytes(ModelSize(70 * GB, GB // 10, 2, lora=True), SaveLayout(2, world_size=8))
    assert lora == pytest.approx(70 * GB * 2 + GB // 10 * (12 + 2), rel=1e-6)
    assert 140 * GB < lora < 142 * GB
    # On GPUs, ZeRO-2 writes the frozen weights a second time (CPU copies beside the GPU state dict).
    assert expected_checkpoint_bytes(ModelSize(70 * GB, GB // 10, 2, lora=True),
                                     SaveLayout(2, world_size=8, on_gpu=True)) \
        == pytest.approx(lora + (70 * GB - GB // 10) * 2, rel=1e-6)


def test_prediction_by_hand_zero0_extras_and_without_deepspeed_state():
    n = 10**8
    # ZeRO-0 with fp32 weights: no separate master copy, so weights 4 + moments 8, plus the fp32 HF copy.
    assert expected_checkpoint_bytes(ModelSize(n, n, 4), SaveLayout(0)) == pytest.approx(n * (4 + 8 + 4), rel=1e-4)
    # PPO with a critic of the same size saved beside the actor doubles it.
    actor = expected_checkpoint_bytes(ModelSize(n, n, 4), SaveLayout(2))
    both = expected_checkpoint_bytes(ModelSize(n, n, 4), SaveLayout(2), [ModelSize(n, n, 4)])
    assert both == pytest.approx(2 * actor, rel=1e-4)
    # --disable_ds_ckpt keeps the HF copy alone.
    assert expected_checkpoint_bytes(ModelSize(n, n, 4), SaveLayout(2, has_ds_state=False)) \
        == pytest.approx(4 * n, rel=1e-4)
    with pytest.raises(ValueError, match="optimizer"):
        expected_checkpoint_bytes(ModelSize(n, n, 4), SaveLayout(2, optimizer="lion"))


@pytest.mark.parametrize("files, zero_stage, world_size", [(TOY_ZERO2_ONE_RANK_FILES, 2, 1),
                                                            (TOY_ZERO3_TWO_RANKS_FILES, 3, 2)])
def test_prediction_matches_real_toy_checkpoints_and_their_sizes_stay_silent(files, zero_stage, world_size):
    actual = sum(files.values())
    expected = expected_checkpoint_bytes(ModelSize(TOY_NUM_PARAMS, TOY_NUM_PARAMS, 4),
                                         SaveLayout(zero_stage, world_size))
    assert expected / actual == pytest.approx(1.0, abs=0.01)
    previous = [actual - 2, actual, actual + 1]  # metadata grows by a byte or two from step to step
    assert checkpoint_size_alert(actual, expected, previous, EXP1, "sft", 32) is None


def test_a_truncated_but_valid_checkpoint_fires():
    actual = sum(TOY_ZERO2_ONE_RANK_FILES.values())
    expected = expected_checkpoint_bytes(ModelSize(TOY_NUM_PARAMS, TOY_NUM_PARAMS, 4), SaveLayout(2))
    alert = checkpoint_size_alert(actual // 2, expected, [actual] * 3, EXP1, "sft", 36)
    assert alert is not None and alert.name == ALERT_CHECKPOINT_SIZE and alert.step == 36
    assert "predict" in alert.message and "median" in alert.message and "less" in alert.message
    assert alert.details["ratio_to_expected"] == pytest.approx(0.5, abs=0.01)
    # The optimizer shard missing entirely (the manifest lists what was uploaded, so it still verifies).
    no_optimizer = actual - TOY_ZERO2_ONE_RANK_FILES["actor_model/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert checkpoint_size_alert(no_optimizer, expected, [], EXP1, "sft", 36) is not None


def test_size_jump_against_previous_checkpoints_alone():
    assert checkpoint_size_alert(130, None, [100, 100, 101], EXP1, "rm", 9) is not None
    assert checkpoint_size_alert(110, None, [100, 100, 101], EXP1, "rm", 9) is None
    assert checkpoint_size_alert(100, None, [], EXP1, "rm", 9) is None
    # Within the prediction's tolerance, but a 2x jump from the previous checkpoints still fires.
    alert = checkpoint_size_alert(200, 150, [100, 100], EXP1, "rm", 9)
    assert alert is not None and "predict" not in alert.message and "more than the median" in alert.message


def _alerted_sizes(sizes, expected=None, **options) -> list[int]:
    """The indexes of `sizes` (committed one by one) at which the size alert fires."""
    return [index for index, size in enumerate(sizes)
            if checkpoint_size_alert(size, expected, sizes[:index], AlertSettings("exp1", **options), "rm",
                                     index) is not None]


def test_a_persisting_size_anomaly_alerts_once_and_a_new_one_alerts_again():
    # Every checkpoint 3x its prediction (saved in another dtype, say): one alert, at the first.
    assert _alerted_sizes([300, 301, 300, 302, 301], expected=100) == [0]
    # Healthy, then truncated for good: an alert where it starts (its median jump), none while it lasts,
    # nor when the median catches up with it.
    assert _alerted_sizes([100, 100, 100, 50, 50, 50, 50, 50], expected=100) == [3]
    # A second, different anomaly on top of the first alerts again: more than the prediction, then a
    # truncated one, then back to the first.
    assert _alerted_sizes([300, 300, 300, 150, 300, 300], expected=100) == [0, 3, 4]
    # Far more again: the jump against the earlier checkpoints is a finding of its own.
    assert _alerted_sizes([300, 300, 1000], expected=100) == [0, 2]
    # Healthy sizes never alert; a one-off truncated checkpoint alerts each time it happens.
    assert _alerted_sizes([100, 100, 50, 100, 100, 50, 100], expected=100) == [2, 5]


def test_repeats_previous_anomaly_needs_a_predecessor_with_the_same_findings():
    assert not repeats_previous_anomaly(300, 100, [])
    assert repeats_previous_anomaly(300, 100, [300])
    assert not repeats_previous_anomaly(300, 100, [100])  # the predecessor was healthy
    assert not repeats_previous_anomaly(100, 100, [300])  # this one is healthy
    assert not repeats_previous_anomaly(30, 100, [300])  # more than predicted, then less: another anomaly


def test_model_size_counts_a_real_module_lora_and_zero3_partitions(toy_assets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy_assets["model"])
    assert ModelSize.from_module(model) == ModelSize(TOY_NUM_PARAMS, TOY_NUM_PARAMS, 4, False)
    model.model.embed_tokens.weight.requires_grad_(False)
    frozen = model.model.embed_tokens.weight.numel()
    assert ModelSize.from_module(model).num_trainable_params == TOY_NUM_PARAMS - frozen
    partitioned = torch.nn.Linear(4, 4, bias=False)
    partitioned.weight.ds_numel = 1000  # ZeRO-3 leaves an empty tensor and records the full size here
    assert ModelSize.from_module(partitioned).num_params == 1000
    size = ModelSize(10, 2, 2, True)
    assert ModelSize.from_dict(size.to_dict()) == size


# --- non-finite -------------------------------------------------------------------------------------------


def test_non_finite_metrics_names_nan_and_inf_only():
    metrics = {"loss": float("nan"), "reward": float("inf"), "kl": -math.inf, "lr": 1e-3, "step": 4,
               "flag": True, "note": "nan"}
    assert non_finite_metrics(metrics) == ["loss", "reward", "kl"]
    assert non_finite_metrics({"loss": 2.0}) == []


def test_non_finite_parameters_from_a_module_a_mapping_and_zero3_partitions():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    assert non_finite_parameters(model) == []
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
        model[0].bias[1] = float("inf")
    assert non_finite_parameters(model) == ["0.bias", "1.weight"]
    assert non_finite_parameters(model, limit=1) == ["0.bias"]
    assert non_finite_parameters({"a": torch.ones(2), "b": torch.tensor([1.0, -math.inf])}) == ["b"]
    assert non_finite_parameters([("ids", torch.tensor([1, 2]))]) == []  # integer tensors are never NaN
    partitioned = torch.nn.Parameter(torch.empty(0))
    partitioned.ds_tensor = torch.tensor([float("nan")])  # the rank's ZeRO-3 partition
    assert non_finite_parameters([("w", partitioned)]) == ["w"]


def test_non_finite_parameters_are_told_apart_from_finite_values_whose_sum_overflows():
    # The check sums each tensor first; a sum that overflows must not pass for a NaN or an Inf.
    huge = torch.full((4,), torch.finfo(torch.float32).max)
    half = torch.full((8,), 60000.0, dtype=torch.float16)  # sums past fp16's range
    bf16 = torch.full((4,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    assert non_finite_parameters({"huge": huge, "half": half, "bf16": bf16}) == []
    both_infinities = torch.tensor([math.inf, -math.inf, 1.0])  # sums to NaN
    assert non_finite_parameters({"w": both_infinities, "h": torch.tensor([1.0, math.nan], dtype=torch.float16),
                                  "b": torch.tensor([-math.inf], dtype=torch.bfloat16)}) == ["w", "h", "b"]


def test_non_finite_training_says_what_where_and_what_to_do_and_survives_pickling():
    error = NonFiniteTraining("sft", 12, metrics=["loss", "mean_loss"], parameters=["lm_head.weight"])
    message = str(error)
    for part in ("sft step 12", "loss, mean_loss", "lm_head.weight", "not committed", "learning rate",
                 "--load_checkpoint"):
        assert part in message
    assert message.count(". ") == 0 and message.endswith(".")  # one sentence
    assert isinstance(error, RuntimeError)
    back = pickle.loads(pickle.dumps(error))
    assert (type(back), str(back), back.step, back.parameters) == (NonFiniteTraining, message, 12, ["lm_head.weight"])
    alert = error.to_alert("exp1")
    assert (alert.name, alert.stage, alert.step, alert.message) == (ALERT_NON_FINITE, "sft", 12, message)
    assert "parameters" not in str(NonFiniteTraining("rm", 3, metrics=["loss"]))


# --- alerts.jsonl -----------------------------------------------------------------------------------------


@pytest.fixture(params=["local", "memory"])
def run_url(request, tmp_path):
    return str(tmp_path / "ckpt" / "exp1") if request.param == "local" else f"memory://alerts-{uuid.uuid4().hex}/exp1"


def test_alert_log_appends_reads_and_filters_by_stage(run_url):
    log = AlertLog(run_url)
    assert log.read() == [] and log.url == f"{run_url}/alerts.jsonl"
    first, second, third = _alert("sft", 4), _alert("ppo", 8, ALERT_CHECKPOINT_SIZE), _alert("sft", 12)
    log.append(first)
    log.append(second, third)
    assert AlertLog(run_url).read() == [first, second, third]
    assert log.for_stage("sft") == [first, third] and log.for_stage("rm") == []


def test_every_alert_recorded_is_announced_as_one_rlhf_warning_line(run_url, caplog):
    first, second = _alert("sft", 4), _alert("ppo", 8, ALERT_CHECKPOINT_SIZE)
    with caplog.at_level(logging.WARNING, logger="rlhf_core"):
        AlertLog(run_url).append(first, second)
    assert [(record.name, record.levelno, record.getMessage()) for record in caplog.records] == [
        ("rlhf_core.ops.alerts", logging.WARNING, f"rlhf: warning: {first.message} ({first.name})"),
        ("rlhf_core.ops.alerts", logging.WARNING, f"rlhf: warning: {second.message} ({second.name})")]


def test_alert_log_skips_a_garbled_line_and_heals_a_partial_last_line(run_url):
    log = AlertLog(run_url)
    first = _alert("sft", 4)
    log.append(first)
    with log.fs.open(log.path, "wb") as handle:  # a garbled line, then a write cut off mid-line
        handle.write((first.to_json() + "\n" + "\x00garbage\n" + '{"name": "rlhf.al').encode())
    assert log.read() == [first]
    second = _alert("sft", 8)
    log.append(second)
    assert log.read() == [first, second]


# --- after a commit ---------------------------------------------------------------------------------------


def _toy_metadata(*rewards, zero_stage=2, world_size=1) -> CheckpointMetadata:
    toy = ModelSize(TOY_NUM_PARAMS, TOY_NUM_PARAMS, 4).to_dict()
    return CheckpointMetadata.from_json({
        "stage": "ppo", "step": 16, "zero_stage": zero_stage, "world_size": world_size,
        "model_sizes": {"on_gpu": False, "models": {"actor_model": toy}},
        "metric_history": [history_entry(4 * (index + 1), {"reward": reward, "mean_reward": reward})
                           for index, reward in enumerate(rewards)]})


def test_commit_alerts_silent_on_a_healthy_toy_commit_and_loud_on_a_flat_reward_and_a_truncated_one():
    actual = sum(TOY_ZERO2_ONE_RANK_FILES.values())
    healthy = _toy_metadata(0.1, 0.2, 0.3, 0.4)
    assert commit_alerts(AlertSettings("exp1"), healthy, actual, [actual] * 3) == []
    flat = commit_alerts(AlertSettings("exp1"), _toy_metadata(0.4, 0.4, 0.4, 0.4), actual, [actual] * 3)
    assert [alert.name for alert in flat] == [ALERT_REWARD_STAGNANT]
    assert flat[0].details["metric"] == "mean_reward"
    truncated = commit_alerts(AlertSettings("exp1"), healthy, actual // 2, [])
    assert [alert.name for alert in truncated] == [ALERT_CHECKPOINT_SIZE]
    # Metadata from before the alerts existed: no prediction, no history; only the jump is judged.
    before_alerts = CheckpointMetadata.from_json({"stage": "sft", "step": 8, "zero_stage": 2})
    assert commit_alerts(AlertSettings("exp1"), before_alerts, actual, [actual]) == []
    assert expected_bytes_from_metadata(before_alerts) is None


def test_model_size_report_and_the_prediction_from_metadata():
    report = model_size_report({"actor_model": torch.nn.Linear(10, 10), "critic_model": torch.nn.Linear(10, 1)})
    assert report == {"on_gpu": False, "models": {"actor_model": ModelSize(110, 110, 4).to_dict(),
                                                  "critic_model": ModelSize(11, 11, 4).to_dict()}}
    metadata = CheckpointMetadata.from_json({"stage": "ppo", "step": 4, "zero_stage": 3, "world_size": 2,
                                             "model_sizes": report})
    assert expected_bytes_from_metadata(metadata) == expected_checkpoint_bytes(
        ModelSize(110, 110, 4), SaveLayout(3, world_size=2), [ModelSize(11, 11, 4)])
    assert expected_bytes_from_metadata(metadata, has_ds_state=False) == expected_checkpoint_bytes(
        ModelSize(110, 110, 4), SaveLayout(3, world_size=2, has_ds_state=False), [ModelSize(11, 11, 4)])
