"""Datasets by name: the registry (public hub id -> local file name) and where a name is looked up on disk.

At run time the product reads local files only (no network): a path, or ``data_dir`` / ``$MEGATRON_DYNAMO_DATA_DIR``
/ ``data/`` holding the registry's file name (or the same stem with ``.parquet``). ``dynamo data prepare NAME``
(``data/hub.py``) writes that file from the hub dataset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DATA_DIR_ENV = "MEGATRON_DYNAMO_DATA_DIR"
#: The data directory when none is given and $MEGATRON_DYNAMO_DATA_DIR is unset (relative to the working directory):
#: where `dynamo data prepare` writes, `dynamo data list` looks and named datasets are found.
DEFAULT_DATA_DIR = "data"
#: File suffixes read as parquet (everything else is read as JSON lines).
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class DatasetSpec:
    """A named dataset: its public hub id and the local JSONL file name the product looks for."""

    name: str
    hub_id: str
    filename: str
    role: str
    hub_split: str = "train"
    hub_config: str | None = None


#: Public names -> hub ids and local file names. Hub schemas differ from the JSONL shape (data/rows.py), so a
#: download has to be converted once (id, problem, answer, ...) before use: ``dynamo data prepare NAME``.
DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec("dapo_math_17k", "BytedTsinghua-SIA/DAPO-Math-17k", "dapo_math_17k.jsonl", "train"),
        DatasetSpec("math_train", "DigitalLearningGmbH/MATH-lighteval", "math_train.jsonl", "train"),
        DatasetSpec("gsm8k_train", "openai/gsm8k", "gsm8k_train.jsonl", "train", "train", "main"),
        DatasetSpec("gsm8k_test", "openai/gsm8k", "gsm8k_test.jsonl", "eval", "test", "main"),
        DatasetSpec("aime24", "HuggingFaceH4/aime_2024", "aime24.jsonl", "eval"),
        DatasetSpec("aime25", "math-ai/aime25", "aime25.jsonl", "eval", "test"),
        DatasetSpec("amc23", "math-ai/amc23", "amc23.jsonl", "eval", "test"),
        DatasetSpec("math500", "HuggingFaceH4/MATH-500", "math500.jsonl", "eval", "test"),
        DatasetSpec("minerva", "math-ai/minervamath", "minerva_math.jsonl", "eval", "test"),
        DatasetSpec("olympiadbench", "math-ai/olympiadbench", "olympiadbench.jsonl", "eval", "test"),
    )
}

#: The paper's evaluation suite, in table order.
BENCHMARKS: tuple[str, ...] = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")


class DatasetNotAvailableError(FileNotFoundError):
    """A dataset was named that is not present locally (nothing is downloaded at run time)."""


def spec_for(name: str) -> DatasetSpec | None:
    """The registry entry named ``name`` (a registry name, or a hub id that names a single entry), else None."""
    if name in DATASETS:
        return DATASETS[name]
    # A hub id names its dataset too, when it names only one (openai/gsm8k holds both gsm8k splits).
    matches = [spec for spec in DATASETS.values() if spec.hub_id.lower() == name.lower()]
    if len(matches) > 1:
        raise ValueError(f"{name!r} names several datasets ({', '.join(s.name for s in matches)}); use one of "
                         f"these names")
    return matches[0] if matches else None


def default_data_dir() -> Path:
    """The one default data directory of ``data prepare``, ``data list`` and the loaders:
    ``$MEGATRON_DYNAMO_DATA_DIR``, else ``data/`` in the working directory."""
    return Path(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR)


def resolve_dataset_path(path_or_name: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> Path:
    """Local JSONL or parquet file for a file path or a dataset name.

    A path to an existing file is used as is. A name (``"aime24"``, or a hub id such as
    ``"BytedTsinghua-SIA/DAPO-Math-17k"``) is looked up in ``data_dir``, else in :func:`default_data_dir`
    (``$MEGATRON_DYNAMO_DATA_DIR``, else ``data/``, where ``dynamo data prepare`` writes), under the registry's file name (an unregistered name under ``<name>.jsonl``), else under the same stem with
    ``.parquet``. Raises :class:`DatasetNotAvailableError` naming the hub id and how to provide the data.
    """
    text = os.fspath(path_or_name)
    candidate = Path(text).expanduser()
    if candidate.is_file():
        return candidate
    spec = spec_for(text)
    looks_like_path = spec is None and (text.endswith((".jsonl", ".json", *PARQUET_SUFFIXES)) or os.sep in text
                                        or text.startswith("."))
    if looks_like_path:
        raise DatasetNotAvailableError(f"dataset file not found: {text}")

    directory = data_dir if data_dir is not None else default_data_dir()
    filename = spec.filename if spec is not None else f"{text}.jsonl"
    for name in (filename, *(Path(filename).stem + suffix for suffix in PARQUET_SUFFIXES)):
        path = Path(directory).expanduser() / name
        if path.is_file():
            return path
    where = f"{filename!r} is not in {os.fspath(directory)!r}" + ("" if data_dir is not None else (
        f" (the default data directory: ${DATA_DIR_ENV}, else {DEFAULT_DATA_DIR}/)"))
    if spec is None:
        known = ", ".join(sorted(DATASETS))
        raise DatasetNotAvailableError(
            f"unknown dataset {text!r} and no such file ({where}). Known names: {known}; "
            f"or pass the path of a JSONL file (one object per line with id, problem, answer).")
    hub = f"{spec.hub_id} (split {spec.hub_split!r}" + (f", config {spec.hub_config!r})" if spec.hub_config else ")")
    raise DatasetNotAvailableError(
        f"dataset {spec.name!r} is not available locally: {where}. It is the public hub dataset {hub}; "
        f"nothing is downloaded at run time. Run `dynamo data prepare {spec.name} --out DIR` (it fetches and "
        f"converts it; --from FILE converts a downloaded copy) to write DIR/{spec.filename} (default DIR: the "
        f"default data directory, found with no flag; another DIR: give it as data_dir or ${DATA_DIR_ENV}), or pass the path of a JSONL / parquet file (rows with id, problem, answer, "
        f"or verl's layout).")
