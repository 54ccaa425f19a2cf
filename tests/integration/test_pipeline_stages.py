"""The chain SFT -> RM -> PPO (LoRA) -> merge -> export on the toy task, on a real local Ray with real
DeepSpeed, driven through rlhf_core: the reward model ranks held-out pairs, PPO beats SFT on held-out
prompts, every advantage estimator trains a chunk, PPO resumes exactly after a SIGKILL, and the LoRA
merge matches base+adapter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flows.demo import demo_config
from rlhf_core.driver.stage_driver import export_stage, train_stage
from rlhf_core.driver.plan import plan_stage, resolve_paths
from rlhf_core.config import RunConfig
from rlhf_core.stages.ppo import PPOConfig
from rlhf_core.models.evaluate import mean_gold_score
from rlhf_core.driver.export import export_final, merge_lora
from rlhf_core.driver.resume import begin_stage
from rlhf_core.toy import init_toy
from tests.integration.conftest import kill_fault_driver_once_committed
from tests.integration.chunks import train_chunks

pytestmark = pytest.mark.slow
# PPO's gain over SFT on 64 held-out prompts, seed 0: 0.107 measured (0.590 -> 0.697). Half of it
# is demanded: well above the run-to-run noise of one changed setting, well below the effect.
MIN_GOLD_GAIN = 0.05


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """The demo's configuration, trained once: SFT, RM, PPO with LoRA, merge, export."""
    workdir = tmp_path_factory.mktemp("pipeline")
    toy = init_toy(str(workdir / "toy"))
    run = resolve_paths(demo_config(str(workdir), num_workers=1))
    for stage in ("sft", "rm", "ppo"):
        train_stage(run, stage)
    merge_difference = merge_lora(run.merge.model_path, run.merge.lora_path, run.merge.output_path)
    export_final(run.export.model_path, run.export.save_path)
    yield {"run": run, "toy": toy, "merge_difference": merge_difference, "workdir": workdir}
    import ray

    ray.shutdown()


def final_metadata(run: RunConfig, stage: str) -> dict:
    steps = sorted(Path(run.stage_url(stage)).glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return json.loads((steps[-1] / "training_metadata.json").read_text())


def test_the_demo_configuration_raises_no_alert(pipeline):
    from rlhf_core.ops.alerts import AlertLog

    run = pipeline["run"]
    assert all(final_metadata(run, stage).get("metric_history") for stage in ("sft", "rm", "ppo"))
    assert AlertLog(run.run_url()).read() == []


def test_reward_model_ranks_held_out_pairs_well_above_chance(pipeline):
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.data.stream import read_records
    from rlhf_core.storage.locate import load_tokenizer

    run = pipeline["run"]
    assert final_metadata(run, "rm")["metrics"]["eval_accuracy"] >= 0.7  # chance is 0.5
    scorer = AutoModelForSequenceClassification.from_pretrained(run.rm.save_path).eval()  # loads back for scoring
    tokenizer = load_tokenizer(run.rm.save_path)
    wins = []
    for record in read_records(pipeline["toy"]["prefs"])[:32]:
        texts = [f"{record.fields['prompt']} {record.fields[key]}" for key in ("chosen", "rejected")]
        ids = [[tokenizer.bos_token_id] + tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
               for t in texts]
        with torch.no_grad():
            chosen, rejected = (scorer(input_ids=torch.tensor([row])).logits.item() for row in ids)
        wins.append(chosen > rejected)
    assert sum(wins) / len(wins) >= 0.7


def test_ppo_policy_beats_sft_policy_on_held_out_prompts(pipeline):
    run, eval_prompts = pipeline["run"], pipeline["toy"]["eval_prompts"]
    sft_score = mean_gold_score(run.sft.save_path, eval_prompts)
    ppo_score = mean_gold_score(run.export.save_path, eval_prompts)
    assert ppo_score - sft_score >= MIN_GOLD_GAIN, (sft_score, ppo_score)


def test_lora_merge_matches_base_plus_adapter_and_export_generates(pipeline, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from flows.cli import main

    run = pipeline["run"]
    assert (Path(run.ppo.save_path) / "adapter_config.json").exists()  # the PPO stage exports its adapter
    assert pipeline["merge_difference"] <= 1e-4
    base = AutoModelForCausalLM.from_pretrained(run.merge.model_path)
    adapted = PeftModel.from_pretrained(base, run.merge.lora_path).eval()
    merged = AutoModelForCausalLM.from_pretrained(run.merge.output_path).eval()
    probe = torch.randint(0, base.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (merged(input_ids=probe).logits - adapted(input_ids=probe).logits).abs().max() <= 1e-4
        generated = AutoModelForCausalLM.from_pretrained(run.export.save_path).generate(
            probe[:1], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape[1] > probe.shape[1]
    out = pipeline["workdir"] / "combined"
    assert main(["lora-combiner", "--model_path", run.merge.model_path, "--lora_path", run.merge.lora_path,
                 "--output_path", str(out)]) == 0
    assert "max logit difference" in capsys.readouterr().out and (out / "model.safetensors").exists()


def small_ppo(pipeline, ckpt: Path, **settings) -> RunConfig:
    run = pipeline["run"]
    ppo = PPOConfig(pretrain=run.sft.save_path, reward_fn="rlhf_core.toy:gold_reward",
                    critic_pretrain=run.rm.save_path, prompt_data=pipeline["toy"]["prompts"], input_key="prompt",
                    max_samples=16, n_samples_per_prompt=2, rollout_batch_size=4, micro_rollout_batch_size=8,
                    train_batch_size=8, micro_train_batch_size=4, max_new_tokens=8, learning_rate=1e-3,
                    save_steps=2, save_path=str(ckpt / "out"), **settings)
    return resolve_paths(RunConfig(stages=["ppo"], ckpt_path=str(ckpt), load_checkpoint=True, max_ckpt_num=0,
                                   ppo=ppo))


@pytest.mark.parametrize("estimator", ["gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo"])
def test_every_advantage_estimator_trains_a_chunk(estimator, pipeline, tmp_path):
    run = small_ppo(pipeline, tmp_path, advantage_estimator=estimator, save_value_network=True)
    [result] = train_chunks(run, "ppo", 2, lineage=begin_stage(run, "ppo"))
    export_stage(run, "ppo", 2)  # --save_value_network: the critic goes to {save_path}_critic, as OpenRLHF
    assert (Path(run.ppo.save_path + "_critic") / "model.safetensors").exists() == (estimator == "gae")
    assert result.num_steps_trained == 2 and all(map(lambda v: v == v, result.metrics.values()))  # no NaN
    step_dir = Path(run.stage_url("ppo")) / "step_2"
    assert (step_dir / "actor_model" / "hf" / "model.safetensors").exists()
    assert (step_dir / "critic_model").exists() == (estimator == "gae")
    assert "kl_coef" in final_metadata(run, "ppo")["metrics"]


def test_without_kl_one_update_per_rollout_skips_the_scoring_pass_and_trains_the_same(pipeline, tmp_path):
    """--init_kl_coef 0 with one optimizer step per rollout: no reference, and the update's detached
    log-probs stand in for the old ones. Against a KL so small it changes nothing, which loads the
    reference and scores the old log-probs: the same weights."""
    weights = {}
    for name, kl in (("on_policy", 0.0), ("scored", 1e-30)):
        run = small_ppo(pipeline, tmp_path / name, advantage_estimator="reinforce", init_kl_coef=kl)
        [result] = train_chunks(run, "ppo", 2, lineage=begin_stage(run, "ppo"))
        assert result.num_steps_trained == 2 and (kl > 0 or result.metrics["kl"] == 0)
        weights[name] = load_file(os.path.join(run.stage_url("ppo"), "step_2", "actor_model", "hf", "model.safetensors"))
    assert weights["on_policy"].keys() == weights["scored"].keys()
    for key, tensor in weights["scored"].items():
        torch.testing.assert_close(weights["on_policy"][key], tensor, rtol=0, atol=1e-5)
    start = load_file(os.path.join(pipeline["run"].sft.save_path, "model.safetensors"))
    assert max((weights["scored"][key] - start[key]).abs().max().item() for key in start) > 1e-3  # it trained


def test_ppo_sigkill_mid_chunk_then_rerun_matches_uninterrupted_run(pipeline, tmp_path, rlhf_env):
    def job(run: RunConfig, env: dict) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tests.integration.fault_driver", run.model_dump_json()],
                              env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])

    reference = small_ppo(pipeline, tmp_path / "reference")
    assert job(reference, rlhf_env).returncode == 0
    run = small_ppo(pipeline, tmp_path / "killed")
    kill_fault_driver_once_committed(run.model_dump_json(), rlhf_env, 3, tmp_path / "faults",
                                     Path(run.stage_url("ppo")) / "step_2")
    assert not (Path(run.stage_url("ppo")) / "step_4").exists()
    resumed = job(run, rlhf_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = plan_stage(run, "ppo").total_steps
    for model in ("actor_model", "critic_model"):
        expected = load_file(os.path.join(reference.stage_url("ppo"), f"step_{final}", model, "hf", "model.safetensors"))
        actual = load_file(os.path.join(run.stage_url("ppo"), f"step_{final}", model, "hf", "model.safetensors"))
        for name, tensor in expected.items():
            assert actual[name].equal(tensor), f"{model}/{name} differs from the uninterrupted run"
    assert final_metadata(run, "ppo")["metrics"]["kl_coef"] == final_metadata(reference, "ppo")["metrics"]["kl_coef"]


def test_reward_model_checkpoints_are_refused_once_the_sft_output_they_started_from_changes(pipeline):
    from rlhf_core.errors import UserError
    from rlhf_core.driver.export import export_stage_output
    from rlhf_core.driver.resume import open_store

    run = pipeline["run"]
    sft_store = open_store(run, "sft")
    final, earlier = [info.step for info in sft_store.list() if info.is_committed][:-3:-1]
    begin_stage(run, "rm")  # the output RM trained from: accepted

    def export_sft(step: int) -> None:
        export_stage_output(sft_store, step, "actor_model", run.sft.pretrain, run.sft.save_path)

    try:
        export_sft(earlier)  # as if SFT had been retrained into the same save_path
        with pytest.raises(UserError, match="pretrain model contents: changed"):
            begin_stage(run, "rm")
    finally:
        export_sft(final)
    begin_stage(run, "rm")  # the same checkpoint exported again is the same input


def test_the_ledger_says_where_the_background_writer_spent_its_time(pipeline):
    """Each checkpoint's writer timers (rank 0's serialisation and writes, hashing, fsync) reach the goodput
    ledger, and the step loop's slowdown beside the writer counts as stall, out of useful time."""
    from rlhf_core.ops.goodput import GoodputLedger

    run = pipeline["run"]
    sft = GoodputLedger(run.run_url(), run.storage_options).read()["stages"]["sft"]
    seconds = sft["seconds"]
    assert seconds["writer_write"] > 0 and seconds["writer_fsync"] > 0 and seconds["writer_hash"] >= 0
    assert seconds["writer_slowdown"] >= 0
    assert sft["useful_s"] == pytest.approx(seconds["step_loop"] - seconds["writer_slowdown"])
    assert sft["stall_s"] == pytest.approx(seconds["stall"] + seconds["writer_slowdown"])


def test_a_finished_stage_is_not_entered_again_unless_its_export_was_cut_short(pipeline, tmp_path, rlhf_env):
    """`rlhf run` again over the finished SFT -> RM -> PPO (each committed at its last step and exported): no stage
    is entered (a restarted deployment run used to re-enter each, 10-14 s in the soak, and export it again: minutes
    for a large model), and no export is written again. An export without its source file, as one cut short leaves
    it, makes its stage unfinished; so does a run that does not resume, or resumes from an older step."""
    import yaml

    from rlhf_core.driver.resume import finished_checkpoint
    from rlhf_core.storage.locate import SOURCE_NAME
    from tests.conftest import run_rlhf

    run = pipeline["run"].model_copy(update={"stages": ["sft", "rm", "ppo"]})
    totals = {stage: plan_stage(run, stage).total_steps for stage in run.stages}
    exports = {stage: Path(getattr(run.stage_config(stage), "save_path")) for stage in run.stages}
    for stage in run.stages:
        assert finished_checkpoint(run, stage, lambda: totals[stage]).step == totals[stage]
    assert finished_checkpoint(run.model_copy(update={"load_checkpoint": False}), "sft", lambda: totals["sft"]) is None
    assert finished_checkpoint(run.model_copy(update={"resume_from": 16}), "sft", lambda: totals["sft"]) is None
    source = exports["sft"] / SOURCE_NAME
    source.rename(tmp_path / SOURCE_NAME)
    try:
        assert finished_checkpoint(run, "sft", lambda: totals["sft"]) is None
    finally:
        (tmp_path / SOURCE_NAME).rename(source)

    written = {path: path.stat().st_mtime_ns for folder in exports.values() for path in folder.iterdir()}
    config = tmp_path / "run.yaml"
    verbose = run.model_copy(update={"verbose": True})  # Prefect's lines on the console too
    config.write_text(yaml.safe_dump(json.loads(verbose.model_dump_json(exclude_defaults=True))))
    again = run_rlhf(["run", str(config)], rlhf_env)
    assert again.returncode == 0, again.stderr[-3000:]
    output = again.stdout + again.stderr
    for stage in run.stages:
        assert f"{stage}: finished by an earlier run (step {totals[stage]}, exported to {exports[stage]})" in output
        assert f"Beginning subflow run 'demo-{stage}'" not in output, output[-3000:]
    assert {path: path.stat().st_mtime_ns for folder in exports.values() for path in folder.iterdir()} == written
