"""The one-page report of ``dynamo report``: a matplotlib figure of the curves a DynaMO user looks at, saved as a
PNG and as a self-contained HTML page (the PNG inlined as base64, a table of final numbers), plus a manifest
``report.json`` (the runs, the panels and what each shows, the final numbers).

Panels (each overlays the runs, one colour per run, named in the legend at the top):

    reward            reward_mean per step (thin) and its trailing moving mean (thick)
    entropy           entropy_mean per step and moving mean
    response_length   response_length_mean per step and moving mean
    variance_ratio    eq. 23's predicted variance ratio of the step's allocation over a uniform one (1 = uniform)
    modulation        the per-token factor beta_comp * beta_stab: mean, 10th-90th percentile band; beta_stab
                      mean and minimum; beta_comp mean over tokens with A > 0
    eval              pass@k of the periodic evaluation (the benchmark average when logged, else each benchmark)
    success_vs_allocation
                      per prompt and step (prompts.jsonl): the success rate of its rollouts against the rollouts
                      allocated to it, points and the mean count per success-rate bin
    alloc_counts/<run>
                      one heat map per run: rows are steps, columns rollout counts, colour the fraction of the
                      step's prompts that got that count (how DRA moves rollouts)
    final             (in the last row's free cells, if any) the final numbers of the HTML table, in short

A panel without data for any run shows "no data" and why.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from typing import Any, Sequence

from megatron_dynamo.report import runs as R
from megatron_dynamo.report.panels import (
    COLUMNS,
    default_window,
    eval_panel,
    final_numbers,
    final_panel,
    format_value,
    heatmap_panel,
    modulation_panel,
    run_colors,
    smoothed_panel,
    success_panel,
    variance_ratio_panel,
)

def build_figure(runs: Sequence[R.Run], window: int | None = None, title: str | None = None):
    """The report figure and the manifest of its panels (``[{"id", "title", "xlabel", "ylabel", "runs",
    "no_data", ...}]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    window = window or default_window(runs)
    colors = run_colors(len(runs))
    heat_rows = -(-max(0, len(runs) - (COLUMNS - 1)) // COLUMNS)  # heat maps after the success panel's row
    rows = 3 + heat_rows
    fig = plt.figure(figsize=(6.2 * COLUMNS, 4.3 * rows + 0.9))
    grid = fig.add_gridspec(rows, COLUMNS, hspace=0.42, wspace=0.24, top=1 - 0.9 / (4.3 * rows + 0.9) - 0.02,
                            bottom=0.045, left=0.045, right=0.965)
    axes = [fig.add_subplot(grid[i // COLUMNS, i % COLUMNS]) for i in range(2 * COLUMNS)]
    panels = [
        smoothed_panel(axes[0], runs, colors, "reward", "reward per step", "mean reward", window),
        smoothed_panel(axes[1], runs, colors, "entropy", "entropy per step", "mean token entropy (nats)", window),
        smoothed_panel(axes[2], runs, colors, "response_length", "response length per step",
                        "mean response length (tokens)", window),
        variance_ratio_panel(axes[3], runs, colors),
        modulation_panel(axes[4], runs, colors),
        eval_panel(axes[5], runs, colors),
        success_panel(fig.add_subplot(grid[2, 0]), runs, colors),
    ]
    all_counts = [c for run in runs for counts in R.alloc_counts(run).values() for c in counts]
    lo, hi = (min(all_counts), max(all_counts)) if all_counts else (0, 1)
    vmax = 0.0
    for run in runs:
        for counts in R.alloc_counts(run).values():
            vmax = max(vmax, max(counts.count(c) for c in set(counts)) / len(counts))
    for i, run in enumerate(runs):
        cell = i + 1
        ax = fig.add_subplot(grid[2 + cell // COLUMNS, cell % COLUMNS])
        panels.append(heatmap_panel(ax, run, lo, hi, vmax or 1.0, fig))
    if (len(runs) + 1) % COLUMNS:  # free cells left in the last row: the final numbers
        cell = len(runs) + 1
        panels.append(final_panel(fig.add_subplot(grid[2 + cell // COLUMNS, cell % COLUMNS:]), runs, colors))
    handles = [Line2D([], [], color=c, linewidth=2.5, label=run.label) for run, c in zip(runs, colors)]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(runs), 6), fontsize=10, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.45 / (4.3 * rows + 0.9)))
    fig.suptitle(title or "DynaMO run report", fontsize=14, y=1 - 0.08 / (4.3 * rows + 0.9), va="top")
    return fig, panels, window


def render_html(title: str, png: bytes, runs: Sequence[R.Run], table: list[dict[str, Any]],
                panels: list[dict[str, Any]], window: int) -> str:
    columns: list[str] = []
    for row in table:
        columns.extend(k for k in row if k not in columns)
    esc = html.escape
    head = "".join(f"<th>{esc(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{esc(format_value(row.get(c)))}</td>" for c in columns) + "</tr>"
                   for row in table)
    sources = "".join(f"<li><b>{esc(r.label)}</b>: <code>{esc(os.path.abspath(r.path))}</code>"
                      f"{'' if r.prompts is not None else ' (no prompts.jsonl)'}</li>" for r in runs)
    empty = [p["title"] for p in panels if p["no_data"]]
    note = f"<p>Panels without data: {esc(', '.join(empty))}.</p>" if empty else ""
    image = base64.b64encode(png).decode("ascii")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
img {{ max-width: 100%; height: auto; border: 1px solid #ddd; }}
.table {{ overflow-x: auto; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; white-space: nowrap; }}
th:first-child, td:first-child {{ text-align: left; }}
th {{ background: #f2f2f2; }}
</style></head>
<body>
<h1>{esc(title)}</h1>
<h2>Final numbers</h2>
<div class="table"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>
<p>Last 10%: mean over the last tenth of the steps; moving means over {window} steps in the plots.</p>
<img alt="{esc(title)}" src="data:image/png;base64,{image}">
{note}
<h2>Runs</h2>
<ul>{sources}</ul>
</body></html>
"""


def write_report(runs: Sequence[R.Run], out_dir: str, window: int | None = None, title: str | None = None,
                 dpi: int = 90) -> dict[str, Any]:
    """Render the page of ``runs`` into ``out_dir`` (report.png, report.html, report.json); return the manifest."""
    import matplotlib.pyplot as plt

    title = title or ("DynaMO run report: " + ", ".join(r.label for r in runs[:4])
                      + (f" and {len(runs) - 4} more" if len(runs) > 4 else ""))
    fig, panels, window = build_figure(runs, window, title)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    png = buffer.getvalue()
    table = [final_numbers(run) for run in runs]
    os.makedirs(out_dir, exist_ok=True)
    files = {name: os.path.join(out_dir, f"report.{name}") for name in ("png", "html", "json")}
    with open(files["png"], "wb") as f:
        f.write(png)
    with open(files["html"], "w", encoding="utf-8") as f:
        f.write(render_html(title, png, runs, table, panels, window))
    manifest = {
        "title": title, "window": window, "files": files,
        "runs": [{"label": r.label, "path": r.path, "source": r.source, "steps": len(r.steps),
                  "prompts_jsonl": r.prompts is not None, "warnings": r.warnings} for r in runs],
        "panels": panels, "final": table,
    }
    with open(files["json"], "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    return manifest
