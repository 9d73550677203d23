"""An evaluation's files and numbers: what is finished in ``samples.jsonl``, the settings check, atomic writes, the
summary (pass@k per benchmark and averaged) and the paper-layout table. The file layout is described in
``eval/runner.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from megatron_dynamo.eval.benchmarks import Benchmark, EvalConfig, EvalError
from megatron_dynamo.eval.passk import mean_pass_at_k

SAMPLES_FILE = "samples.jsonl"
SUMMARY_FILE = "summary.json"
SETTINGS_FILE = "settings.json"
AVERAGE = "avg"


def read_finished(path: Path, wanted: dict[tuple[str, str], int], n: int) -> tuple[dict, int]:
    """Complete problems of ``samples.jsonl``: ``{(benchmark, problem id): [record per sample index]}`` and the
    number of lines that were dropped (unfinished problems, torn or foreign lines)."""
    if not path.is_file():
        return {}, 0
    groups: dict[tuple[str, str], dict[int, dict]] = {}
    dropped = 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
                key = (record["benchmark"], record["problem_id"])
                index = int(record["sample_index"])
            except (ValueError, KeyError, TypeError):
                dropped += 1
                continue
            if key not in wanted or not 0 <= index < n:
                dropped += 1
                continue
            groups.setdefault(key, {})[index] = record
    finished = {}
    for key, by_index in groups.items():
        if len(by_index) == n:
            finished[key] = [by_index[i] for i in range(n)]
        else:
            dropped += len(by_index)
    return finished, dropped


def write_lines(path: Path, records: Sequence[dict], mode: str) -> None:
    with open(path, mode, encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: Path, value: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def check_settings(output_dir: Path, settings: dict[str, Any]) -> None:
    path = output_dir / SETTINGS_FILE
    if path.is_file():
        try:
            previous = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            previous = None
        if previous != settings:
            differ = sorted(k for k in set(settings) | set(previous or {})
                            if (previous or {}).get(k) != settings.get(k))
            raise EvalError(f"{output_dir} holds an evaluation made with other settings (differ: "
                            f"{', '.join(differ) or 'unreadable settings.json'}); choose another output "
                            "directory or remove it")
    elif (output_dir / SAMPLES_FILE).exists():
        raise EvalError(f"{output_dir / SAMPLES_FILE} exists without {SETTINGS_FILE}: not an evaluation "
                        "directory this code wrote; choose another output directory")
    write_json_atomic(path, settings)


# ------------------------------------------------------------------------------------------------ evaluate


def summarize(benchmarks: Sequence[Benchmark], finished: dict[tuple[str, str], list[dict]],
              config: EvalConfig) -> dict[str, Any]:
    """Per-benchmark and averaged pass@k from the samples of every problem."""
    rows: dict[str, dict[str, Any]] = {}
    for bench in benchmarks:
        groups = [finished[(bench.name, ex.id)] for ex in bench.problems]
        counts = [(len(g), sum(r["correct"] for r in g)) for g in groups]
        tokens = [r["num_tokens"] for g in groups for r in g]
        rows[bench.name] = {
            **{f"pass@{k}": mean_pass_at_k(counts, k) for k in config.k},
            "problems": len(groups), "samples": len(tokens),
            "mean_response_tokens": sum(tokens) / len(tokens),
            "truncated_fraction": sum(r["finish_reason"] == "length" for g in groups for r in g) / len(tokens),
        }
    average = {f"pass@{k}": sum(row[f"pass@{k}"] for row in rows.values()) / len(rows) for k in config.k}
    return {"benchmarks": rows, AVERAGE: average, "n": config.n, "k": list(config.k)}


# --------------------------------------------------------------------------------------------------- report
DISPLAY_NAMES = {"aime24": "AIME24", "aime25": "AIME25", "amc23": "AMC23", "math500": "MATH500",
                 "minerva": "Minerva", "olympiadbench": "Olympiad"}


def format_table(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The paper's layout (Table 1): one column pair per benchmark and for the average, P@k in percent, one row
    per ``(label, summary)``."""
    if not rows:
        raise ValueError("format_table: nothing to show")
    names = list(rows[0][1]["benchmarks"])
    ks = rows[0][1]["k"]
    columns = [DISPLAY_NAMES.get(name, name) for name in names] + ["Avg."]
    label_width = max(6, *(len(label) for label, _ in rows))
    cell = max(6, *(len(c) // len(ks) + 1 for c in columns))
    group = cell * len(ks)
    lines = [" " * label_width + "".join(f" {c:>{group}}" for c in columns),
             " " * label_width + "".join(" " + "".join(f"{'P@' + str(k):>{cell}}" for k in ks) for _ in columns)]
    for label, summary in rows:
        values = [summary["benchmarks"][name] for name in names] + [summary[AVERAGE]]
        lines.append(f"{label:<{label_width}}" + "".join(
            " " + "".join(f"{100 * v[f'pass@{k}']:>{cell}.1f}" for k in ks) for v in values))
    return "\n".join(lines)


def summary_metrics(summary: dict[str, Any], prefix: str = "eval/") -> dict[str, float]:
    """Flat metrics for the training log: ``eval/<benchmark>/pass@k`` and ``eval/avg/pass@k``."""
    metrics = {}
    for name, row in [*summary["benchmarks"].items(), (AVERAGE, summary[AVERAGE])]:
        for key, value in row.items():
            if key.startswith("pass@") or key in ("mean_response_tokens", "truncated_fraction"):
                metrics[f"{prefix}{name}/{key}"] = float(value)
    return metrics
