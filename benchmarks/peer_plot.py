"""The peer sweep's plot (``benchmarks/peer_sweep.py``), drawn from its JSON alone so that it can be redrawn
(``python benchmarks/bench_peer.py --plot-only benchmarks/results/bench_peer_sweep.json``).

Left: the step time against the response length, log-log, a line per model and side (ours solid, TRL dashed, one
colour per model). Right: ours / TRL against the length, a line per model, and a line at 1.0 (below it ours is
faster). Only measured points are drawn.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend)
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402

DEFAULT_PLOT = Path(__file__).resolve().parent.parent / "docs" / "results" / "peer_sweep.png"


def series(result: dict) -> dict[str, list[dict]]:
    """The measured points of each model, by length."""
    by_model = {m: [] for m in result["settings"]["models"]}
    for point in result["points"]:
        if point["status"] == "measured":
            by_model[point["model"]].append(point)
    return {m: sorted(points, key=lambda p: p["length"]) for m, points in by_model.items()}


def plot_sweep(result: dict, path) -> Path:
    """Draw the sweep of ``result`` (its JSON) to ``path``; returns the path."""
    fig, (times, ratios) = plt.subplots(1, 2, figsize=(12, 4.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (model, points) in enumerate(series(result).items()):
        if not points:
            continue
        colour = colours[index % len(colours)]
        lengths = [p["length"] for p in points]
        label = f"{model} ({points[0]['params'] / 1e6:.0f}M)"
        times.plot(lengths, [p["ours"]["step_s"] for p in points], "-o", color=colour, label=f"{label} ours")
        times.plot(lengths, [p["trl"]["step_s"] for p in points], "--s", color=colour, label=f"{label} TRL")
        ratios.plot(lengths, [p["ratio"] for p in points], "-o", color=colour, label=label)
    times.set(xscale="log", yscale="log", xlabel="response length, tokens", ylabel="step time, s",
              title="step time (median from step 3)")
    ratios.axhline(1.0, color="grey", linewidth=1)
    ratios.set(xscale="log", xlabel="response length, tokens", ylabel="ours / TRL", title="step time, ours / TRL")
    for axes in (times, ratios):
        axes.set_xticks(result["settings"]["lengths"])  # the swept lengths, written out
        axes.xaxis.set_major_formatter(ScalarFormatter())
        axes.xaxis.set_minor_formatter(NullFormatter())
        axes.grid(True, which="both", alpha=0.3)
        if axes.lines:
            axes.legend(fontsize=8)
    settings = result["settings"]
    fig.suptitle(f"ours vs TRL GRPOTrainer: {settings['prompts']} prompts x {settings['group']}, every response "
                 f"exactly the length ({result.get('date', '')})", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
