"""``ablation.png`` of ``dynamo ablate``: held-out pass@1 per variant with CIs and seeds, and the paired effects.
matplotlib is imported inside :func:`plot_ablation` only."""

from __future__ import annotations

from typing import Any, Mapping

from megatron_dynamo.experiments.variants import BASELINES, SFT, SFT_LABEL, display_order


EFFECTS = (("dra", "DRA"), ("gc", "GC"), ("ums", "UMS"), ("dynamo - grpo", "DynaMO - GRPO"),
           ("power 0.5 - power 1.0", "power 0.5 - 1.0"))


def _bar(ax, x, ci: Mapping[str, Any], color: str) -> None:
    """A mean with its CI as an error bar (in points); nothing when there is no mean."""
    if ci.get("mean") is None:
        return
    mean = 100 * ci["mean"]
    err = [[mean - 100 * ci["lo"]], [100 * ci["hi"] - mean]]
    ax.errorbar([x], [mean], yerr=err, fmt="o", color=color, capsize=5, markersize=7)


def _variants_panel(ax, analysis: Mapping[str, Any], order: list[str]) -> None:
    per = analysis["per_variant"]
    for i, name in enumerate(order):
        _bar(ax, i, per[name]["pass@1"], "tab:red" if name.startswith("dynamo") else
             "tab:gray" if name == "grpo" else "tab:orange" if name in BASELINES else "tab:blue")
        seeds = [v for v in per[name]["pass@1"].get("per_seed", {}).values() if v is not None]
        ax.scatter([i + 0.12] * len(seeds), [100 * v for v in seeds], s=10, color="black", alpha=0.5, zorder=3)
    for name, style, color in (("grpo", "--", "tab:gray"), (SFT, ":", "tab:green")):
        mean = per.get(name, {}).get("pass@1", {}).get("mean")
        if mean is not None:
            ax.axhline(100 * mean, linestyle=style, color=color, linewidth=1,
                       label=f"{'GRPO' if name == 'grpo' else SFT_LABEL} mean")
    ax.set_xlim(-0.6, len(order) - 0.4)
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels([f"{per[n]['label']}\n({n})" for n in order], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("held-out pass@1 (%)")
    ax.set_title("held-out pass@1: mean, 95% bootstrap CI, seeds (dots)")
    ax.grid(alpha=0.3, axis="y")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _effects_panel(ax, analysis: Mapping[str, Any]) -> None:
    for i, (key, _) in enumerate(EFFECTS):
        ci = analysis["effects"][key]["pass@1"]
        if ci.get("mean") is None:
            ax.text(i, 0, "n/a", ha="center", va="center", fontsize=8, color="gray")
            continue
        _bar(ax, i, ci, "tab:purple")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlim(-0.6, len(EFFECTS) - 0.4)
    ax.set_xticks(range(len(EFFECTS)))
    ax.set_xticklabels([label for _, label in EFFECTS], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("Δ held-out pass@1 (points)")
    ax.set_title("paired effects (marginal: mean of 4 pairs)")
    ax.grid(alpha=0.3, axis="y")


def plot_ablation(analysis: Mapping[str, Any], path: str, title: str = "DynaMO ablation") -> str:
    """``path`` (PNG): held-out pass@1 per variant with CI error bars (GRPO and SFT start as lines), and the
    paired effects with CIs."""
    import matplotlib  # an optional heavy library: only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = display_order(analysis["variants"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(14 + 0.6 * max(0, len(order) - 9), 5),
                                      gridspec_kw={"width_ratios": [3, 2]})
    _variants_panel(left, analysis, order)
    _effects_panel(right, analysis)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
