"""The one registry of experiment variants: what ``dynamo ablate`` runs (the DynaMO ablation of paper Table 2, the
methods of the paper's Table 1, the controls of issue 32 that name the mechanisms) and what ``dynamo compare`` runs
(:func:`compare_variant`: grpo, dynamo, dynamo-p<P>). A variant names its ``--algo`` (the loss and config change of
a Table 1 baseline are registered with its label in ``algorithms/baselines.py``, which the trainer's ``--algo``
reads; the ablation variants and controls are registered here), its overrides and its label, here and nowhere else.

A variant is ``(algo, overrides)``: the train command's ``--algo`` and the keys every variant sets explicitly
(:data:`VARIANT_KEYS`: dynamo.allocation.enabled = DRA, dynamo.modulation.gc = GC, dynamo.modulation.ums = UMS,
dynamo.allocation.power, dynamo.modulation.pos_weight, dynamo.loss.prompt_weight, dynamo.sampling.dynamic), plus a
control's own extra overrides (a learning rate, a clip). The ablation variants are ``--algo dynamo`` with the
components switched on and off; the seven baselines of Table 1 are GRPO (DRA, GC and UMS off) plus each one's own
change, picked by ``--algo NAME`` (``megatron_dynamo/algorithms``: the trainer's registry of algorithms decides
whether a name exists; an unknown one fails when the variant's config is loaded, before any run).

Controls (kind ``control``; each answers one question of the preregistration, docs/ablation.md):
``pos_weight`` (GRPO with every positive advantage x (1 + alpha): is GC a constant reweighting?), ``dra-equal`` (DRA's
allocation, every prompt weighted equally in the loss: variance reduction or curriculum?), ``grpo+ds`` /
``dynamo+ds`` (DAPO's dynamic sampling, the field's answer to zero-variance groups), the high-learning-rate grid
``grpo-hlr``, ``ums-hlr``, ``gc-hlr``, ``gc+ums-hlr`` (at :data:`HIGH_LR`, where GRPO degrades: does UMS stabilise
it?), and ``clip_cov_authors`` (Clip-COV with its authors' PPO clip 1 / 1).

Groups for ``--variants``: ``ablation`` (the nine ablation variants, the default), ``table1`` (GRPO, the seven
baselines, DynaMO), ``all`` (both; GRPO and DynaMO are shared, so 16 variants), ``factorial`` (the eight power-1
DRA x GC x UMS variants), ``controls`` (pos_weight, dra-equal, grpo+ds, dynamo+ds), ``high_lr`` (the grid) and
``confirmatory`` (factorial + controls, the preregistered runs at the recipe's learning rate).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_dynamo.algorithms.baselines import BASELINES as BASELINE_ALGORITHMS, GRPO_KEYS


#: The learning rate of the high-lr grid: where GRPO degrades on the mechanism testbed (the probe of issue 32,
#: docs/results/testbed.md; the recipe's own rate is 5e-5).
HIGH_LR = "1.5e-4"
#: The keys every variant sets explicitly, whatever the recipe says (``dynamo ablate`` refuses them as overrides).
VARIANT_KEYS = (*GRPO_KEYS, "dynamo.allocation.power", "dynamo.modulation.pos_weight", "dynamo.loss.prompt_weight",
                "dynamo.sampling.dynamic")  # GRPO_KEYS: DRA, GC, UMS (what --algo grpo turns off)

#: The keys ``dynamo ablate`` sets per run (passing them as overrides is an error).
RESERVED_KEYS = ("trainer.seed", "trainer.output_dir", "evaluation.every", *VARIANT_KEYS)


@dataclass(frozen=True)
class AblationVariant:
    name: str
    dra: bool
    gc: bool
    ums: bool
    power: float
    label: str  # the paper's row label (Table 2, or Table 1 for the baselines), or the control's
    algo: str = "dynamo"  # the train command's --algo
    kind: str = "ablation"  # "ablation", "baseline" (Table 1) or "control"
    pos_weight: bool = False
    prompt_weight: str = "rollouts"
    dynamic: bool = False
    extra: tuple[str, ...] = ()  # a control's own overrides, after the explicit keys

    def overrides(self) -> tuple[str, ...]:
        """The explicit train overrides of the variant: :data:`VARIANT_KEYS`, then its ``extra``."""
        b = lambda v: "true" if v else "false"  # noqa: E731
        values = (b(self.dra), b(self.gc), b(self.ums), f"{self.power:.1f}", b(self.pos_weight), self.prompt_weight,
                  b(self.dynamic))
        return (*(f"{key}={value}" for key, value in zip(VARIANT_KEYS, values)), *self.extra)

    @property
    def is_baseline(self) -> bool:
        """One of the seven Table 1 baselines (an --algo of its own), not a DRA/GC/UMS combination."""
        return self.kind == "baseline"

    @property
    def is_factorial(self) -> bool:
        """One of the eight power-1 DRA x GC x UMS variants of the ablation (nothing else changed)."""
        return self.kind == "ablation" and self.power == 1.0


def _baseline(name: str) -> AblationVariant:
    """A Table 1 baseline: GRPO's switches, ``--algo NAME``, the label registered with its loss."""
    return AblationVariant(name, False, False, False, 1.0, BASELINE_ALGORITHMS[name].label, algo=name, kind="baseline")


def _control(name: str, label: str, dra: bool = False, gc: bool = False, ums: bool = False, **changes) -> AblationVariant:
    return AblationVariant(name, dra, gc, ums, 1.0, label, kind="control", **changes)


# CLI order (and the default of --variants): GRPO, singles, pairs, DynaMO, DynaMO with power 0.5; then the
# baselines of Table 1 in the paper's order; then the controls.
VARIANTS: dict[str, AblationVariant] = {v.name: v for v in (
    AblationVariant("grpo", False, False, False, 1.0, "GRPO (w/o ALL)"),
    AblationVariant("dra", True, False, False, 1.0, "w/o GC & UMS"),
    AblationVariant("gc", False, True, False, 1.0, "w/o UMS & DRA"),
    AblationVariant("ums", False, False, True, 1.0, "w/o GC & DRA"),
    AblationVariant("dra+gc", True, True, False, 1.0, "w/o UMS"),
    AblationVariant("dra+ums", True, False, True, 1.0, "w/o GC"),
    AblationVariant("gc+ums", False, True, True, 1.0, "w/o DRA"),
    AblationVariant("dynamo", True, True, True, 1.0, "DynaMO"),
    AblationVariant("dynamo-p0.5", True, True, True, 0.5, "DynaMO, power 0.5"),
    *(_baseline(name) for name in BASELINE_ALGORITHMS),
    _control("pos_weight", "GRPO, positive A x (1 + alpha)", pos_weight=True),
    _control("dra-equal", "DRA, prompts weighted equally", dra=True, prompt_weight="equal"),
    _control("grpo+ds", "GRPO + dynamic sampling", dynamic=True),
    _control("dynamo+ds", "DynaMO + dynamic sampling", dra=True, gc=True, ums=True, dynamic=True),
    _control("grpo-hlr", f"GRPO, lr {HIGH_LR}", extra=(f"optim.lr={HIGH_LR}",)),
    _control("ums-hlr", f"UMS, lr {HIGH_LR}", ums=True, extra=(f"optim.lr={HIGH_LR}",)),
    _control("gc-hlr", f"GC, lr {HIGH_LR}", gc=True, extra=(f"optim.lr={HIGH_LR}",)),
    _control("gc+ums-hlr", f"GC + UMS, lr {HIGH_LR}", gc=True, ums=True, extra=(f"optim.lr={HIGH_LR}",)),
    AblationVariant("clip_cov_authors", False, False, False, 1.0, "Clip-COV, clip 1 / 1 (authors')",
                    algo="clip_cov", kind="control",
                    extra=("dynamo.loss.clip_low=1", "dynamo.loss.clip_high=1")),
)}
BASELINES = tuple(name for name, v in VARIANTS.items() if v.is_baseline)
CONTROLS = tuple(name for name, v in VARIANTS.items() if v.kind == "control")
SFT = "sft"
SFT_LABEL = "SFT start"
# Rows of the paper's Table 2, in its order, then ours.
PAPER_ORDER = ("dynamo", "dra+ums", "dra+gc", "gc+ums", "ums", "dra", "gc", "grpo", "dynamo-p0.5")
# Rows of the paper's Table 1, in its order.
TABLE1_ORDER = ("grpo", *BASELINES, "dynamo")
GROUPS: dict[str, tuple[str, ...]] = {
    "ablation": tuple(name for name, v in VARIANTS.items() if v.kind == "ablation"),
    "table1": TABLE1_ORDER,
    "factorial": tuple(name for name, v in VARIANTS.items() if v.is_factorial),
    "controls": ("pos_weight", "dra-equal", "grpo+ds", "dynamo+ds"),
    "high_lr": ("grpo-hlr", "ums-hlr", "gc-hlr", "gc+ums-hlr"),
}
GROUPS["all"] = tuple(dict.fromkeys((*GROUPS["ablation"], *GROUPS["table1"])))
GROUPS["confirmatory"] = (*GROUPS["factorial"], *GROUPS["controls"])
DEFAULT_GROUP = "ablation"
COMPONENTS = ("dra", "gc", "ums")
COMPONENT_LABELS = {"dra": "DRA", "gc": "GC", "ums": "UMS"}


def parse_variants(text: str) -> list[str]:
    """``--variants``: comma-separated names of :data:`VARIANTS` or groups of :data:`GROUPS` (expanded in place),
    in the given order. A name may be given once; a group's members already listed are not repeated."""
    items = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in items if n not in VARIANTS and n not in GROUPS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(map(repr, unknown))}: choose from {', '.join(VARIANTS)} "
                         f"or a group ({', '.join(GROUPS)})")
    if not items or len(set(items)) != len(items):
        raise ValueError(f"--variants must list distinct variants, got {text!r}")
    names: list[str] = []
    for item in items:
        names.extend(n for n in GROUPS.get(item, (item,)) if n not in names)
    return names


def variant_with(dra: bool, gc: bool, ums: bool) -> str:
    """The power-1 ablation variant (``--algo dynamo``) with these components on."""
    for v in VARIANTS.values():
        if v.is_factorial and (v.dra, v.gc, v.ums) == (dra, gc, ums):
            return v.name
    raise KeyError((dra, gc, ums))


def display_order(variants: list[str] | tuple[str, ...]) -> list[str]:
    """Every variant of ``variants`` once: the Table 2 rows (paper order), the Table 1 baselines, the controls."""
    return [v for v in (*PAPER_ORDER, *BASELINES, *CONTROLS) if v in variants]


@dataclass(frozen=True)
class Variant:
    """A ``dynamo compare`` variant: the recipe with ``--algo algo`` and ``overrides`` (only what it changes)."""

    name: str
    algo: str
    overrides: tuple[str, ...]


def compare_variant(name: str) -> Variant:
    """``grpo`` | ``dynamo`` | ``dynamo-p<power>`` -> the train command's --algo and overrides."""
    name = name.strip()
    if name == "grpo":
        return Variant(name, "grpo", ())
    if name == "dynamo":
        return Variant(name, "dynamo", ("dynamo.allocation.power=1.0",))
    match = re.fullmatch(r"dynamo-p(\d+(?:\.\d*)?|\.\d+)", name)
    if match:
        power = float(match.group(1))
        if power <= 0:
            raise ValueError(f"variant {name!r}: the power must be > 0")
        return Variant(name, "dynamo", (f"dynamo.allocation.power={power}",))
    raise ValueError(f"unknown variant {name!r}: use grpo, dynamo or dynamo-p<power> (e.g. dynamo-p0.5)")
