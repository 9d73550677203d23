"""The check's report: results read back from the parts' JSON files, rendered as markdown, appended to
docs/changelog.md."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_parts.environment import env_line
from benchmarks.gpu_check_parts.registry import NOT_RUN, REPORT_TITLE


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["(none)"]
    cols: list[str] = []
    for row in rows:
        cols += [c for c in row if c not in cols]
    lines = ["| " + " | ".join(_fmt(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(row.get(c, "")) for c in cols) + " |" for row in rows]
    return lines


def transpose_rows(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """One row per metric and one column per original row (named by its ``key``): for few, wide rows."""
    names: list[str] = []
    for row in rows:
        names += [c for c in row if c != key and c not in names]
    return [{"": name, **{str(row[key]): row.get(name, "") for row in rows}} for name in names]


def load_results(work: Path, parts: list[str]) -> list[dict[str, Any]]:
    """Each part's result file, or what the shell recorded when the part left none (killed, budget)."""
    results = []
    for name in parts:
        path = work / f"{name}.json"
        status_file = work / f"{name}.status"
        shell = dict(kv.split("=", 1) for kv in status_file.read_text().split()) if status_file.exists() else {}
        if path.exists():
            res = json.loads(path.read_text())
        elif shell.get("rc") == "budget":
            res = {"part": name, "status": NOT_RUN,
                   "summary": f"NOT RUN: the total time budget was spent ({shell.get('limit', '?')} s left)"}
        elif shell.get("rc") in ("124", "137"):
            res = {"part": name, "status": "fail", "summary": f"timed out after {shell.get('limit')} s (killed)"}
        else:
            res = {"part": name, "status": "fail",
                   "summary": f"no result (exit code {shell.get('rc', '?')}; see gpu_check.log)"}
        if shell.get("seconds"):
            res["seconds"] = float(shell["seconds"])
        if shell.get("leftover"):
            res.setdefault("notes", []).append("GPU processes left after the part: " + shell["leftover"])
        results.append(res)
    return results


def render_report(env: dict[str, Any], results: list[dict[str, Any]], command: str, cpu: bool) -> str:
    counts = Counter(r["status"] for r in results)
    gpu = (f"{env.get('gpu')} ({env.get('gpu_memory_gib')} GiB, {env.get('gpu_count')} visible), driver "
           f"{env.get('driver')}, compute capability {env.get('capability')}, NCCL {env.get('nccl')}"
           if env.get("cuda") else "none (no CUDA)")
    lines = [f"{REPORT_TITLE}, {env.get('date')}" + (" (--cpu developer mode)" if cpu else ""), "",
             f"- commit: {env.get('commit')}",
             f"- GPU: {gpu}",
             f"- versions: {env_line(env)}",
             f"- command: `{command}`",
             f"- result: {counts.get('pass', 0)} passed, {counts.get('fail', 0)} failed, {counts.get('skip', 0)} "
             f"skipped, " + (f"{counts[NOT_RUN]} NOT RUN, " if counts.get(NOT_RUN) else "")
             + f"{sum(float(r.get('seconds', 0)) for r in results):.0f} s", "",
             "| part | status | s | summary |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['part']} | {r['status']} | {_fmt(float(r.get('seconds', 0)))} | "
                     f"{_fmt(r.get('summary', ''))} |")
    for r in results:
        if r["status"] in ("skip", NOT_RUN):
            continue
        lines += ["", f"### {r['part']}: {r['status']}", ""]
        for key, value in (r.get("numbers") or {}).items():
            lines.append(f"- {key}: {_fmt(value)}")
        for note in r.get("notes", []):
            lines.append(f"- note: {_fmt(note)}")
        for title, rows in (r.get("tables") or {}).items():
            lines += ["", f"{title}:", ""] + _table(rows)
        if r.get("tail"):
            lines += ["", "```", *[x[:300] for x in r["tail"]], "```"]
    return "\n".join(lines) + "\n"


def append_report(report: str, target: Path) -> None:
    text = target.read_text() if target.exists() else ""
    with open(target, "a", encoding="utf-8") as f:
        if text and not text.endswith("\n\n"):
            f.write("\n" if text.endswith("\n") else "\n\n")
        f.write(report)
