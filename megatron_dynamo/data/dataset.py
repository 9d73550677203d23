"""Math prompt data: JSONL / parquet loading with row validation, a name registry, and a resumable seeded sampler.

File format (``docs/algorithm.md``, "Data format"; what ``dynamo data prepare`` writes): one JSON object per line with
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
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np

from megatron_dynamo.data.registry import (  # noqa: F401 -- re-exported: the names importers have always used
    BENCHMARKS,
    DATA_DIR_ENV,
    DATASETS,
    DEFAULT_DATA_DIR,
    PARQUET_SUFFIXES,
    DatasetNotAvailableError,
    DatasetSpec,
    default_data_dir,
    resolve_dataset_path,
    spec_for,
)
from megatron_dynamo.data.rows import (  # noqa: F401 -- from_verl_row, is_verl_row, verl_user_text re-exported
    from_verl_row,
    is_verl_row,
    jsonl_rows,
    parquet_rows,
    validate_row,
    verl_user_text,
)

logger = logging.getLogger(__name__)

_MAX_LOGGED_SKIPS = 20


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

        Caution with the Minerva file: in 27 of its 272 rows a candidate is the final answer of the
        previous subproblem, which is printed in the problem text itself (e.g. answer ``0.53``, candidates
        ``4.4e7``); accepting candidates there rewards copying the prompt. ``include_candidates=False`` scores
        against ``answer`` alone.
        """
        forms = [self.answer]
        if include_candidates:
            forms += [c for c in self.answer_candidates if c not in forms]
        return forms


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

    for line_number, row, error in (parquet_rows(path) if parquet else jsonl_rows(path)):
        if error:
            skip(line_number, error)
            continue
        fields, why = validate_row(row)
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

    if not examples:  # one line, not a line per row: the file's shape is wrong, not some of its rows
        raise ValueError(no_valid_rows(path, skipped))
    for row in skipped[:_MAX_LOGGED_SKIPS]:
        logger.warning("%s:%d: skipped malformed row: %s", path, row.line, row.reason)
    if len(skipped) > _MAX_LOGGED_SKIPS:
        logger.warning("%s: %d malformed rows skipped in all (first %d shown)", path, len(skipped), _MAX_LOGGED_SKIPS)
    logger.info("loaded %d examples from %s (%d malformed rows skipped)", len(examples), path, len(skipped))
    return MathDataset(name=source, path=str(path), examples=examples, skipped=skipped)


def no_valid_rows(path: Path, skipped: list[SkippedRow]) -> str:
    """The one line for a file none of whose rows could be read: the commonest reason and the shapes that are."""
    if not skipped:
        return f"{path}: no rows"
    reasons = Counter(row.reason for row in skipped)
    reason, count = reasons.most_common(1)[0]
    share = "every row" if count == len(skipped) else f"{count} of {len(skipped)} rows"
    return (f"{path}: no valid rows ({share}: {reason}); a row needs 'problem' and 'answer' (GSM8K-, MATH- and "
            f"verl-shaped rows are read as such; docs/own-data.md shows the shapes and `dynamo data prepare`)")


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
