"""The report of ``bench_update.py``: one row per variant (time, tokens/s against padded, peak extra memory against
unfused, layout) and the plain-text table."""

from __future__ import annotations

import math

MiB = 1 << 20


def table_rows(results: dict[str, dict], variants: list[str], same_as: dict[str, str]) -> list[dict]:
    """One row per variant: time, tokens/s and x padded, peak extra memory and x unfused, layout."""
    def res(v):
        return results.get(same_as.get(v, v), {})

    base_speed = res("padded").get("seconds") if "padded" in variants else None
    base_mem = res("unfused").get("peak_extra") if "unfused" in variants else None
    rows = []
    for v in variants:
        r = res(v)
        row = {"variant": v + (f" (= {same_as[v]})" if v in same_as else "")}
        if "error" in r:
            row["result"] = r["error"]
            rows.append(row)
            continue
        speed = r["real_tokens"] / r["seconds"]
        row.update({
            "micro-batches": r["micro_batches"], "computed tokens": r["computed_tokens"],
            "padding %": 100.0 * (1 - r["real_tokens"] / max(1, r["computed_tokens"])),
            "update s": r["seconds"], "tokens/s": speed,
            "x padded": (base_speed / r["seconds"]) if base_speed and not math.isnan(base_speed) else float("nan"),
            "peak extra MiB": r["peak_extra"] / MiB,
            "x unfused": (r["peak_extra"] / base_mem) if base_mem else float("nan"),
        })
        if "peak_reserved" in r:
            row["peak alloc GiB"] = r["peak_abs"] / 2**30
        if r.get("inexact"):
            row["peak extra MiB"] = f"{row['peak extra MiB']:.0f}*"
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    cols: list[str] = []
    for row in rows:
        cols += [c for c in row if c not in cols]

    def fmt(v):
        if isinstance(v, float):
            return "nan" if math.isnan(v) else (f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 10
                                                else f"{v:.1f}")
        return str(v)

    cells = [[fmt(row.get(c, "")) for c in cols] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths)))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join(lines)
