"""Rows of a math data file: the flat shape, verl's RL layout, their validation, and reading JSONL / parquet.

The flat shape: ``id`` (string or integer), ``problem`` (non-empty string), ``answer`` (non-empty string; a JSON
number is accepted and converted), optional ``data_source`` (string), optional ``answer_candidates`` (list of
strings); every other field is kept in ``extras``. verl's layout (``prompt``: list of chat messages,
``reward_model.ground_truth``, ``data_source``, ``extra_info.index``) is read as described in :func:`from_verl_row`,
and two common shapes of one's own files are read as such (:func:`from_common_shape`): GSM8K's (``question``, an
``answer`` ending in ``#### 29``) and MATH's (``problem``, a ``solution`` with ``\\boxed{...}``).
:func:`validate_row` is the one rule the loader (``data/dataset.py``) and ``dynamo data prepare`` (``data/hub.py``)
both apply.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

_KNOWN_FIELDS = ("id", "problem", "answer", "answer_candidates", "data_source")
_VERL_FIELDS = ("prompt", "reward_model", "data_source", "extra_info")


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


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``, braces
    balanced; None when there is none or it is empty or unclosed."""
    if not isinstance(text, str):
        return None
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox")):]
    if rest.startswith(" "):  # "\boxed 5$"
        return rest[1:].split("$")[0].strip() or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for index, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:index].strip() or None
    return None


def gsm8k_final_answer(solution: Any) -> str | None:
    """The final answer of a GSM8K solution: the text after its last ``####``, digit-group commas removed."""
    if not isinstance(solution, str) or "####" not in solution:
        return None
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", solution.split("####")[-1].strip()) or None


def from_common_shape(row: dict[str, Any]) -> dict[str, Any]:
    """A GSM8K-shaped row (``question``, ``answer`` ending in ``#### N``) or a MATH-shaped row (``problem``,
    ``solution`` with a ``\\boxed{}`` answer and no ``answer``) in the flat shape, the worked solution kept as
    ``solution``; any other row as it is."""
    if "problem" not in row and isinstance(row.get("question"), str):
        final = gsm8k_final_answer(row.get("answer"))
        rest = {k: v for k, v in row.items() if k != "question"}
        if final is not None:
            rest.update(answer=final, solution=row["answer"])
        return {"problem": row["question"], **rest}
    if "answer" not in row and isinstance(row.get("problem"), str) and last_boxed(row.get("solution")):
        return {**row, "answer": last_boxed(row["solution"])}
    return row


def validate_row(row: Any) -> tuple[dict[str, Any] | None, str]:
    """Return ``(cleaned fields, "")`` or ``(None, why the row is malformed)``; verl rows and the common shapes of
    :func:`from_common_shape` are read as such."""
    if not isinstance(row, dict):
        return None, f"expected a JSON object, got {type(row).__name__}"
    if is_verl_row(row):
        row, why = from_verl_row(row)
        if row is None:
            return None, why
    row = from_common_shape(row)
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


def jsonl_rows(path: Path) -> Iterator[tuple[int, Any, str]]:
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


def parquet_rows(path: Path) -> Iterator[tuple[int, Any, str]]:
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
