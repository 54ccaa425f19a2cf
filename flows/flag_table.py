"""The parts OpenRLHF's flag table (`flows.openrlhf_flags`) is written with: a `Flag` row, its three classes
(implemented, mapped, refused), the commands that speak each OpenRLHF module, and the row constructors."""

from __future__ import annotations

import os
from dataclasses import dataclass, field as dataclass_field
from typing import Any, Callable

from rlhf_core.stages import STAGES, TRAINING_STAGES

IMPLEMENTED, MAPPED, REFUSED = "implemented", "mapped", "refused"


def command_speaking(module: str) -> str:
    """Our command for OpenRLHF's `module`: the stage that declares it speaks that module's flags."""
    return next(name for name, stage in STAGES.items() if stage.openrlhf_module == module)


# The table is written in OpenRLHF's commands; each stage declares which one it speaks (rlhf_core.stages).
SFT, RM, PPO = command_speaking("train_sft"), command_speaking("train_rm"), command_speaking("train_ppo_ray")
DPO = command_speaking("train_dpo")
PRM = command_speaking("train_prm")  # OpenRLHF v0.9.0 .. v0.9.5 only: it has no 0.11 (dotted) spellings
COMBINER = "lora-combiner"  # `rlhf lora-combiner`, the merge stage's command
TRAIN = TRAINING_STAGES  # a flag every OpenRLHF trainer has applies to every training stage, a new one too
OPENRLHF_MODULES = {**{name: STAGES[name].openrlhf_module for name in TRAINING_STAGES},
                    COMBINER: next(stage.openrlhf_module for stage in STAGES.values() if stage.kind == "merge")}


@dataclass(frozen=True)
class Flag:
    """One OpenRLHF flag: its spellings, its class here, and where its value goes."""

    name: str  # the 0.9.x spelling ("" when only 0.11 has the flag)
    kind: str
    clis: tuple[str, ...]
    dotted: str | dict[str, str] = ""  # 0.11 spelling(s), per command when they differ; "a|b" gives two
    field: str | None = None  # our config field that receives the value
    note: str = ""  # mapped: what it does here; refused: why not
    takes: str = "value"  # "switch" (store_true), "value", "pair" (nargs 2) or "list" (nargs *)
    value_type: Callable[[str], Any] = str
    default: Any = None  # OpenRLHF's default: a refused flag given at this value is accepted silently
    convert: Callable[[Any], dict[str, Any]] | None = None  # value -> {field: value} (default: {field: value})
    # Why our default is not OpenRLHF's (per command when it differs): shown in the docs, and said once on the
    # console when a command leaves the flag out; "" when the default is OpenRLHF's.
    departs: str | dict[str, str] = ""
    departs_if: Callable[[Any], bool] | None = None  # run config -> whether the departure matters (else unsaid)
    # OpenRLHF 0.11's default, per command, where it changed 0.9.10's: a command line with a dotted spelling gets it.
    dotted_default: dict[str, Any] = dataclass_field(default_factory=dict)

    def dotted_names(self, cli: str) -> list[str]:
        spelled = self.dotted.get(cli, "") if isinstance(self.dotted, dict) else self.dotted
        return [name for name in spelled.split("|") if name]

    def spellings(self, cli: str) -> list[str]:
        names = ([self.name] if self.name else []) + self.dotted_names(cli)
        return list(dict.fromkeys(names))

    def departure(self, cli: str) -> str:
        """Why `cli`'s default for this flag is not OpenRLHF's; "" when it is."""
        return self.departs.get(cli, "") if isinstance(self.departs, dict) else self.departs

    def updates(self, value: Any) -> dict[str, Any]:
        """The config values a given flag value sets."""
        if self.convert is not None:
            return self.convert(value)
        return {self.field: value} if self.field else {}


def same(name: str, dotted: str | dict[str, str], clis: tuple[str, ...] = TRAIN, **kwargs: Any) -> Flag:
    """A flag implemented by our field of the same name."""
    return Flag(name, IMPLEMENTED, clis, dotted, field=kwargs.pop("field", name), **kwargs)


def noop(name: str, dotted: str | dict[str, str], note: str, clis: tuple[str, ...] = TRAIN, **kwargs: Any) -> Flag:
    """A flag accepted with a note saying why it has nothing to do here."""
    return Flag(name, MAPPED, clis, dotted, note=note, **kwargs)


def refuse(name: str, dotted: str | dict[str, str], note: str, clis: tuple[str, ...] = TRAIN, **kwargs: Any) -> Flag:
    return Flag(name, REFUSED, clis, dotted, note=note, **kwargs)


def dotted_in(name: str, *clis: str) -> dict[str, str]:
    """A 0.11 spelling for `clis` only: a row that also names PRM gives it none (train_prm never reached 0.11)."""
    return {cli: name for cli in clis}


def wandb_key_to_env(value: str) -> dict[str, Any]:
    """OpenRLHF takes the wandb API key as the flag's value: it goes to the environment, never into the config
    (which Prefect stores as parameters)."""
    if value.lower() not in ("true", "1", "yes"):
        os.environ["WANDB_API_KEY"] = value
    return {"use_wandb": True}


def target_modules_value(value: list[str]) -> dict[str, Any]:
    return {"target_modules": None if value in ([], ["all-linear"]) else value}


def dataset_probs_value(value: str) -> dict[str, Any]:
    return {"dataset_probs": value}


TRAIN_LR_SCHEDULE = "one schedule for actor and critic here"
COLOCATED = "actor, critic, reference and reward always share each rank here (colocated), so placement flags have nothing to place"
VLLM_ONLY = "a vLLM engine setting; without --vllm_num_engines (generation by transformers) it has nothing to set"
