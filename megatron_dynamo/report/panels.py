"""The panels of ``dynamo report``'s figure (``report/page.py`` lays them out): one function per panel, each
drawing into its matplotlib axes and returning its manifest entry, and the final numbers of a run.
"""

from __future__ import annotations

import textwrap
from typing import Any, Sequence

from megatron_dynamo.report import runs as R
from megatron_dynamo.report.thresholds import tail_mean

COLUMNS = 3
# Success-rate bins (low, high]: all wrong and all right on their own (DRA's P = 0 prompts), the rest in fifths.
_SUCCESS_BINS = ((-1.0, 0.0), (0.0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 1.0 - 1e-9), (1.0 - 1e-9, 1.0))


def default_window(runs: Sequence[R.Run]) -> int:
    """A tenth of the longest run, at least 3 steps but at most a quarter of the run (1 for very short runs)."""
    longest = max((len(r.steps) for r in runs), default=0)
    return max(1, min(max(3, round(longest / 10)), longest // 4))


def run_colors(n: int) -> list:
    import matplotlib.pyplot as plt

    base = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if n <= len(base):
        return base[:n]
    cmap = plt.get_cmap("tab20")
    return [cmap(i % 20) for i in range(n)]


def _no_data(ax, reason: str) -> None:
    ax.text(0.5, 0.55, "no data", ha="center", va="center", fontsize=16, color="0.45", transform=ax.transAxes)
    ax.text(0.5, 0.36, textwrap.fill(reason, 48), ha="center", va="center", fontsize=8.5, color="0.45",
            transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_color("0.8")


def _panel(ax, panel_id: str, title: str, xlabel: str, ylabel: str) -> dict[str, Any]:
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return {"id": panel_id, "title": title, "xlabel": xlabel, "ylabel": ylabel, "runs": [], "no_data": False}


def _finish(ax, info: dict[str, Any], reason: str) -> dict[str, Any]:
    if not info["runs"]:
        info["no_data"] = True
        info["reason"] = reason
        _no_data(ax, reason)
    else:
        ax.grid(alpha=0.3)
    return info


def smoothed_panel(ax, runs, colors, what: str, title: str, ylabel: str, window: int) -> dict[str, Any]:
    from matplotlib.lines import Line2D

    info = _panel(ax, what, title, "step", ylabel)
    for run, color in zip(runs, colors):
        steps, values = R.series(run, what)
        if not steps:
            continue
        if window > 1:
            ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.9)
        ax.plot(steps, R.moving_mean(values, window), color=color, linewidth=2.0)
        info["runs"].append(run.label)
    if info["runs"] and window > 1:
        ax.legend(handles=[Line2D([], [], color="0.4", alpha=0.4, linewidth=0.9, label="per step"),
                           Line2D([], [], color="0.4", linewidth=2.0, label=f"moving mean ({window} steps)")],
                  fontsize=8, loc="best")
    return _finish(ax, info, f"no run logs {R.KEYS[what][0]}")


def variance_ratio_panel(ax, runs, colors) -> dict[str, Any]:
    info = _panel(ax, "variance_ratio", "eq. 23 variance ratio (allocation / uniform)", "step",
                  "predicted variance ratio")
    for run, color in zip(runs, colors):
        steps, values = R.series(run, "variance_ratio")
        if steps:
            ax.plot(steps, values, color=color, linewidth=1.5, marker="." if len(steps) < 40 else None)
            info["runs"].append(run.label)
    if info["runs"]:
        ax.axhline(1.0, color="0.5", linestyle="--", linewidth=1)
        ax.text(0.99, 1.0, "uniform ", color="0.4", fontsize=8, ha="right", va="bottom",
                transform=ax.get_yaxis_transform())
    return _finish(ax, info, "no run logs variance_ratio")


def modulation_panel(ax, runs, colors) -> dict[str, Any]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    info = _panel(ax, "modulation", "advantage modulation factors", "step", "factor")
    styles = (("scale_mean", "-", 2.0, "scale mean (beta_comp x beta_stab)"),
              ("beta_stab_mean", "--", 1.2, "beta_stab mean"),
              ("beta_stab_min", ":", 1.2, "beta_stab min"),
              ("beta_comp_mean_pos", "-.", 1.2, "beta_comp mean (A > 0)"))
    used, band = set(), False
    for run, color in zip(runs, colors):
        plotted = False
        low_steps, low = R.series(run, "scale_p10")
        high_steps, high = R.series(run, "scale_p90")
        if low_steps and low_steps == high_steps:
            ax.fill_between(low_steps, low, high, color=color, alpha=0.18, linewidth=0)
            band = plotted = True
        for what, style, width, _ in styles:
            steps, values = R.series(run, what)
            if steps:
                ax.plot(steps, values, color=color, linestyle=style, linewidth=width)
                used.add(what)
                plotted = True
        if plotted:
            info["runs"].append(run.label)
    if info["runs"]:
        ax.axhline(1.0, color="0.6", linewidth=0.8)
        handles = [Line2D([], [], color="0.3", linestyle=style, linewidth=width, label=label)
                   for what, style, width, label in styles if what in used]
        if band:
            handles.insert(1, Patch(color="0.3", alpha=0.25, label="scale p10-p90"))
        low, high = ax.get_ylim()
        ax.set_ylim(low, high + 0.3 * (high - low))  # room for the legend above the curves
        ax.legend(handles=handles, fontsize=7.5, loc="upper center", ncol=2)
    info["band"] = band
    return _finish(ax, info, "no run logs modulation/* (modulation off, e.g. GRPO)")


def eval_panel(ax, runs, colors) -> dict[str, Any]:
    from matplotlib.lines import Line2D

    info = _panel(ax, "eval", "evaluation pass@k", "step", "pass@k")
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    ks_used, benches_used = [], []
    for run, color in zip(runs, colors):
        data = R.eval_series(run)
        if not data:
            continue
        benches = ["avg"] if any(b == "avg" for b, _ in data) else sorted({b for b, _ in data})
        for (bench, k), (steps, values) in sorted(data.items(), key=lambda item: (item[0][1], item[0][0])):
            if bench not in benches:
                continue
            if k not in ks_used:
                ks_used.append(k)
            if bench not in benches_used:
                benches_used.append(bench)
            ax.plot(steps, values, color=color, linestyle=styles[ks_used.index(k) % len(styles)],
                    marker=markers[benches_used.index(bench) % len(markers)], markersize=4, linewidth=1.4)
        info["runs"].append(run.label)
    if info["runs"]:
        handles = [Line2D([], [], color="0.3", linestyle=styles[i % len(styles)], label=f"pass@{k}")
                   for i, k in enumerate(ks_used)]
        if benches_used != ["avg"]:
            handles += [Line2D([], [], color="0.3", linestyle="none", marker=markers[i % len(markers)], label=b)
                        for i, b in enumerate(benches_used)]
        else:
            handles = [Line2D([], [], color="0.3", linestyle=h.get_linestyle(),
                              label=h.get_label() + " (benchmark avg)") for h in handles]
        ax.legend(handles=handles, fontsize=7.5, loc="best")
        ax.set_ylim(-0.02, 1.02)
    info["benchmarks"] = benches_used
    info["ks"] = ks_used
    return _finish(ax, info, "the run logged no eval/<benchmark>/pass@k (periodic evaluation off)")


def success_panel(ax, runs, colors) -> dict[str, Any]:
    import numpy as np

    info = _panel(ax, "success_vs_allocation", "per-prompt success rate vs allocation",
                  "success rate of the prompt's rollouts at that step", "rollouts allocated to the prompt")
    rng = np.random.default_rng(0)
    for run, color in zip(runs, colors):
        rates, counts = R.prompt_points(run)
        if not rates:
            continue
        rates, counts = np.asarray(rates), np.asarray(counts, dtype=float)
        shown = rng.choice(len(rates), 4000, replace=False) if len(rates) > 4000 else np.arange(len(rates))
        ax.scatter(rates[shown] + rng.uniform(-0.012, 0.012, len(shown)),
                   counts[shown] + rng.uniform(-0.18, 0.18, len(shown)),
                   s=5, color=color, alpha=max(0.06, min(0.3, 300 / len(shown))), linewidths=0)
        xs, ys = [], []
        for low, high in _SUCCESS_BINS:
            inside = (rates > low) & (rates <= high)
            if inside.any():
                xs.append(float(rates[inside].mean()))
                ys.append(float(counts[inside].mean()))
        ax.plot(xs, ys, color=color, linewidth=2.2, marker="o", markersize=5)
        info["runs"].append(run.label)
    if info["runs"]:
        ax.set_xlim(-0.04, 1.04)
        low, high = ax.get_ylim()
        ax.set_ylim(low, high + 0.15 * (high - low))  # room for the note above the points
        ax.text(0.01, 0.99, "points: prompt x step (jittered)\nline: mean per success-rate bin", fontsize=7.5,
                color="0.35", ha="left", va="top", transform=ax.transAxes)
    missing = [r.label for r in runs if r.prompts is None]
    info["without_prompts_jsonl"] = missing
    reason = ("no prompts.jsonl (per-prompt rows are logged by the trainer from this version on)"
              if missing else "prompts.jsonl has no rows")
    return _finish(ax, info, reason)


def heatmap_panel(ax, run: R.Run, lo: int, hi: int, vmax: float, fig) -> dict[str, Any]:
    import numpy as np
    from matplotlib.colors import PowerNorm

    info = _panel(ax, f"alloc_counts/{run.label}", f"rollout counts per step: {run.label}",
                  "rollouts allocated to a prompt", "step")
    per_step = R.alloc_counts(run)
    if not per_step:
        return _finish(ax, info, "the run logs no alloc_counts")
    first, last = min(per_step), max(per_step)
    grid = np.full((last - first + 1, hi - lo + 1), np.nan)
    for step, counts in per_step.items():
        row = np.bincount(np.clip(np.asarray(counts) - lo, 0, hi - lo), minlength=hi - lo + 1)
        grid[step - first] = row / max(1, len(counts))
    # Square-root colour scale: a uniform step (every prompt at n_avg) would otherwise wash out the spread.
    # Counts no prompt got (and steps not logged) stay white.
    image = ax.imshow(np.ma.masked_where(~(grid > 0), grid), aspect="auto", origin="lower", cmap="magma_r",
                      interpolation="nearest", norm=PowerNorm(0.5, vmin=0.0, vmax=vmax),
                      extent=(lo - 0.5, hi + 0.5, first - 0.5, last + 0.5))
    ax.set_xticks(range(lo, hi + 1, max(1, (hi - lo) // 10 + 1)))
    fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02).set_label("fraction of the step's prompts (sqrt scale)",
                                                                 fontsize=8)
    info["runs"].append(run.label)
    info["count_range"] = [lo, hi]
    return info


def final_panel(ax, runs, colors) -> dict[str, Any]:
    """The final numbers of the HTML table, in short, for the PNG alone (the README's picture)."""
    info = {"id": "final", "title": "final numbers", "xlabel": "", "ylabel": "",
            "runs": [r.label for r in runs], "no_data": False}
    ax.set_title(info["title"], fontsize=11)
    ax.axis("off")
    columns = [("run", "run"), ("reward", "reward (last 10%)"), ("entropy", "entropy (last 10%)"),
               ("length", "response_length (last 10%)"), ("var. ratio", "variance_ratio (mean)"),
               ("rollouts", "rollouts")]
    table = [final_numbers(run) for run in runs[:12]]
    evals = sorted({k for row in table for k in row if k.startswith("avg pass@")})[:2]
    columns += [(k.removeprefix("avg "), k) for k in evals]
    cells = [[format_value(row.get(key)) for _, key in columns] for row in table]
    label_width = max(len(c) for c in ["run"] + [row[0] for row in cells])
    widths = [max(3.0, label_width * 0.8)] + [max(5.0, len(name)) for name, _ in columns[1:]]
    height = min(0.9, 0.11 * (len(cells) + 1))
    shown = ax.table(cellText=cells, colLabels=[name for name, _ in columns], cellLoc="right",
                     colWidths=[w / sum(widths) for w in widths], bbox=[0.0, 0.92 - height, 1.0, height])
    shown.auto_set_font_size(False)
    shown.set_fontsize(9)
    for (row, col), cell in shown.get_celld().items():
        cell.set_edgecolor("0.8")
        if row == 0:
            cell.set_facecolor("0.94")
        if col == 0:
            cell.get_text().set_horizontalalignment("left")
            cell.PAD = 0.03
            if row > 0:
                cell.get_text().set_color(colors[row - 1])
                cell.get_text().set_fontweight("bold")
    ax.text(0.0, 0.88 - height, "reward, entropy, length: mean of the last 10% of the steps; var. ratio: mean "
            "over the steps;\npass@k: the last evaluation's benchmark average"
            + (f"; first 12 of {len(runs)} runs" if len(runs) > 12 else ""),
            fontsize=8, color="0.4", va="top", transform=ax.transAxes)
    return info


def final_numbers(run: R.Run) -> dict[str, Any]:
    """The table's row of one run: totals, last-10% means of the curves, the last evaluation."""
    row: dict[str, Any] = {"run": run.label, "steps": len(run.steps)}
    _, rollouts = R.series(run, "rollouts")
    row["rollouts"] = int(sum(rollouts)) if rollouts else None
    for what in ("reward", "entropy", "response_length"):
        row[f"{what} (last 10%)"] = tail_mean(R.series(run, what)[1])
    ratios = R.series(run, "variance_ratio")[1]
    row["variance_ratio (mean)"] = sum(ratios) / len(ratios) if ratios else None
    row["modulation scale (last 10%)"] = tail_mean(R.series(run, "scale_mean")[1])
    evaluations = R.eval_series(run)
    if evaluations:
        row["last eval step"] = max(steps[-1] for steps, _ in evaluations.values())
    for (bench, k), (steps, values) in sorted(evaluations.items(), key=lambda i: (i[0][0] != "avg", i[0])):
        row[f"{bench} pass@{k}"] = values[-1] if steps[-1] == row["last eval step"] else None
    return row


def format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)
