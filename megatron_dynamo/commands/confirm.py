"""The preregistered analyses of the testbed's two studies (the replication of issue 32, the second study of issue
55): the tables of docs/results/testbed.md (the testbed's results page) from the committed raw data, and nothing
else.

    dynamo confirm benchmarks/results/confirmatory                                  # print the tables
    dynamo confirm benchmarks/results/confirmatory --write docs/results/testbed.md  # put them in the page
    dynamo confirm benchmarks/results/confirmatory --check docs/results/testbed.md  # exit 1 if the page differs

DIR holds runs.csv (``dynamo ablate ... --raw-data DIR`` writes it). A seed whose runs span two machines or two
warm-ups is refused (one line, exit 2): its runs are paired, and another CPU gives other numbers. Until every
preregistered run is in, the block says how many are, per seed and machine, and holds no table. The analysis is
fixed by the study's preregistration (docs/ablation.md; ``megatron_dynamo/experiments/confirmatory.py``, one Study
each, found by DIR or by the seeds in runs.csv, or named by --study): per hypothesis the per-seed contrast of held-out
pass@1 over the preregistered seeds, its two-sided paired Student t interval and p-value, Holm's adjustment over the
study's tests, the verdict by the preregistered rule, the answers to the controls' questions (the replication), and
the power lines: each test's realised standard error against the planned one, the smallest effect it could detect
with power 0.8, and its power against the planned effects. In the page the tables sit between ``<!-- confirm:DIR -->`` and ``<!-- /confirm -->``; the test suite fails when that
block differs from what this command prints.
"""

from __future__ import annotations

import os
import sys


def add_arguments(parser) -> None:
    parser.add_argument("directory", help="directory with runs.csv (dynamo ablate --raw-data DIR)")
    parser.add_argument("--study", default=None,
                        help="the preregistered study whose analysis to run: replication or second (default: the one "
                             "whose raw data is DIR, else the one whose seeds runs.csv holds)")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", metavar="PAGE", default=None,
                        help="replace the tables' block in this Markdown file (appended when it has none)")
    action.add_argument("--check", metavar="PAGE", default=None,
                        help="exit 1 when this Markdown file's block differs from the tables (or is missing)")


def main(args) -> int:
    # lazy: the preregistered statistics (mpmath's Student t) add ~40 ms to every `dynamo --help`
    from megatron_dynamo.experiments import confirmatory, confirmatory_tables, raw_data

    source = os.path.normpath(args.directory)
    path = os.path.join(source, raw_data.RUNS_FILE)
    studies = confirmatory.STUDIES
    try:
        registered = [s for s in studies.values() if s.raw_data == source]
        # a preregistered study before its first raw data: its progress, none in
        rows = [] if registered and not os.path.exists(path) else raw_data.read_paired_runs(path)
        if args.study is not None and args.study not in studies:
            raise ValueError(f"--study must be one of {', '.join(studies)}, got {args.study!r}")
        study = studies[args.study] if args.study else confirmatory.study_of(rows, source)
    except (OSError, ValueError) as exc:
        print(f"dynamo confirm: {path}: {exc}", file=sys.stderr)
        return 2
    tables = confirmatory_tables.format_tables(rows, source, study)
    target = args.write or args.check
    if target is None:
        print(tables)
        return 0
    try:
        with open(target, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        print(f"dynamo confirm: {target}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if confirmatory_tables.committed_blocks(text).get(source) != tables:
            print(f"dynamo confirm: {target}'s tables of {source} differ from the command's (or are missing): "
                  f"run dynamo confirm {source} --write {target}", file=sys.stderr)
            return 1
        print(f"{target}: the tables of {source} are up to date")
        return 0
    with open(target, "w", encoding="utf-8") as f:
        f.write(confirmatory_tables.replace_block(text, source, tables))
    print(f"wrote the tables of {source} into {target}")
    return 0
