"""Hub datasets -> local JSONL files: fetch or read the rows, convert them, write the file (``dynamo data prepare``).

``prepare(NAME)`` fetches a registered dataset (``DATASETS`` in ``data/registry.py``) with the ``datasets``
library (``datasets.load_dataset(hub_id, config, split=...)``: the datasets cache, ``HF_HOME`` /
``HF_DATASETS_CACHE`` and ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` apply as usual), or reads a local copy in
the hub schema (``from_path``: a parquet / arrow / JSONL file, a ``save_to_disk`` directory or a downloaded hub
snapshot), converts every row and writes ``<out>/<registry filename>`` atomically: the file the trainer
(``data.train=NAME``) and ``dynamo eval --benchmarks NAME`` look up by name.

Converting the rows (the written fields, what is dropped, every hub schema read) is ``data/converters.py``.

An unregistered hub id (``owner/name``) goes through a generic converter (verl layout, or ``problem`` /
``question`` with ``answer`` / ``final_answer`` / ``ground_truth`` / a boxed ``solution``) to
``<out>/<name>.jsonl``; pass that path to the trainer. Nothing here imports from ``trainer/`` or ``eval/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

from megatron_dynamo.data.converters import CONVERTERS, GENERIC, PrepareError, PrepareResult, convert_rows
from megatron_dynamo.data.registry import DATASETS, DatasetSpec, default_data_dir, spec_for


class HubUnavailableError(PrepareError):
    """The hub dataset is neither reachable nor in the datasets cache."""


# ------------------------------------------------------------------------------------------------- reading rows

def _describe(hub_id: str, split: str, config: str | None) -> str:
    return f"{hub_id} (split {split!r}" + (f", config {config!r})" if config else ")")


def _slug(hub_id: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", hub_id.split("/")[-1].lower()).strip("_") or "dataset"


def resolve_spec(name_or_hub_id: str) -> tuple[DatasetSpec, bool]:
    """The registry entry for a name or hub id, or (for an unregistered ``owner/name`` hub id) an ad-hoc spec
    written to ``<name>.jsonl``; the flag says whether it is registered."""
    try:
        spec = spec_for(name_or_hub_id)
    except ValueError as exc:  # openai/gsm8k names two datasets
        raise PrepareError(str(exc)) from None
    if spec is not None:
        return spec, True
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name_or_hub_id):
        slug = _slug(name_or_hub_id)
        return DatasetSpec(slug, name_or_hub_id, f"{slug}.jsonl", "custom"), False
    raise PrepareError(f"unknown dataset {name_or_hub_id!r}: known names are {', '.join(sorted(DATASETS))}, or give "
                       f"a hub id owner/name")


def _datasets():
    try:
        import datasets
    except ImportError:
        raise PrepareError("the `datasets` package is not installed: pip install datasets pyarrow") from None
    return datasets


def _offline_message(spec: DatasetSpec, split: str, config: str | None, out_dir: Path, reason: str) -> str:
    datasets = _datasets()
    local = f"{spec.name}_hub"
    config_flag = f" --config {config}" if config else ""
    return (f"cannot fetch the hub dataset {_describe(spec.hub_id, split, config)}: {reason}; not in the datasets "
            f"cache ({datasets.config.HF_DATASETS_CACHE}). Download it where there is network, "
            f"`hf download {spec.hub_id} --repo-type dataset --local-dir {local}`, copy {local}/ here and run "
            f"`dynamo data prepare {spec.name} --from {local} --split {split}{config_flag} --out {out_dir}` "
            f"(or run `dynamo data prepare {spec.name}` there and copy {spec.filename} into {out_dir}/)")


HUB_PROBE_SECONDS = 3.0


def hub_unreachable(timeout: float = HUB_PROBE_SECONDS) -> str | None:
    """None when the hub's endpoint (``HF_ENDPOINT``, through the environment's proxies) answers an HTTP request
    within ``timeout`` seconds (any status), else why not, in a few words: one probe instead of the hub client's
    retry loop (5 retries, 25 s, 10 lines of log without network)."""
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{constants.ENDPOINT} cannot be reached ({reason})"
    return None


@contextlib.contextmanager
def _offline_mode():
    """The hub client and ``datasets`` in offline mode (cache only, no retries) for the duration."""
    import datasets
    from huggingface_hub import constants

    saved = (constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE)
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved


def fetch_hub_rows(spec: DatasetSpec, split: str, config: str | None, out_dir: Path):
    """The split of the hub dataset through ``datasets.load_dataset`` (cache first; offline settings honoured).
    Unless offline mode is set already, one quick probe of the hub (:func:`hub_unreachable`) decides: unreachable,
    the cache alone is read (offline mode), so no retry loop runs. Raises :class:`HubUnavailableError` (one line:
    what to download and where) when it cannot be had."""
    datasets = _datasets()
    unreachable = None if datasets.config.HF_HUB_OFFLINE else hub_unreachable()
    try:
        with _offline_mode() if unreachable else contextlib.nullcontext():
            dataset = datasets.load_dataset(spec.hub_id, config, split=split)
    except Exception as exc:  # datasets raises ConnectionError, FileNotFoundError, hub errors, ValueError...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        network = unreachable is not None or isinstance(exc, (ConnectionError, TimeoutError)) or any(
            word in f"{type(exc).__name__} {first}".lower()
            for word in ("offline", "connect", "reach", "resolve", "network", "timeout", "localentrynotfound"))
        if network:
            raise HubUnavailableError(_offline_message(spec, split, config, out_dir, unreachable or first)) from None
        raise PrepareError(f"could not load {_describe(spec.hub_id, split, config)}: {first}") from None
    return _dataset_rows(dataset)


def _json_rows(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        head = handle.read(1024).lstrip()
        handle.seek(0)
        if head.startswith("["):  # a JSON array of records
            yield from json.load(handle)
            return
        for number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PrepareError(f"{path}:{number}: invalid JSON ({exc.msg})") from None


def _arrow_table(path: Path):
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).read_all()  # datasets' save_to_disk / cache files
    except pa.ArrowInvalid:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all()


def _table_rows(table) -> Iterator[dict[str, Any]]:
    for batch in table.to_batches(max_chunksize=4096):
        yield from batch.to_pylist()


def _dataset_rows(dataset) -> Iterator[dict[str, Any]]:
    """Rows of a ``datasets.Dataset``, read in batches (much faster than row by row for 1.8M rows)."""
    for batch in dataset.iter(batch_size=4096):
        columns = list(batch)
        yield from (dict(zip(columns, values)) for values in zip(*(batch[c] for c in columns)))


def read_local_rows(path: Path, split: str, config: str | None) -> tuple[Iterable[dict[str, Any]], str]:
    """Rows of a local copy in the hub schema, and a description of it. ``split`` / ``config`` choose inside a
    ``save_to_disk`` DatasetDict or a downloaded hub snapshot; a single file is one split."""
    if not path.exists():
        raise PrepareError(f"--from {path}: no such file or directory")
    if path.is_dir():
        datasets = _datasets()
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise PrepareError(f"--from {path} holds the splits {', '.join(loaded)}, not {split!r} (--split)")
                return _dataset_rows(loaded[split]), f"{path} (save_to_disk, split {split!r})"
            return _dataset_rows(loaded), f"{path} (save_to_disk)"
        try:  # a downloaded hub snapshot (hf download --local-dir): its README's configs and data files
            return _dataset_rows(datasets.load_dataset(str(path), config, split=split)), f"{path} (split {split!r})"
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise PrepareError(f"--from {path}: cannot read it as a dataset directory: {first}") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return _table_rows(pq.read_table(path)), str(path)
        if suffix == ".arrow":
            return _table_rows(_arrow_table(path)), str(path)
    except PrepareError:
        raise
    except Exception as exc:  # pyarrow's errors for a damaged or foreign file
        raise PrepareError(f"--from {path}: not a readable {suffix[1:]} file ({exc})") from None
    if suffix in (".jsonl", ".json"):
        return _json_rows(path), str(path)
    raise PrepareError(f"--from {path}: expected a .parquet, .arrow, .jsonl or .json file, or a directory")


# -------------------------------------------------------------------------------------------------- the command

def write_jsonl_atomic(rows: Iterable[dict[str, Any]], path: Path) -> None:
    """Write rows as JSON lines to a temporary file beside ``path``, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def prepare(name_or_hub_id: str, out_dir: str | os.PathLike | None = None, split: str | None = None,
            config: str | None = None, from_path: str | os.PathLike | None = None) -> PrepareResult:
    """Fetch (or read ``from_path``), convert and write ``<out_dir>/<registry filename>``; see the module doc.

    Raises :class:`HubUnavailableError` when the hub cannot be reached and nothing is cached,
    :class:`PrepareError` for anything else that stops it (wrong schema, unreadable file, no row left).
    """
    spec, registered = resolve_spec(name_or_hub_id)
    split = split or spec.hub_split
    config = config if config is not None else spec.hub_config
    out = Path(out_dir) if out_dir is not None else default_data_dir()
    if from_path is not None:
        rows, source = read_local_rows(Path(from_path), split, config)
        source = f"{source} in {spec.hub_id}'s schema"
    else:
        rows, source = fetch_hub_rows(spec, split, config, out), _describe(spec.hub_id, split, config)
    result = convert_rows(spec.name, rows, CONVERTERS.get(spec.name, GENERIC) if registered else GENERIC)
    result.source = source
    result.path = out / spec.filename
    if not result.rows:
        reasons = "; ".join(f"{n} {reason}" for reason, n in result.drop_counts().items()) or "the split is empty"
        raise PrepareError(f"no rows left to write from {source} ({result.rows_read} read: {reasons})")
    write_jsonl_atomic(result.rows, result.path)
    return result
