"""Bring your own data: fetch a public math dataset and convert it to the rows the trainer and `dynamo eval` read.

    dynamo data list [--out DIR]
    dynamo data prepare dapo_math_17k                      # BytedTsinghua-SIA/DAPO-Math-17k -> data/dapo_math_17k.jsonl
    dynamo data prepare HuggingFaceH4/MATH-500 --out /lustre/data
    dynamo data prepare gsm8k_test --from gsm8k_hub --out data     # a downloaded copy (hf download ... --local-dir)
    dynamo data prepare aime24 --from aime_2024.parquet            # one parquet / arrow / JSONL file in the hub schema

`prepare` fetches the hub dataset with the `datasets` library (its cache, HF_HOME / HF_DATASETS_CACHE and
HF_HUB_OFFLINE / HF_DATASETS_OFFLINE apply), converts each row of the hub schema (see megatron_dynamo/data/hub.py)
to id, problem, answer, answer_candidates (accepted forms), data_source, and writes <out>/<registry file name>
atomically. Without --out it writes into the default data directory ($MEGATRON_DYNAMO_DATA_DIR, else data/), which
`data list` shows and where `dynamo train data.train=NAME`, `evaluation.benchmarks`, `dynamo eval --benchmarks NAME`
and `dynamo ablate` find NAME with no further flag; another --out DIR is given to them as data.data_dir=DIR /
--data-dir DIR. Dropped rows are counted, one line per reason. Without network and cache it says in one line what to
download and where to put it, and exits 2.

The trainer and `dynamo eval` also read parquet files directly, including verl's RL parquet layout (prompt as chat
messages, reward_model.ground_truth, data_source, extra_info.index): `data.train=/path/train.parquet`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_dynamo.data.dataset import DATASETS, default_data_dir
from megatron_dynamo.data.hub import PrepareError, prepare


def add_arguments(parser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True,
                                    help="prepare NAME|HUB_ID | list")
    prepare = actions.add_parser(
        "prepare", help="fetch (or read --from) a hub dataset and write <out>/<name>.jsonl in the product's rows",
        description="Fetch a registered dataset (or any hub id) with the `datasets` library, or read a local copy "
                    "(--from), convert its hub schema to rows of id, problem, answer, answer_candidates, "
                    "data_source and write them atomically to <out>/<registry file name>.")
    prepare.add_argument("name", metavar="NAME|HUB_ID",
                         help="a registered name (dapo_math_17k, math_train, gsm8k_train, gsm8k_test, aime24, aime25, "
                              "amc23, math500, minerva, olympiadbench; `dynamo data list`), its hub id "
                              "(HuggingFaceH4/MATH-500), or another hub id owner/name (generic conversion: verl "
                              "layout, or problem/question with answer/final_answer/ground_truth/boxed solution)")
    prepare.add_argument("--out", default=None, metavar="DIR",
                         help="directory to write <registry file name> into (default $MEGATRON_DYNAMO_DATA_DIR, "
                              "else data/, where training and eval look by default); another DIR: give it to training as "
                              "data.data_dir and to `dynamo eval --data-dir`")
    prepare.add_argument("--split", default=None, metavar="S",
                         help="hub split to read (default: the registry's, e.g. train for DAPO-Math-17k, test for "
                              "MATH-500); with --from: the split inside a save_to_disk DatasetDict or a hub snapshot")
    prepare.add_argument("--config", default=None, metavar="C",
                         help="hub configuration (subset) name (default: the registry's, e.g. main for openai/gsm8k)")
    prepare.add_argument("--from", dest="from_path", default=None, metavar="FILE_OR_DIR",
                         help="convert this local copy in the hub schema instead of fetching: a .parquet, .arrow "
                              "(datasets' format), .jsonl or .json file, a save_to_disk directory, or a directory "
                              "downloaded with `hf download HUB_ID --repo-type dataset --local-dir DIR`")
    listing = actions.add_parser("list", help="the registered datasets: hub id, split, file name, present or not",
                                 description="The registered datasets and whether <out>/<file> exists.")
    listing.add_argument("--out", default=None, metavar="DIR",
                         help="directory to look in (default $MEGATRON_DYNAMO_DATA_DIR, else data/)")


def _list(args) -> int:
    out = Path(args.out) if args.out is not None else default_data_dir()
    for spec in DATASETS.values():
        where = f"{spec.hub_id} ({spec.hub_split}" + (f", {spec.hub_config})" if spec.hub_config else ")")
        state = "present" if (out / spec.filename).is_file() else "missing"
        print(f"{spec.name:14s} {spec.role:5s} {where:48s} {out / spec.filename}  [{state}]")
    return 0


def main(args) -> int:
    if args.action == "list":
        return _list(args)
    try:
        result = prepare(args.name, out_dir=args.out, split=args.split, config=args.config,
                         from_path=args.from_path)
    except PrepareError as exc:
        print(f"dynamo data prepare: {exc}", file=sys.stderr)
        return 2
    for line in result.summary_lines():
        print(line)
    return 0
