"""Hub rows -> the product's JSONL rows: one converter per registered hub schema, and the checks of
``dynamo data prepare`` (``data/hub.py`` fetches or reads the rows and writes the file).

Written rows: ``id`` (the hub's id column, else the row index), ``problem``, ``answer``, ``answer_candidates``
(every accepted form, the answer first), ``data_source`` (the registry name) and a few small metadata columns.
Rows that cannot be converted are dropped and counted per reason. Problems are de-duplicated by exact text (the
first row is kept): the hub's DAPO-Math-17k repeats each of its ~17.9k problems about 100 times.

Hub schemas read (column names as published on the hub):

================  ==========================================  ================================================
name              hub id (split)                              columns -> row
================  ==========================================  ================================================
dapo_math_17k     BytedTsinghua-SIA/DAPO-Math-17k (train)     verl layout: ``prompt`` (chat messages; the user
                                                              message without DAPO's "Solve the following math
                                                              problem step by step ..." / "Remember to put your
                                                              answer on its own line after "Answer:"."
                                                              wrapper), ``reward_model.ground_truth``,
                                                              ``extra_info.index`` -> id
math_train        DigitalLearningGmbH/MATH-lighteval (train)  ``problem``; answer = last ``\\boxed{}`` of
                                                              ``solution``; ``level`` ("Level 5" -> 5), ``type``
gsm8k_train/test  openai/gsm8k, config main (train / test)    ``question``; answer = text after ``####`` in
                                                              ``answer`` (digit-group commas removed)
aime24            HuggingFaceH4/aime_2024 (train)             ``id``, ``problem``, ``answer``, ``url``
aime25            math-ai/aime25 (test)                       ``id``, ``problem``, ``answer``
amc23             math-ai/amc23 (test)                        ``id``, ``question``, ``answer`` (a number:
                                                              27.0 -> "27"), ``url``
math500           HuggingFaceH4/MATH-500 (test)               ``unique_id`` -> id, ``problem``, ``answer``,
                                                              ``subject``, ``level``
minerva           math-ai/minervamath (test)                  ``question``, ``answer`` (a list: first entry the
                                                              answer, all entries accepted forms)
olympiadbench     math-ai/olympiadbench (test)                ``id``, ``question`` (after ``context`` when
                                                              present), ``final_answer`` (list; ``$`` stripped;
                                                              several answers of an ``is_multiple_answer``
                                                              problem joined with ", ", otherwise the others are
                                                              accepted forms), ``unit``, ``answer_type``,
                                                              ``subfield``, ``is_multiple_answer``
================  ==========================================  ================================================

An unregistered hub id (``owner/name``) goes through a generic converter (verl layout, or ``problem`` /
``question`` with ``answer`` / ``final_answer`` / ``ground_truth`` / a boxed ``solution``) to
``<out>/<name>.jsonl``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from megatron_dynamo.data.rows import gsm8k_final_answer, is_verl_row, last_boxed, validate_row, verl_user_text

EMPTY_PROBLEM = "empty problem"
NO_ANSWER = "no answer"
NO_BOXED = "no \\boxed{} answer in 'solution'"
NO_HASHES = "no '####' final answer in 'answer'"
NO_USER_MESSAGE = "no user message in 'prompt'"
DUPLICATE_PROBLEM = "duplicate problem (same text as an earlier row)"
DUPLICATE_ID = "duplicate id"

DAPO_INSTRUCTION_START = "Solve the following math problem step by step."
DAPO_REMINDER = "Remember to put your answer on its own line after \"Answer:\""


class PrepareError(RuntimeError):
    """``dynamo data prepare`` cannot go on; the message is one line saying why and what to do."""


class _Drop(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ------------------------------------------------------------------------------------------------ field helpers

def _text(value: Any) -> str:
    return value.strip() if isinstance(value, str) else ""


def answer_text(value: Any) -> str:
    """An answer cell as text: strings stripped, numbers without a spurious ``.0``; anything else empty."""
    if isinstance(value, bool) or value is None:
        return ""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return _text(value)


def strip_dapo_instruction(text: str) -> str:
    """The problem inside DAPO-Math-17k's user message (its instruction line and closing reminder removed);
    text without that wrapper is returned unchanged."""
    body = text.strip()
    if body.startswith(DAPO_INSTRUCTION_START):
        _, separator, after = body.partition("\n\n")
        if separator:
            body = after
    cut = body.rfind(DAPO_REMINDER)
    if cut >= 0:
        body = body[:cut]
    return body.strip()


def _strip_dollars(answer: str) -> str:
    answer = answer.strip()
    if len(answer) >= 2 and answer.startswith("$") and answer.endswith("$") and answer.count("$") == 2:
        return answer[1:-1].strip()
    return answer


def _row_id(row: dict[str, Any], index: int, *keys: str) -> Any:
    for key in keys:
        value = row.get(key)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip():
            return value.strip()
    return index


def _pick(row: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if row.get(key) is not None:
            return row[key]
    return None


def _keep(row: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {key: row[key] for key in keys if row.get(key) is not None}


# --------------------------------------------------------------------------------------------------- converters

@dataclass(frozen=True)
class Converter:
    """How one hub schema becomes rows: ``required`` lists column groups of which one column must exist."""

    convert: Callable[[dict[str, Any], int], dict[str, Any]]
    required: tuple[tuple[str, ...], ...]


def _converted(row_id: Any, problem: str, answer: str, candidates: Iterable[str] = (),
               extras: dict[str, Any] | None = None) -> dict[str, Any]:
    if not problem:
        raise _Drop(EMPTY_PROBLEM)
    if not answer:
        raise _Drop(NO_ANSWER)
    forms = [answer]
    for candidate in candidates:
        if candidate and candidate not in forms:
            forms.append(candidate)
    return {"id": row_id, "problem": problem, "answer": answer, "answer_candidates": forms, "extras": extras or {}}


def _dapo(row: dict[str, Any], index: int) -> dict[str, Any]:
    user = verl_user_text(row.get("prompt"))
    if user is None:
        raise _Drop(NO_USER_MESSAGE)
    reward = row.get("reward_model") if isinstance(row.get("reward_model"), dict) else {}
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    return _converted(_row_id(extra, index, "index"), strip_dapo_instruction(user),
                      answer_text(reward.get("ground_truth")))


def _math(row: dict[str, Any], index: int) -> dict[str, Any]:
    problem = _text(row.get("problem"))
    if not problem:
        raise _Drop(EMPTY_PROBLEM)
    answer = last_boxed(row.get("solution"))
    if answer is None:
        raise _Drop(NO_BOXED)
    extras = _keep(row, "level", "type")
    level = extras.get("level")
    if isinstance(level, str) and re.fullmatch(r"Level \d+", level.strip()):
        extras["level"] = int(level.split()[1])
    return _converted(_row_id(row, index, "id", "unique_id"), problem, answer, extras=extras)


def _gsm8k(row: dict[str, Any], index: int) -> dict[str, Any]:
    problem = _text(row.get("question"))
    if not problem:
        raise _Drop(EMPTY_PROBLEM)
    answer = gsm8k_final_answer(row.get("answer"))
    if answer is None:
        raise _Drop(NO_HASHES)
    return _converted(_row_id(row, index, "id"), problem, answer)


def _plain(problem_keys: tuple[str, ...], id_keys: tuple[str, ...], extra_keys: tuple[str, ...]):
    """Problem column, scalar or list answer column, id column: AIME, AMC, MATH-500, Minerva."""

    def convert(row: dict[str, Any], index: int) -> dict[str, Any]:
        problem = _text(_pick(row, *problem_keys))
        raw = row.get("answer")
        forms = [answer_text(a) for a in raw] if isinstance(raw, (list, tuple)) else [answer_text(raw)]
        forms = [form for form in forms if form]
        if not problem:
            raise _Drop(EMPTY_PROBLEM)
        if not forms:
            raise _Drop(NO_ANSWER)
        return _converted(_row_id(row, index, *id_keys), problem, forms[0], forms[1:], _keep(row, *extra_keys))

    return convert


def _olympiadbench(row: dict[str, Any], index: int) -> dict[str, Any]:
    question = _text(row.get("question"))
    if not question:
        raise _Drop(EMPTY_PROBLEM)
    context = _text(row.get("context"))
    problem = f"{context}\n{question}" if context else question
    raw = row.get("final_answer")
    forms = [_strip_dollars(answer_text(a)) for a in (raw if isinstance(raw, (list, tuple)) else [raw])]
    forms = [form for form in forms if form]
    if not forms:
        raise _Drop(NO_ANSWER)
    extras = _keep(row, "unit", "answer_type", "subfield", "is_multiple_answer")
    if row.get("is_multiple_answer") and len(forms) > 1:
        return _converted(_row_id(row, index, "id"), problem, ", ".join(forms), extras=extras)
    return _converted(_row_id(row, index, "id"), problem, forms[0], forms[1:], extras)


def _generic(row: dict[str, Any], index: int) -> dict[str, Any]:
    """Any hub dataset: verl's layout, or a problem/question column with an answer-like column."""
    if is_verl_row(row):
        user = verl_user_text(row.get("prompt"))
        if user is None:
            raise _Drop(NO_USER_MESSAGE)
        reward = row.get("reward_model") if isinstance(row.get("reward_model"), dict) else {}
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        truth = reward.get("ground_truth")
        forms = [answer_text(t) for t in truth] if isinstance(truth, (list, tuple)) else [answer_text(truth)]
        forms = [form for form in forms if form]
        return _converted(_row_id(extra, index, "index"), user.strip(), forms[0] if forms else "", forms[1:])
    problem = _text(_pick(row, "problem", "question", "prompt"))
    raw = _pick(row, "answer", "final_answer", "ground_truth")
    if raw is not None:
        forms = [answer_text(a) for a in raw] if isinstance(raw, (list, tuple)) else [answer_text(raw)]
        if isinstance(raw, str) and "####" in raw:
            forms = [raw.split("####")[-1].strip()]
    else:
        boxed = last_boxed(row.get("solution"))
        forms = [boxed] if boxed else []
    forms = [form for form in forms if form]
    return _converted(_row_id(row, index, "id", "unique_id", "idx"), problem, forms[0] if forms else "",
                      forms[1:])


#: Registry name -> converter of its hub schema.
CONVERTERS: dict[str, Converter] = {
    "dapo_math_17k": Converter(_dapo, (("prompt",), ("reward_model",))),
    "math_train": Converter(_math, (("problem",), ("solution",))),
    "gsm8k_train": Converter(_gsm8k, (("question",), ("answer",))),
    "gsm8k_test": Converter(_gsm8k, (("question",), ("answer",))),
    "aime24": Converter(_plain(("problem",), ("id",), ("url",)), (("problem",), ("answer",))),
    "aime25": Converter(_plain(("problem",), ("id",), ()), (("problem",), ("answer",))),
    "amc23": Converter(_plain(("question", "problem"), ("id",), ("url",)), (("question", "problem"), ("answer",))),
    "math500": Converter(_plain(("problem",), ("unique_id", "id"), ("subject", "level")),
                         (("problem",), ("answer",))),
    "minerva": Converter(_plain(("question", "problem"), ("id",), ("type",)),
                         (("question", "problem"), ("answer",))),
    "olympiadbench": Converter(_olympiadbench, (("question",), ("final_answer",))),
}
GENERIC = Converter(_generic, ())


# ------------------------------------------------------------------------------------------------------ results

@dataclass
class PrepareResult:
    """What ``prepare`` did: rows read, written, and dropped per reason (with their row indices)."""

    name: str
    source: str
    path: Path
    rows_read: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    dropped: dict[str, list[int]] = field(default_factory=dict)

    @property
    def rows_written(self) -> int:
        return len(self.rows)

    @property
    def num_dropped(self) -> int:
        return sum(len(indices) for indices in self.dropped.values())

    def drop_counts(self) -> dict[str, int]:
        return {reason: len(indices) for reason, indices in self.dropped.items()}

    def summary_lines(self) -> list[str]:
        lines = [f"read {self.rows_read} rows of {self.source}"]
        for reason, indices in sorted(self.dropped.items(), key=lambda item: (-len(item[1]), item[0])):
            shown = ", ".join(str(i) for i in indices[:5]) + (", ..." if len(indices) > 5 else "")
            lines.append(f"dropped {len(indices)} row{'s' if len(indices) != 1 else ''}: {reason} "
                         f"(row indices {shown})")
        lines.append(f"wrote {self.rows_written} rows to {self.path}")
        return lines


def convert_rows(name: str, rows: Iterable[dict[str, Any]], converter: Converter | None = None,
                 data_source: str | None = None) -> PrepareResult:
    """Convert hub rows with the converter of ``name`` (a registry name; ``converter`` overrides). The result's
    ``path`` is unset (``Path()``) and ``source`` empty; :func:`prepare` fills them in."""
    converter = converter or CONVERTERS.get(name, GENERIC)
    result = PrepareResult(name=name, source="", path=Path())
    dropped: dict[str, list[int]] = {}
    seen_problems: set[str] = set()
    seen_ids: set[str] = set()
    checked = False
    for index, row in enumerate(rows):
        result.rows_read += 1
        if not checked:
            _check_columns(name, converter, row)
            checked = True
        try:
            out = converter.convert(row, index)
            if out["problem"] in seen_problems:
                raise _Drop(DUPLICATE_PROBLEM)
            if str(out["id"]) in seen_ids:
                raise _Drop(DUPLICATE_ID)
            record = {"id": out["id"], "problem": out["problem"], "answer": out["answer"],
                      "answer_candidates": out["answer_candidates"], "data_source": data_source or name}
            record.update({k: v for k, v in out["extras"].items() if k not in record})
            fields, why = validate_row(record)  # exactly what the loader will accept
            if fields is None:
                raise _Drop(f"invalid row: {why}")
        except _Drop as drop:
            dropped.setdefault(drop.reason, []).append(index)
            continue
        seen_problems.add(out["problem"])
        seen_ids.add(str(out["id"]))
        result.rows.append(record)
    result.dropped = dropped
    return result


def _check_columns(name: str, converter: Converter, row: Any) -> None:
    if not isinstance(row, dict):
        raise PrepareError(f"rows of {name} must be records (column -> value), got {type(row).__name__}")
    missing = [" or ".join(repr(c) for c in group) for group in converter.required if not any(c in row for c in group)]
    if missing:
        raise PrepareError(f"this is not {name}'s hub schema: no column {', '.join(missing)} (columns: "
                           f"{', '.join(sorted(row))})")
