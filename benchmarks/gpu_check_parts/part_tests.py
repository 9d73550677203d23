"""Part ``tests``: ``pytest tests/test_gpu.py`` on the GPU, one row per test."""

from __future__ import annotations

import re
import sys
from typing import Any

from benchmarks.gpu_check_parts.common import Ctx, child_env, run_streaming


def pytest_outcome(line: str) -> dict[str, str] | None:
    """One line of pytest's -rA summary -> {outcome, test, detail}: "PASSED path::test[id]",
    "FAILED path::test - message", "SKIPPED [n] path:line: reason"."""
    m = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(.*)$", line)
    if not m:
        return None
    outcome, rest = m.groups()
    if "::" in rest:
        test, _, detail = rest.partition(" - ")
        test = test.split("::", 1)[1]
    else:  # SKIPPED [2] tests/test_gpu.py:64: reason
        rest = re.sub(r"^\[\d+\]\s+", "", rest)
        test, _, detail = rest.partition(": ")
        test = test.removeprefix("tests/")
    return {"outcome": outcome, "test": test.strip(), "detail": detail.strip()[:160]}


def part_tests(ctx: Ctx) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "tests/test_gpu.py", "-q", "-rA", "-p", "no:cacheprovider"]
    rc, lines = run_streaming(cmd, ctx.remaining() - 10, env=child_env())
    counts: dict[str, int] = {}
    for line in reversed(lines):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", line)
        if found and ("=" in line or " in " in line):
            counts = {kind: int(n) for n, kind in found}
            break
    rows = [row for row in map(pytest_outcome, lines) if row]
    numbers = {"exit_code": rc if rc is not None else "killed (time limit)", **counts}
    status = "pass" if rc == 0 and not counts.get("failed") and not counts.get("error") else "fail"
    if rc == 5:
        status, numbers["note"] = "fail", "no test collected"
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or f"pytest exit {rc}"
    out = {"status": status, "summary": summary, "numbers": numbers, "tables": {"tests": rows}}
    if status == "fail":
        out["tail"] = lines[-40:]
    return out
