"""The Plan stage: which runs an experiment makes (for ``dynamo ablate``: the SFT warm-up and the variants,
seed-major), their directories and train commands, and ``ablation_plan.json`` (what a later call must match). No
process is started here (:mod:`~megatron_dynamo.experiments.executor` runs the plan)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from megatron_dynamo.experiments.variants import SFT, VARIANTS
from megatron_dynamo.trainer.checkpoint import latest_checkpoint
from megatron_dynamo.trainer.provenance import checkpoint_hash

PLAN_FILE = "ablation_plan.json"


@dataclass(frozen=True)
class RunSpec:
    """One training run of an experiment: the SFT warm-up of a seed (``variant == "sft"``) or a variant."""

    variant: str
    seed: int
    output_dir: str
    sft_seed: int | None = None  # a variant: the seed of the SFT run it starts from (None: no SFT run)

    @property
    def key(self) -> tuple[str, int]:
        return self.variant, self.seed

    @property
    def is_sft(self) -> bool:
        return self.variant == SFT

    def describe(self) -> str:
        return f"{'SFT warm-up' if self.is_sft else self.variant} seed {self.seed}"


def run_dir(output_dir: str, variant: str, seed: int) -> str:
    if variant == SFT:
        return os.path.join(output_dir, "sft", f"seed{seed}")
    return os.path.join(output_dir, "runs", variant, f"seed{seed}")


def plan_runs(output_dir: str, seeds: Sequence[int], variants: Sequence[str], with_sft: bool,
              shared_sft_seed: int | None = None) -> list[RunSpec]:
    """Seed-major: for each seed its SFT run (when the recipe warms up), then its variants; with
    ``shared_sft_seed``, one SFT run (that seed) first, the start of every variant of every seed."""
    specs = []
    if with_sft and shared_sft_seed is not None:
        specs.append(RunSpec(SFT, shared_sft_seed, run_dir(output_dir, SFT, shared_sft_seed)))
    for seed in seeds:
        sft_seed = None
        if with_sft:
            sft_seed = seed if shared_sft_seed is None else shared_sft_seed
            if shared_sft_seed is None:
                specs.append(RunSpec(SFT, seed, run_dir(output_dir, SFT, seed)))
        specs.extend(RunSpec(v, seed, run_dir(output_dir, v, seed), sft_seed) for v in variants)
    return specs


def run_overrides(spec: RunSpec, user_overrides: Sequence[str], steps: int,
                  sft_checkpoint: str | None = None) -> list[str]:
    """The train overrides of a run: the user's, then the run's own (later ones win)."""
    own = [f"trainer.seed={spec.seed}", f"trainer.output_dir={spec.output_dir}"]
    if spec.is_sft:
        return [*user_overrides, *own, "trainer.steps=0", "evaluation.at_start=true"]
    own.append(f"evaluation.every={steps}")
    if sft_checkpoint is not None:
        # the SFT run evaluated this very model already: no second evaluation at step 0
        own += [f"model.checkpoint={sft_checkpoint}", "trainer.sft_warmup_steps=0", "evaluation.at_start=false"]
    return [*user_overrides, *VARIANTS[spec.variant].overrides(), *own]



def train_command(config: str, overrides: Sequence[str], resume: bool = False, python: str = sys.executable,
                  algo: str = "dynamo") -> list[str]:
    """``python -m megatron_dynamo.cli train CONFIG [overrides] --algo ALGO [--resume]``."""
    return [python, "-m", "megatron_dynamo.cli", "train", config, *overrides, "--algo", algo,
            *(["--resume"] if resume else [])]


def variant_algo(variant: str) -> str:
    """The --algo of a run: the variant's (a Table 1 baseline: its own name), ``dynamo`` for the SFT warm-up."""
    return "dynamo" if variant == SFT else VARIANTS[variant].algo


def sft_checkpoint(path: str) -> str | None:
    """The latest checkpoint of the SFT run in ``path`` (what every variant of its seeds starts from), or None."""
    latest = latest_checkpoint(os.path.join(path, "checkpoints"))
    return str(latest) if latest is not None else None


def warmup_hash(output_dir: str, sft_seed: int | None) -> str:
    """The hash of the warm-up a run of ``output_dir`` starts from (the latest checkpoint of the SFT run of seed
    ``sft_seed``, :func:`~megatron_dynamo.experiments.provenance.checkpoint_hash`); "" without one (yet)."""
    checkpoint = sft_checkpoint(run_dir(output_dir, SFT, sft_seed)) if sft_seed is not None else None
    return checkpoint_hash(checkpoint) if checkpoint else ""


def plan_record(config: str, overrides: Sequence[str], recipe: Mapping[str, Any], budget: Mapping[str, Any],
                seeds: Sequence[int], variants: Sequence[str]) -> dict[str, Any]:
    """What ``ablation_plan.json`` holds. ``recipe``: the resolved config (YAML + overrides) as plain data."""
    return {"config": config, "overrides": list(overrides), "recipe": json.loads(json.dumps(recipe, default=str)),
            "budget": dict(budget), "seeds": list(seeds), "variants": list(variants)}


def first_difference(old: Any, new: Any, prefix: str = "") -> str | None:
    """The dotted key of the first value of ``old`` that ``new`` lacks or changes, or None. A key only ``new`` has
    is no difference: a later version's new option, at its default, leaves the runs as they were."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for key, value in old.items():
            where = f"{prefix}.{key}" if prefix else str(key)
            if key not in new:
                return where
            found = first_difference(value, new[key], where)
            if found is not None:
                return found
        return None
    return None if old == new else (prefix or "(the whole recipe)")


def merge_plan(existing: Mapping[str, Any] | None, new: Mapping[str, Any], where: str = PLAN_FILE) -> dict[str, Any]:
    """The plan to write: ``new`` when there is none; ValueError when the config, overrides, budget or a value of the
    resolved recipe differ from ``existing`` (``where``: the file it came from, for the message); else seeds and
    variants are the union (existing first)."""
    if existing is None:
        return dict(new)
    for key in ("config", "overrides", "budget"):
        if existing.get(key) != new.get(key):
            what = {"config": "the recipe path", "overrides": "the overrides", "budget": "the rollout budget"}[key]
            raise ValueError(f"{what} differs from the existing ablation's {where}: {existing.get(key)!r} there, "
                             f"{new.get(key)!r} now")
    changed = first_difference(existing.get("recipe"), new.get("recipe"))
    if changed is not None:
        raise ValueError(f"the resolved recipe (the YAML file changed?) differs from the existing ablation's {where} "
                         f"at {changed}")
    merged = dict(existing)
    merged["seeds"] = list(existing.get("seeds", [])) + [s for s in new["seeds"] if s not in existing.get("seeds", [])]
    merged["variants"] = list(existing.get("variants", [])) + [v for v in new["variants"]
                                                               if v not in existing.get("variants", [])]
    return merged
