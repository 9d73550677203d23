"""Math prompt data: JSONL / parquet loading with row validation, a name registry, and a resumable seeded sampler.

File format (the files in ``shared/data/math/`` and any file of the same shape): one JSON object per line with
``id`` (string or integer), ``problem`` (non-empty string), ``answer`` (non-empty string; a JSON number is
accepted and converted), optional ``data_source`` (string), optional ``answer_candidates`` (list of strings:
other accepted forms of the answer, e.g. Minerva's); every other field is kept in ``extras``.

Parquet files (``.parquet``) are read too, one row per record, in that flat shape or in verl's RL layout
(``prompt``: list of chat messages, ``reward_model.ground_truth``, ``data_source``, ``extra_info.index``), which
JSONL rows may also use; see :func:`from_verl_row` for what is kept. Both formats share one entry point,
:func:`load_math_file` (also reachable as :func:`load_math_jsonl`), and the same malformed-row reporting (for
parquet the "line" is the 1-based row number).

Decisions:

- Ids: ``"<source>:<row id>"``, where source is the file's stem (``dapo_math_17k``) unless ``source_name`` is
  given. Always prefixed, so ids from different files never collide (DAPO-Math-17k and MATH train both number
  their rows 0, 1, ...) and an id does not depend on which other files a run loads. A row without an id gets
  ``"<source>:line<N>"``.
- Malformed rows (bad JSON or UTF-8, not an object, missing/empty/wrongly typed problem or answer, bad id or
  candidates) are skipped, each logged as ``path:line: reason`` and kept in ``MathDataset.skipped``.
- Duplicate ids are an error by default (two prompts sharing an id would share the DRA history); with
  ``on_duplicate_id="suffix"`` the later row becomes ``<id>#line<N>`` (stable for a given file).
- Datasets are named by their public hub id; at run time the product reads local files only (no network):
  a path, or ``data_dir`` / ``$MEGATRON_DYNAMO_DATA_DIR`` / ``data/`` holding the registry's file name (or the same stem
  with ``.parquet``). ``dynamo data prepare NAME`` (``data/hub.py``) writes that file from the hub dataset.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence

import numpy as np

logger = logging.getLogger(__name__)

DATA_DIR_ENV = "MEGATRON_DYNAMO_DATA_DIR"
#: The data directory when none is given and $MEGATRON_DYNAMO_DATA_DIR is unset (relative to the working directory):
#: where `dynamo data prepare` writes, `dynamo data list` looks and named datasets are found.
DEFAULT_DATA_DIR = "data"
_MAX_LOGGED_SKIPS = 20
_KNOWN_FIELDS = ("id", "problem", "answer", "answer_candidates", "data_source")
#: File suffixes read as parquet (everything else is read as JSON lines).
PARQUET_SUFFIXES = (".parquet",)
_VERL_FIELDS = ("prompt", "reward_model", "data_source", "extra_info")


@dataclass(frozen=True)
class MathExample:
    """One prompt: a problem and its reference answer (plus optional accepted alternative forms)."""

    id: str
    problem: str
    answer: str
    answer_candidates: tuple[str, ...] = ()
    data_source: str = ""
    extras: dict[str, Any] = field(default_factory=dict, compare=False)

    def references(self, include_candidates: bool = True) -> list[str]:
        """Accepted answers for the reward: the answer, then the candidates not equal to it.

        Caution with the shared Minerva file: in 27 of its 272 rows a candidate is the final answer of the
        previous subproblem, which is printed in the problem text itself (e.g. answer ``0.53``, candidates
        ``4.4e7``); accepting candidates there rewards copying the prompt. ``include_candidates=False`` scores
        against ``answer`` alone.
        """
        forms = [self.answer]
        if include_candidates:
            forms += [c for c in self.answer_candidates if c not in forms]
        return forms


@dataclass(frozen=True)
class DatasetSpec:
    """A named dataset: its public hub id and the local JSONL file name the product looks for."""

    name: str
    hub_id: str
    filename: str
    role: str
    hub_split: str = "train"
    hub_config: str | None = None


#: Public names -> hub ids and local file names. Hub schemas differ from the JSONL shape above, so a download
#: has to be converted once (id, problem, answer, ...) before use: ``dynamo data prepare NAME`` (data/hub.py).
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


@dataclass(frozen=True)
class SkippedRow:
    """A row that was not loaded, with where it is and why."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class MathDataset(Sequence[MathExample]):
    """The examples of one file, in file order, plus the rows that were skipped."""

    name: str
    path: str
    examples: list[MathExample]
    skipped: list[SkippedRow] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index):  # type: ignore[override]
        return self.examples[index]

    def __iter__(self) -> Iterator[MathExample]:
        return iter(self.examples)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)


@dataclass(frozen=True)
class GeneratedTask:
    """A task generated with a seed instead of read from a file (the CPU tasks). ``data.train: <name>`` trains on
    ``make(data.synthetic_problems, data.seed)``; with ``test``, the dataset name ``test_name`` (default
    ``<name>_test``) is its fixed evaluation split (for ``evaluation.benchmarks`` and ``dynamo eval --benchmarks``;
    no file)."""

    name: str
    make: Callable[[int, int], list[MathExample]]
    test: Callable[[], list[MathExample]] | None = None
    test_name: str | None = None
    #: ``data.sft_problems`` warm-up problems ``(num_problems, seed)``; None: ``make`` (the testbed's covers only
    #: some of its levels).
    sft: Callable[[int, int], list[MathExample]] | None = None

    @property
    def benchmark_name(self) -> str:
        return self.test_name or f"{self.name}{TEST_SPLIT_SUFFIX}"


#: name -> task; filled by the modules that define them (``data/synthetic.py``, ``data/reasoning.py``).
GENERATED_TASKS: dict[str, GeneratedTask] = {}
TEST_SPLIT_SUFFIX = "_test"


def register_generated_task(task: GeneratedTask) -> None:
    GENERATED_TASKS[task.name] = task


def generated_test_split(name: str) -> GeneratedTask | None:
    """The task whose evaluation split ``name`` is (``reasoning_test``, ``synthetic_eval``), else None."""
    return next((task for task in GENERATED_TASKS.values() if task.test is not None and task.benchmark_name == name),
                None)


def _spec_for(name: str) -> DatasetSpec | None:
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
    spec = _spec_for(text)
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


def is_verl_row(row: Any) -> bool:
    """A row in verl's RL layout (``prompt`` + ``reward_model``) rather than the flat one (``problem``)."""
    return isinstance(row, dict) and "problem" not in row and "prompt" in row and "reward_model" in row


def verl_user_text(prompt: Any) -> str | None:
    """The text of a verl ``prompt``: the content of its last ``user`` message (a plain string is itself)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("role"), list) and isinstance(prompt.get("content"), list):
        # datasets' Sequence-of-struct columns come as a dict of lists
        prompt = [{"role": r, "content": c} for r, c in zip(prompt["role"], prompt["content"])]
    if isinstance(prompt, (list, tuple)):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1].get("content"), str):
            return users[-1]["content"]
    return None


def _plain_id(value: Any) -> Any:
    """An id as JSON gives it: integral floats (pandas' int columns with nulls) become ints."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def from_verl_row(row: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """A verl RL row in the flat shape: ``(fields, "")`` or ``(None, why it cannot be read)``.

    Kept: the problem is the content of the *last user message* of ``prompt``, whole: an instruction the
    dataset put around the problem (DAPO-Math-17k's "Solve the following math problem step by step. ...
    Remember to put your answer on its own line after "Answer:".") stays in the text, system messages and
    earlier turns are dropped, and the run's prompt template (``data.template``) then wraps that text like any
    problem, its own instruction included (``dynamo data prepare dapo_math_17k`` strips DAPO's wrapper instead).
    The answer is
    ``reward_model.ground_truth`` (a list: the first entry, the others become ``answer_candidates``), the id
    ``extra_info.index`` when present (else the row number), ``data_source`` as is; ``ability`` and the rest of
    ``extra_info`` go to ``extras``.
    """
    problem = verl_user_text(row.get("prompt"))
    if problem is None:
        return None, "'prompt' has no user message with text content"
    reward = row.get("reward_model")
    truth = reward.get("ground_truth") if isinstance(reward, dict) else None
    candidates: list[Any] = []
    if isinstance(truth, (list, tuple)):
        forms = [t for t in truth if t is not None]
        truth, candidates = (forms[0], forms[1:]) if forms else (None, [])
    if truth is None:
        return None, "missing 'reward_model.ground_truth'"
    extra_info = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    fields: dict[str, Any] = {
        "id": _plain_id(extra_info.get("index")),
        "problem": problem,
        "answer": truth,
        "answer_candidates": [str(c) if isinstance(c, (int, float)) else c for c in candidates],
        "data_source": row.get("data_source") or "",
    }
    fields.update({k: v for k, v in row.items() if k not in _VERL_FIELDS and k not in fields})
    rest = {k: v for k, v in extra_info.items() if k != "index"}
    if rest:
        fields["extra_info"] = rest
    return fields, ""


def _validate_row(row: Any) -> tuple[dict[str, Any] | None, str]:
    """Return ``(cleaned fields, "")`` or ``(None, why the row is malformed)``; verl rows are read as such."""
    if not isinstance(row, dict):
        return None, f"expected a JSON object, got {type(row).__name__}"
    if is_verl_row(row):
        row, why = from_verl_row(row)
        if row is None:
            return None, why
    problem = row.get("problem")
    if not isinstance(problem, str):
        return None, "missing 'problem'" if problem is None else f"'problem' is {type(problem).__name__}, not a string"
    if not problem.strip():
        return None, "empty 'problem'"
    answer = row.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)  # a JSON number answer is unambiguous
    if not isinstance(answer, str):
        return None, "missing 'answer'" if answer is None else f"'answer' is {type(answer).__name__}, not a string"
    if not answer.strip():
        return None, "empty 'answer'"
    row_id = row.get("id")
    if row_id is not None and (isinstance(row_id, bool) or not isinstance(row_id, (str, int))):
        return None, f"'id' is {type(row_id).__name__}, not a string or integer"
    if isinstance(row_id, str) and not row_id.strip():
        return None, "empty 'id'"
    candidates = row.get("answer_candidates", [])
    if candidates is None:
        candidates = []
    if not isinstance(candidates, list) or not all(isinstance(c, str) for c in candidates):
        return None, "'answer_candidates' is not a list of strings"
    data_source = row.get("data_source", "")
    if data_source is not None and not isinstance(data_source, str):
        return None, f"'data_source' is {type(data_source).__name__}, not a string"
    return {
        "id": row_id,
        "problem": problem,
        "answer": answer.strip(),
        "answer_candidates": tuple(c.strip() for c in candidates if c.strip()),
        "data_source": data_source or "",
        "extras": {k: v for k, v in row.items() if k not in _KNOWN_FIELDS},
    }, ""


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any, str]]:
    """``(line number, parsed row, "")`` or ``(line number, None, why it cannot be parsed)``; blank lines skipped."""
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield line_number, None, f"invalid UTF-8 ({exc.reason})"
                continue
            if not text.strip():
                continue  # blank lines (e.g. a trailing newline) are not rows
            try:
                yield line_number, json.loads(text), ""
            except json.JSONDecodeError as exc:
                yield line_number, None, f"invalid JSON ({exc.msg} at column {exc.colno})"


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any, str]]:
    """``(row number from 1, row as a dict, "")`` for every row of a parquet file, read in batches."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
        raise ValueError(f"{path}: not a readable parquet file ({exc})") from None
    number = 0
    for batch in parquet.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            number += 1
            yield number, row, ""


def load_math_file(path_or_name: str | os.PathLike, data_dir: str | os.PathLike | None = None, *,
                   source_name: str | None = None,
                   on_duplicate_id: Literal["error", "suffix"] = "error") -> MathDataset:
    """Load a math JSONL or parquet file (a path or a registered name, see :func:`resolve_dataset_path`).

    The suffix decides the format (``.parquet``: parquet, anything else: JSON lines); rows are in the flat
    shape or verl's layout (:func:`from_verl_row`). Malformed rows are skipped and reported (log line
    ``path:line: reason``, ``MathDataset.skipped``; parquet: the row number). Raises
    :class:`DatasetNotAvailableError` when the data is not local, ``ValueError`` on a duplicate id (unless
    ``on_duplicate_id="suffix"``), an unreadable parquet file, or when no valid row is left.
    """
    if on_duplicate_id not in ("error", "suffix"):
        raise ValueError(f"on_duplicate_id must be 'error' or 'suffix', got {on_duplicate_id!r}")
    text = os.fspath(path_or_name)
    generated = generated_test_split(text) if not Path(text).expanduser().is_file() else None
    if generated is not None:
        return MathDataset(name=source_name or text, path=f"generated:{text}", examples=generated.test())
    path = resolve_dataset_path(path_or_name, data_dir)
    source = source_name or path.stem
    parquet = path.suffix.lower() in PARQUET_SUFFIXES
    unnamed = "row" if parquet else "line"  # a row without an id: "<source>:row<N>" / "<source>:line<N>"
    examples: list[MathExample] = []
    skipped: list[SkippedRow] = []
    first_line_of_id: dict[str, int] = {}

    def skip(line_number: int, reason: str) -> None:
        skipped.append(SkippedRow(str(path), line_number, reason))
        if len(skipped) <= _MAX_LOGGED_SKIPS:
            logger.warning("%s:%d: skipped malformed row: %s", path, line_number, reason)

    for line_number, row, error in (_parquet_rows(path) if parquet else _jsonl_rows(path)):
        if error:
            skip(line_number, error)
            continue
        fields, why = _validate_row(row)
        if fields is None:
            skip(line_number, why)
            continue
        row_id = fields.pop("id")
        example_id = f"{source}:{row_id}" if row_id is not None else f"{source}:{unnamed}{line_number}"
        if example_id in first_line_of_id:
            if on_duplicate_id == "error":
                raise ValueError(f"{path}:{line_number}: duplicate id {example_id!r} (first on {unnamed} "
                                 f"{first_line_of_id[example_id]}); fix the file or load it with "
                                 f"on_duplicate_id='suffix'")
            example_id = f"{example_id}#{unnamed}{line_number}"
        first_line_of_id[example_id] = line_number
        if not fields["data_source"]:
            fields["data_source"] = source
        examples.append(MathExample(id=example_id, **fields))

    if len(skipped) > _MAX_LOGGED_SKIPS:
        logger.warning("%s: %d malformed rows skipped in all (first %d shown)", path, len(skipped), _MAX_LOGGED_SKIPS)
    if not examples:
        raise ValueError(f"{path}: no valid rows ({len(skipped)} malformed)")
    logger.info("loaded %d examples from %s (%d malformed rows skipped)", len(examples), path, len(skipped))
    return MathDataset(name=source, path=str(path), examples=examples, skipped=skipped)


#: The name the trainer, evaluation and tests have always called; it reads parquet too.
load_math_jsonl = load_math_file


def _fingerprint(examples: Sequence[MathExample]) -> str:
    """Short hash of the example ids in order: a resumed sampler must see the same data."""
    digest = hashlib.sha256()
    for example in examples:
        digest.update(example.id.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()[:16]


class PromptSampler:
    """Seeded shuffling over examples, epoch after epoch, with an exactly resumable position.

    Semantics:

    - Epoch ``e`` visits every example exactly once: the stream of all examples handed out, cut into
      consecutive chunks of ``len(data)``, is a permutation of the data in every chunk.
    - No batch holds an example twice. A batch may end epoch ``e`` and start epoch ``e + 1``; then epoch
      ``e + 1`` cannot simply start with its own shuffle, whose first entries may already be in the batch.
    - Epoch ``e``'s order is the permutation drawn from ``numpy.random.default_rng((seed, e))`` (each epoch
      reshuffled, independently of other seeds' epochs), except after a straddling batch: when a batch of ``n``
      took the last ``r`` examples of epoch ``e``, epoch ``e + 1``'s permutation is stably rearranged so that
      its first ``n - r`` entries (its *front*) are the first ``n - r`` examples of that permutation that are
      not in the batch; the others keep their relative order.
    - ``next_batch(n)`` needs ``n <= len(data)`` (``n == len(data)`` hands out one whole epoch per batch);
      a larger ``n`` raises ``ValueError`` and changes nothing.
    - ``state_dict()`` / ``load_state_dict()`` carry (seed, epoch, position, the current epoch's front) plus a
      fingerprint of the data, and a resumed sampler yields exactly the batches the original would have. A
      state saved without a front (older checkpoints) loads with an empty one, i.e. the plain permutation.
    """

    def __init__(self, examples: Sequence[MathExample], seed: int = 0, shuffle: bool = True):
        if len(examples) == 0:
            raise ValueError("PromptSampler needs at least one example")
        self._examples = list(examples)
        self.seed = int(seed)
        self.shuffle = shuffle
        self._fingerprint = _fingerprint(self._examples)
        self.epoch = 0
        self.position = 0
        self._front: list[int] = []
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self._examples)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self._examples))
        return np.random.default_rng((self.seed, epoch)).permutation(len(self._examples))

    def _epoch_order(self, epoch: int, front: Sequence[int] = ()) -> np.ndarray:
        """Epoch ``epoch``'s order: ``front`` first, then the rest of its permutation in permutation order."""
        permutation = self._permutation(epoch)
        if not len(front):
            return permutation
        moved = np.zeros(len(permutation), dtype=bool)
        moved[np.asarray(front, dtype=np.int64)] = True
        return np.concatenate([np.asarray(front, dtype=permutation.dtype), permutation[~moved[permutation]]])

    def next_batch(self, n: int) -> list[MathExample]:
        """The next ``n`` distinct examples (``0 <= n <= len(data)``)."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        if n > len(self._examples):
            raise ValueError(f"a batch of {n} prompts needs at least {n} distinct prompts; the data has "
                             f"{len(self._examples)}")
        take = min(n, len(self._order) - self.position)
        indices = [int(i) for i in self._order[self.position:self.position + take]]
        self.position += take
        if self.position == len(self._order):
            # Advance eagerly: (epoch, position) always names the next example to come. The batch's remainder
            # comes from the next epoch, front-loaded with the first of its examples the batch does not hold.
            # n <= len(data) leaves enough of them and keeps the remainder inside the new epoch.
            remainder = n - take
            in_batch = set(indices)
            front = [int(i) for i in self._permutation(self.epoch + 1) if int(i) not in in_batch][:remainder] \
                if remainder else []
            self.epoch += 1
            self.position = remainder
            self._front = front
            self._order = self._epoch_order(self.epoch, front)
            indices.extend(front)
        return [self._examples[i] for i in indices]

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (JSON/pickle friendly) to save in a checkpoint."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "shuffle": self.shuffle,
                "num_examples": len(self._examples), "fingerprint": self._fingerprint,
                "epoch_front": list(self._front)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state; the data must be the same (same ids in the same order)."""
        if state.get("num_examples") != len(self._examples) or state.get("fingerprint") != self._fingerprint:
            raise ValueError(
                f"sampler state was saved for other data ({state.get('num_examples')} examples, fingerprint "
                f"{state.get('fingerprint')}) than this sampler has ({len(self._examples)}, {self._fingerprint})")
        position = int(state["position"])
        if not 0 <= position < len(self._examples):
            raise ValueError(f"sampler position {position} out of range")
        front = [int(i) for i in state.get("epoch_front") or ()]
        if (len(set(front)) != len(front) or not all(0 <= i < len(self._examples) for i in front)
                or len(front) > position):
            raise ValueError(f"sampler epoch_front is not {len(front)} distinct example indices handed out "
                             f"before position {position}")
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", True))
        self.epoch = int(state["epoch"])
        self.position = position
        self._front = front
        self._order = self._epoch_order(self.epoch, front)
