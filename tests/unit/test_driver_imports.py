"""The driver imports what it uses (issue 46): no module on the driver's path imports torch, transformers, their
tokenizers or matplotlib when it is imported, and a command whose data is prepared never imports them at all:
preflight counts from the preparation (the tokenizer's identity recorded beside it), the model folder check reads
config.json, and the export copies the tokenizer's files kept when the data was counted. Each check runs in a
fresh interpreter, whose audit hook names the line that first imported a heavy library."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import flows
import rlhf_core
import tasks

HEAVY = ("torch", "transformers", "tokenizers", "matplotlib")
PROJECT_DIR = Path(__file__).resolve().parents[2]
# Rank-side code, and the commands that build a model: they import torch or a tokenizer on purpose.
NOT_ON_THE_DRIVER = ("rlhf_core.rank", "rlhf_core.models", "rlhf_core.data.determinism", "rlhf_core.toy",
                     "flows.demo")

# Prepended to the interpreter's code: records the stack of each heavy library's first import in `FIRST_IMPORTS`.
WATCH = textwrap.dedent(f"""
    import sys, traceback
    FIRST_IMPORTS = {{}}
    def _watch(event, args):
        if event == "import" and args[0] in {HEAVY!r} and args[0] not in FIRST_IMPORTS:
            frames = [frame for frame in traceback.extract_stack()[:-1]
                      if "importlib" not in frame.filename and not frame.filename.startswith("<")]
            FIRST_IMPORTS[args[0]] = "".join(traceback.format_list(frames[-8:]))
    sys.addaudithook(_watch)
""")
REPORT = "\nimport json; print(json.dumps(FIRST_IMPORTS))\n"


def heavy_imports(code: str, cwd: Path = PROJECT_DIR) -> dict[str, str]:
    """{library: the stack that imported it} for each of HEAVY that `code` imports in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-c", WATCH + textwrap.dedent(code) + REPORT], capture_output=True,
                            text=True, cwd=cwd, timeout=300, env={**os.environ, "PYTHONPATH": str(PROJECT_DIR)})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def driver_modules() -> list[str]:
    """Every module of flows/, tasks/ and rlhf_core/ that runs on the driver."""
    names = []
    for package in (flows, tasks, rlhf_core):
        names += [info.name for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")]
    return [name for name in names if not name.startswith(NOT_ON_THE_DRIVER)]


def test_no_driver_module_imports_torch_transformers_or_matplotlib_at_module_level():
    modules = driver_modules()
    assert {"flows.cli", "flows.pipeline", "tasks.chunks", "rlhf_core.driver.export",
            "rlhf_core.driver.preflight", "rlhf_core.storage.locate"} <= set(modules)
    imported = heavy_imports("import importlib\n" + "".join(f"importlib.import_module({name!r})\n"
                                                            for name in modules))
    assert imported == {}, "\n".join(f"{name} imported by:\n{stack}" for name, stack in imported.items())


def toy_run_code(toy_assets: dict[str, str], **settings) -> str:
    sft = {"pretrain": toy_assets["model"], "dataset": toy_assets["sft"], "input_key": "prompt",
           "output_key": "response", "max_len": 64, "train_batch_size": 8, "micro_train_batch_size": 8,
           "save_path": "out", **settings}
    return f"""
        from rlhf_core.config import RunConfig
        from rlhf_core.driver.preflight import preflight
        from rlhf_core.stages.sft import SFTConfig
        checked = preflight(RunConfig(ckpt_path="ckpt", sft=SFTConfig(**{sft!r})))
        assert checked.plans["sft"].num_samples == 256, checked.plans
    """


def test_a_run_whose_data_is_prepared_counts_it_without_torch_or_the_tokenizer(toy_assets, tmp_path):
    model = tmp_path / "model"  # the toy's files, linked: its tokenizer_config.json is rewritten at the end
    model.mkdir()
    for path in Path(toy_assets["model"]).iterdir():
        (model / path.name).symlink_to(path)
    toy = {**toy_assets, "model": str(model)}
    template = {"tokenizer_chat_template": "{{ messages[0]['content'] }}"}

    def loads_the_tokenizer(**settings) -> bool:
        imported = heavy_imports(toy_run_code(toy, **settings), cwd=tmp_path)
        assert set(imported) <= {"tokenizers", "transformers", "torch"}, imported
        return "tokenizers" in imported

    assert loads_the_tokenizer()  # preparing the data tokenizes it
    imported = heavy_imports(toy_run_code(toy), cwd=tmp_path)
    assert imported == {}, "\n".join(f"{name} imported by:\n{stack}" for name, stack in imported.items())
    assert_export_copies_what_a_fresh_save_writes(str(model), tmp_path)
    assert loads_the_tokenizer(**template) and not loads_the_tokenizer(**template)  # a template of the run's own
    assert loads_the_tokenizer(tokenizer_chat_template="{{ messages[-1]['content'] }}")  # another one
    config = model / "tokenizer_config.json"
    content = json.loads(config.read_text())
    config.unlink()
    config.write_text(json.dumps(content, indent=2))  # the same tokenizer in another file: another version
    assert loads_the_tokenizer()



def test_another_run_of_the_same_model_prepares_its_data_from_the_snapshot_without_transformers(toy_assets, tmp_path,
                                                                                               monkeypatch):
    """The first run of a model folder loads its tokenizer and records it in this machine's cache; a run in
    another store prepares the same data, byte for byte, from that record: `tokenizers` only, no transformers,
    no torch."""
    monkeypatch.setenv("RLHF_TOKENIZER_CACHE", str(tmp_path / "machine-cache"))
    first = heavy_imports(toy_run_code(toy_assets), cwd=tmp_path)
    assert "transformers" in first
    second = heavy_imports(toy_run_code(toy_assets).replace('ckpt_path="ckpt"', 'ckpt_path="ckpt2"'), cwd=tmp_path)
    assert set(second) == {"tokenizers"}, "\n".join(f"{name} imported by:\n{stack}" for name, stack in second.items())
    prepared = [sorted(path.relative_to(tmp_path / ckpt) for path in (tmp_path / ckpt / ".prepared").rglob("*")
                       if path.is_file() and "tokenizers" not in path.parts) for ckpt in ("ckpt", "ckpt2")]
    assert prepared[0] and prepared[0] == prepared[1]
    for path in (path for path in prepared[0] if path.name != "PREPARED.json"):  # the marker holds its time
        assert (tmp_path / "ckpt" / path).read_bytes() == (tmp_path / "ckpt2" / path).read_bytes(), path
    assert_export_copies_what_a_fresh_save_writes(toy_assets["model"], tmp_path, ckpt="ckpt2")



def assert_export_copies_what_a_fresh_save_writes(model: str, run_dir: Path, ckpt: str = "ckpt") -> None:
    """The tokenizer files the count kept for the export are those `save_pretrained` writes of the tokenizer."""
    from rlhf_core.data.prepared import PreparedStore
    from rlhf_core.data.tokenizer_ref import saved_tokenizer_files
    from rlhf_core.storage.locate import load_tokenizer

    kept = saved_tokenizer_files(model, None, PreparedStore(str(run_dir / ckpt)))
    assert kept is not None
    fresh = run_dir / "fresh"
    load_tokenizer(model).save_pretrained(fresh)
    assert sorted(os.listdir(kept)) == sorted(os.listdir(fresh))
    for name in os.listdir(fresh):
        assert (Path(kept) / name).read_bytes() == (fresh / name).read_bytes(), name
