"""The variants ``dynamo ablate`` runs: the DynaMO ablation (paper Table 2) and the methods of the paper's Table 1.

A variant is ``(algo, overrides)``: the train command's ``--algo`` and the four keys every variant sets explicitly
(dynamo.allocation.enabled = DRA, dynamo.modulation.gc = GC, dynamo.modulation.ums = UMS,
dynamo.allocation.power). The ablation variants are ``--algo dynamo`` with the components switched on and off; the
seven baselines of Table 1 are GRPO (DRA, GC and UMS off) plus each one's own change, picked by ``--algo NAME``
(``megatron_dynamo/algorithms``: the trainer's registry of algorithms decides whether a name exists; an unknown
one fails when the variant's config is loaded, before any run).

Groups for ``--variants``: ``ablation`` (the nine ablation variants, the default), ``table1`` (GRPO, the seven
baselines, DynaMO) and ``all`` (both; GRPO and DynaMO are shared, so 16 variants).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AblationVariant:
    name: str
    dra: bool
    gc: bool
    ums: bool
    power: float
    label: str  # the paper's row label (Table 2, or Table 1 for the baselines)
    algo: str = "dynamo"  # the train command's --algo

    def overrides(self) -> tuple[str, ...]:
        """The four explicit train overrides of the variant."""
        b = lambda v: "true" if v else "false"  # noqa: E731
        return (f"dynamo.allocation.enabled={b(self.dra)}", f"dynamo.modulation.gc={b(self.gc)}",
                f"dynamo.modulation.ums={b(self.ums)}", f"dynamo.allocation.power={self.power:.1f}")

    @property
    def is_baseline(self) -> bool:
        """One of the seven Table 1 baselines (an --algo of its own), not a DRA/GC/UMS combination."""
        return self.algo != "dynamo"


def _baseline(name: str, label: str) -> AblationVariant:
    return AblationVariant(name, False, False, False, 1.0, label, algo=name)


# CLI order (and the default of --variants): GRPO, singles, pairs, DynaMO, DynaMO with power 0.5; then the
# baselines of Table 1 in the paper's order.
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
    _baseline("clip_higher", "Clip-Higher"),
    _baseline("entropy_loss", "Entropy Loss"),
    _baseline("fork_tokens", "Fork Tokens"),
    _baseline("entropy_adv", "Entropy Advantages"),
    _baseline("clip_cov", "Clip-COV"),
    _baseline("kl_cov", "KL-COV"),
    _baseline("w_reinforce", "W-REINFORCE"),
)}
BASELINES = tuple(name for name, v in VARIANTS.items() if v.is_baseline)
SFT = "sft"
SFT_LABEL = "SFT start"
# Rows of the paper's Table 2, in its order, then ours.
PAPER_ORDER = ("dynamo", "dra+ums", "dra+gc", "gc+ums", "ums", "dra", "gc", "grpo", "dynamo-p0.5")
# Rows of the paper's Table 1, in its order.
TABLE1_ORDER = ("grpo", *BASELINES, "dynamo")
GROUPS: dict[str, tuple[str, ...]] = {
    "ablation": tuple(name for name, v in VARIANTS.items() if not v.is_baseline),
    "table1": TABLE1_ORDER,
}
GROUPS["all"] = tuple(dict.fromkeys((*GROUPS["ablation"], *GROUPS["table1"])))
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
        if not v.is_baseline and (v.dra, v.gc, v.ums, v.power) == (dra, gc, ums, 1.0):
            return v.name
    raise KeyError((dra, gc, ums))


def display_order(variants: list[str] | tuple[str, ...]) -> list[str]:
    """Every variant of ``variants`` once: the Table 2 rows (paper order), then the Table 1 baselines."""
    return [v for v in (*PAPER_ORDER, *BASELINES) if v in variants]
