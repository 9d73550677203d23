"""Render one page of the curves of one or more training runs: a PNG and a self-contained HTML page.

    dynamo report outputs/cpu_default
    dynamo report outputs/grpo outputs/dynamo --labels GRPO DynaMO --out outputs/report
    dynamo report outputs/compare                  # a `dynamo compare` directory: every variant and seed

Panels (every one overlays the runs, one colour per run): reward, entropy and response length per step with a
moving mean; the eq. 23 predicted variance ratio of the allocation (1 = uniform); the advantage modulation
factors (beta_comp x beta_stab: mean and 10th-90th percentile band; beta_stab: mean and minimum; beta_comp: mean
over tokens with A > 0; percentiles and minimum are per micro-batch, averaged over the step by tokens as the
trainer logs every modulation statistic); evaluation pass@k (``eval/<benchmark>/pass@k``, when the run
evaluated); per-prompt success rate against the rollouts allocated (from the run's prompts.jsonl); and per run a
heat map of the rollout counts per step (``alloc_counts``: rows steps, columns counts, colour the fraction of the
step's prompts). A panel without data says "no data" and why.

Writes ``<out>/report.png``, ``<out>/report.html`` (the PNG inlined, a table of final numbers, no external
assets) and ``<out>/report.json`` (the runs, the panels with their titles/axes/runs, the final numbers).
A RUN_DIR that is neither a run (no metrics.jsonl) nor a compare directory exits 2 with a one-line error.
"""

from __future__ import annotations

import os
import sys

from megatron_dynamo.report.page import write_report
from megatron_dynamo.report.runs import ReportInputError, expand_inputs


def add_arguments(parser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a training run's output directory (trainer.output_dir: metrics.jsonl, and "
                             "prompts.jsonl if logged), or a `dynamo compare` output directory, which expands "
                             "into its runs (<variant>/seed<S>); several are overlaid on one page")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="directory for report.png, report.html and report.json (default: RUN_DIR/report "
                             "for one RUN_DIR, outputs/report for several)")
    parser.add_argument("--labels", nargs="+", metavar="LABEL", default=None,
                        help="legend names of the runs after expansion, in order (one per run; a single "
                             "comma-separated value also works); default: the directory name, or "
                             "'<variant> seed <S>' for runs of a compare directory. Put it after the RUN_DIRs "
                             "(it takes every word up to the next option)")
    parser.add_argument("--window", type=int, default=None, metavar="N",
                        help="steps in the trailing moving mean of the reward/entropy/length curves; 1: the "
                             "per-step values alone (default: a tenth of the longest run, at least 3 and at most "
                             "a quarter of it)")
    parser.add_argument("--title", default=None, help="page title (default: 'DynaMO run report: <labels>')")
    parser.add_argument("--dpi", type=int, default=90,
                        help="resolution of the PNG (default 90: a 1670-pixel-wide page)")


def main(args) -> int:
    labels = args.labels
    if labels and len(labels) == 1 and "," in labels[0]:
        labels = [label.strip() for label in labels[0].split(",")]
    try:
        if args.window is not None and args.window < 1:
            raise ReportInputError(f"--window must be >= 1, got {args.window}")
        if args.dpi < 20:
            raise ReportInputError(f"--dpi must be >= 20, got {args.dpi}")
        runs = expand_inputs(args.run_dirs, labels)
    except ReportInputError as exc:
        print(f"dynamo report: {exc}", file=sys.stderr)
        return 2
    out = args.out or (os.path.join(args.run_dirs[0], "report") if len(args.run_dirs) == 1
                       else os.path.join("outputs", "report"))
    for run_ in runs:
        for warning in run_.warnings:
            print(f"dynamo report: warning: {warning}", file=sys.stderr)
    try:
        manifest = write_report(runs, out, window=args.window, title=args.title, dpi=args.dpi)
    except OSError as exc:
        print(f"dynamo report: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    empty = [p["title"] for p in manifest["panels"] if p["no_data"]]
    print(f"{len(runs)} run(s): " + ", ".join(f"{r['label']} ({r['steps']} steps)" for r in manifest["runs"]))
    if empty:
        print("no data: " + "; ".join(empty))
    print(f"wrote {manifest['files']['png']}, {manifest['files']['html']} and {manifest['files']['json']}")
    return 0
