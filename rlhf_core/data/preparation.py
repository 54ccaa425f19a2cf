"""A stage's dataset prepared once: found in the run's store by its key, else streamed, turned into columns batch by
batch (the stage's `job`, over worker processes when large), published, and read back memory-mapped. Each stage's
data module (`prepare_sft`, `pairs`, `prompts`) names its job, its columns and how a row becomes an item; this
module holds what they share. docs/design-notes.md ("Prepared data") has the design.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from rlhf_core.data.fingerprints import fingerprint
from rlhf_core.data.columns import FlatColumns, PreparedRows, write_batches
from rlhf_core.data.prepared import PreparedStore, preparation_key, source_versions
from rlhf_core.data.stream import RecordStream
from rlhf_core.data.tokenizer_ref import identity_of
from rlhf_core.data.workers import Job, map_batches
from rlhf_core.notices import note_once


@dataclass(frozen=True)
class Source:
    """Where a stage's rows come from: a --dataset (mixture), --eval_dataset or --prompt_data and how to read it."""

    url: str
    flag: str
    split: str = "train"
    max_samples: int | None = None
    probs: str | None = None
    seed: int = 0

    def stream(self, storage_options: dict | None, max_samples: int | None = None,
               hash_whole_file: bool = True) -> RecordStream:
        """Its records in batches (`max_samples` overrides the source's, for a first look at its rows)."""
        return RecordStream(self.url, storage_options, max_samples or self.max_samples, self.split, self.probs,
                            self.seed, self.flag, hash_whole_file=hash_whole_file)

    def settings(self) -> dict[str, Any]:
        """What of the source, beyond its files' versions, the prepared rows depend on."""
        return {"max_samples": self.max_samples, "split": self.split, "probs": self.probs,
                "seed": self.seed if self.probs else None}


def stage_source(cfg, seed: int, evaluation: bool = False) -> Source:
    """An SFT, RM, DPO or PRM stage's --dataset mixture, or with `evaluation` its --eval_dataset."""
    if evaluation:
        # Whole, as OpenRLHF's trainers read it: --max_samples cuts the training data only.
        return Source(cfg.eval_dataset, "--eval_dataset", cfg.eval_split, None, None, seed)
    return Source(cfg.dataset, "--dataset", cfg.dataset_split, cfg.max_samples, cfg.dataset_probs, seed)


@dataclass(frozen=True)
class Preparation:
    """What a stage prepares from its source: the kind and settings in the key, the batch job, the columns, how a
    row becomes an item, the sentence for a dataset that leaves nothing, and an optional rule across batches
    (`check` sees every batch's columns, in order, in this process)."""

    kind: str
    settings: dict[str, Any]
    job: Job
    columns: dict[str, str]  # name -> kind, see `rlhf_core.data.columns`
    make: Callable[..., Any]
    no_rows: Callable[[], None]
    check: Callable[[FlatColumns], None] | None = None

    def key(self, source: Source, run, tokenizer) -> tuple[str, dict, list]:
        """(key, what it hashes, the files' versions) of this preparation of `source`."""
        versions = source_versions(source.url, run.storage_options, source.split, source.flag)
        key, inputs = preparation_key(self.kind, versions, identity_of(tokenizer),
                                      {**self.settings, **source.settings()})
        return key, inputs, versions


def existing_rows(preparation: Preparation, source: Source, run, tokenizer) -> PreparedRows | None:
    """The prepared rows when a valid preparation is in the run's store already, else None (nothing is built)."""
    key, _, _ = preparation.key(source, run, tokenizer)
    found = PreparedStore(run.ckpt_path, run.storage_options).open(key)
    return None if found is None else PreparedRows(found[0], preparation.make)


def prepared_rows(preparation: Preparation, source: Source, run, tokenizer) -> PreparedRows:
    """The rows of `source` as the preparation's job makes them, prepared once in the run's store under its key
    (the kind, the files' versions, the tokenizer and the settings) and memory-mapped."""
    key, inputs, versions = preparation.key(source, run, tokenizer)
    store = PreparedStore(run.ckpt_path, run.storage_options)
    found = store.open(key)
    if found is None:
        stream = source.stream(run.storage_options)

        def write(path: str) -> dict:
            columns, check = preparation.columns, preparation.check
            batches = map_batches(stream.blocks(), source.url, preparation.job, columns)
            rows = write_batches(path, columns, batches if check is None else _checked(batches, check),
                                 f"{source.flag} {source.url}", lambda: stream.position)
            if rows == 0:
                preparation.no_rows()
            return {"rows": rows, "inputs": inputs, "file_hashes": _file_hashes(source, versions, stream, run),
                    "max_samples_cut": stream.cut}

        store.publish(key, write)
        found = store.open(key)
        for _, version, digest in (found or (None, {}))[1].get("file_hashes", []):
            store.save_hash(version, digest)
        if found is None:  # removed or damaged between publishing and reading: a store that keeps nothing
            raise RuntimeError(f"prepared data {store.local_dir(key)} could not be read back after publishing")
    _say_cut(source, found[1].get("max_samples_cut"))
    return PreparedRows(found[0], preparation.make)


def _say_cut(source: Source, cut: list | None) -> None:
    """One line per process when --max_samples left rows of the data out (said again by a run that finds the
    preparation made: the data it trains on is still cut)."""
    if cut:
        kept, dropped = cut
        note_once(f"--max_samples {source.max_samples}: {source.flag} {source.url} is cut to its first {kept:,} rows; "
                  f"{dropped:,} of its {kept + dropped:,} rows are dropped.", key=f"max-samples-cut:{source.url}")


def _checked(batches: Iterable[FlatColumns], check: Callable[[FlatColumns], None]) -> Iterator[FlatColumns]:
    for batch in batches:
        check(batch)
        yield batch


def _file_hashes(source: Source, versions: list, stream: RecordStream, run) -> list:
    """[url, version, sha256] of each plain file of the source, for the drift check: the streamed file's hash was
    taken as it was read; any other file is hashed once here."""
    hashes = []
    for kind, *version in versions:
        if kind != "file":
            continue
        digest = stream.sha256 if stream.sha256 and version[0] == source.url else fingerprint(
            version[0], run.storage_options, split=source.split, flag=source.flag)
        hashes.append([version[0], version, digest])
    return hashes
