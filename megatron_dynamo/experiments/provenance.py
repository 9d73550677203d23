"""Which runs may be paired: those of one machine and one warm-up.

Another CPU model or torch build runs other floating-point kernels, so the same command gives other numbers there:
results are bit-identical on one machine only. Every run records both itself (``trainer/provenance.py``), the raw
data (``experiments/raw_data.py``) copies them, an experiment that moves to another machine reruns the unfinished
seeds there (a seed is never split across machines), and ``dynamo confirm`` refuses a seed whose runs span two machines or two warm-ups
(:func:`seed_groups`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

#: What a seed's runs must share: (machine, warm-up hash).
Group = tuple[str, str]


def group_of(row: Mapping[str, Any]) -> Group:
    """A raw-data row's (machine, warm-up); empty strings where an older file did not record them."""
    return str(row.get("machine") or ""), str(row.get("warmup") or "")


def seed_groups(rows: Iterable[Mapping[str, Any]]) -> dict[int, dict[Group, int]]:
    """Per seed, how many of its runs (the warm-up rows aside) ran in each (machine, warm-up)."""
    out: dict[int, dict[Group, int]] = {}
    for row in rows:
        if row.get("variant") == "sft":
            continue
        counts = out.setdefault(int(row["seed"]), {})
        counts[group_of(row)] = counts.get(group_of(row), 0) + 1
    return out


def check_one_group_per_seed(rows: Iterable[Mapping[str, Any]]) -> None:
    """ValueError (one line) for the first seed whose runs span two machines or two warm-ups."""
    for seed, groups in sorted(seed_groups(rows).items()):
        if len(groups) < 2:
            continue
        machines = {machine for machine, _ in groups}
        what = "two machines" if len(machines) > 1 else "two warm-ups"
        parts = "; ".join(f"{n} run(s) on {machine or 'an unrecorded machine'} from warm-up {warmup or '?'}"
                          for (machine, warmup), n in sorted(groups.items()))
        raise ValueError(f"seed {seed}'s runs span {what} ({parts}): its runs are paired, so rerun the seed on one "
                         "machine (dynamo ablate --raw-data reruns it where it resumes)")


__all__ = ["Group", "check_one_group_per_seed", "group_of", "seed_groups"]
