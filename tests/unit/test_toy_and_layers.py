"""Toy assets load offline with the Auto classes; rlhf_core stays free of prefect."""

from __future__ import annotations

import json
import subprocess
import sys

from rlhf_core.toy import gold_score, init_toy


def test_toy_assets_load_with_auto_classes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = init_toy(str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"])
    assert sum(p.numel() for p in model.parameters()) < 200_000
    ids = tokenizer("sort : 3 1 2 =", add_special_tokens=False).input_ids
    assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == "sort : 3 1 2 ="
    for name in ("sft", "prefs", "prompts"):
        first = json.loads(open(paths[name]).readline())
        assert "prompt" in first
    again = init_toy(str(tmp_path / "again"))
    assert open(again["sft"]).read() == open(paths["sft"]).read()  # deterministic


def test_gold_score():
    assert gold_score("sort : 3 1 2 =", "1 2 3") == 1.0
    assert gold_score("sort : 3 1 2 =", "1 3 2") == 1 / 3
    assert gold_score("sort : 3 1 2 =", "1 2 3 4") == 0.75
    assert gold_score("sort : 3 1 2 =", "") == 0.0


def test_rlhf_core_never_imports_prefect():
    code = (
        "import importlib, pkgutil, sys, rlhf_core\n"
        "for module in pkgutil.walk_packages(rlhf_core.__path__, 'rlhf_core.'):\n"
        "    importlib.import_module(module.name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'prefect'))\n"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip().splitlines()[-1] == "[]"
