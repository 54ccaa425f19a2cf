"""What differs by stage lives on the stage (issue 45): no module of `rlhf_core/driver/` or `rlhf_core/ops/` spells a
training stage's name or a field only some stages have; it asks the registry (`rlhf_core.stages.STAGES`) and the
stage's config (`items_per_step`, `data_source`, `extra_exports`, `earlier_defaults`...). The names come from the
registry, so a new stage is covered.

Not counted as a stage's field: the settings every training stage shares (`StageConfig`'s fields, e.g. pretrain,
save_path, train_batch_size), and a field named as a metric the registry declares (the reward model's `loss`, its
loss type, is also the metric "loss"). The merge and export stages' names are the driver's own verbs
(`driver/export.py` runs them): only the training stages' names are looked for. Docstrings and comments may name
a stage as an example; code may not (its strings, names and attributes)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rlhf_core.stages import STAGES, TRAINING_STAGES
from rlhf_core.stages.base import StageConfig

ROOT = Path(__file__).resolve().parents[2]
GENERIC_PACKAGES = ("rlhf_core/driver", "rlhf_core/ops")


def stage_fields() -> set[str]:
    """The fields some stages have and others lack."""
    metrics = {name.removeprefix("eval_").removeprefix("mean_") for stage in STAGES.values()
               for name in stage.headline_metrics}
    every = {name for stage in STAGES.values() for name in stage.config.model_fields}
    return every - set(StageConfig.model_fields) - metrics


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = [tree, *(node for node in ast.walk(tree)
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return {id(node.body[0].value) for node in nodes
            if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def spelled(source: str, names: set[str], fields: set[str]) -> list[str]:
    """Where code spells a stage name (a word of a string or of a name it defines or reads, any case) or a stage
    field (a whole string, as getattr's or a dict's key, or an attribute), as 'line: what'."""
    tree = ast.parse(source)
    docstrings, found = _docstrings(tree), []
    word = re.compile(r"[A-Za-z0-9]+")
    for node in ast.walk(tree):
        text, identifier = None, None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
        elif isinstance(node, ast.Attribute) and node.attr in fields:  # another library's (rm_file) may say "rm"
            found.append(f"{node.lineno}: field {node.attr}")
        elif isinstance(node, ast.Name):
            identifier = node.id
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            identifier = node.name
        elif isinstance(node, ast.arg):
            identifier = node.arg
        words = {part.lower() for part in word.findall(text or identifier or "")}
        found += [f"{node.lineno}: stage {name}" for name in sorted(words & names)]
        if text in fields:
            found.append(f"{node.lineno}: field {text}")
    return sorted(found, key=lambda where: int(where.split(":")[0]))


def test_no_generic_module_spells_a_stage_or_a_stage_field():
    names, fields = set(TRAINING_STAGES), stage_fields()
    found = [f"{path.relative_to(ROOT)}:{where}" for package in GENERIC_PACKAGES
             for path in sorted((ROOT / package).glob("*.py")) for where in spelled(path.read_text(), names, fields)]
    assert found == []


def test_the_scan_sees_what_it_looks_for():
    names, fields = set(TRAINING_STAGES), stage_fields()
    assert {"prompt_data", "save_value_network", "dataset", "advantage_estimator"} <= fields
    assert not {"pretrain", "save_path", "train_batch_size", "loss"} & fields
    source = ('"""The sft stage: a docstring may name it."""\n'
              'x = getattr(cfg, "save_value_network", False)\n'
              'y = cfg.prompt_data\n'
              'if stage == "ppo": pass\n'
              'message = f"each PPO rank"\n'
              'def run_sft(): pass\n'
              'z = cfg.train_batch_size  # a field every training stage has\n')
    assert spelled(source, names, fields) == ["2: field save_value_network", "3: field prompt_data",
                                              "4: stage ppo", "5: stage ppo", "6: stage sft"]


def test_the_step_size_field_names_the_setting_items_per_step_reads():
    """`step_size_field` is named in the planner's message when the data cannot fill one step."""
    for name in TRAINING_STAGES:
        config = STAGES[name].config
        assert issubclass(config, StageConfig)
        settings = config.model_construct().model_copy(update={config.step_size_field: 7919})
        assert settings.items_per_step() == 7919, name


def test_each_training_stage_names_its_data_and_split_for_the_drift_fingerprint():
    """`data_source` is found by the data field's role (an evaluation's data is operational, so left out): a stage
    of another package with a `dataset` field gets its fingerprint without saying more; PPO's prompts have their
    own split setting."""
    expected = {"sft": ("dataset", "dataset_split"), "rm": ("dataset", "dataset_split"),
                "dpo": ("dataset", "dataset_split"), "prm": ("dataset", "dataset_split"),
                "ppo": ("prompt_data", "prompt_split")}
    assert set(expected) == set(TRAINING_STAGES)
    for name, (data, split) in expected.items():
        settings = STAGES[name].config.model_construct(**{data: "train.jsonl", split: "held", "eval_dataset": "e"})
        source = settings.data_source()
        assert source is not None and (source.url, source.split, source.flag) == ("train.jsonl", "held", f"--{data}")
    assert STAGES["merge"].config.model_construct().data_source() is None
