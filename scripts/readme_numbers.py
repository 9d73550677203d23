"""Re-run the README's CPU commands and rewrite the numbers the README quotes from them, so they cannot drift.

    python scripts/readme_numbers.py              # main job + README's CPU eval (about 2 minutes on 2 cores)
    python scripts/readme_numbers.py --dry-run    # print the new text, leave README.md alone

It runs, exactly as README shows them (in a fresh temporary output directory):
  1. `dynamo train configs/cpu_default.yaml`                 -> mean reward of the first and last tenth of the steps
  2. `dynamo eval --checkpoint <run> --benchmarks synthetic_eval --n 8 --k 8 --max-tokens 6`  -> pass@1, pass@8, s
and replaces the text between `<!-- readme_numbers:NAME -->` and `<!-- /readme_numbers:NAME -->` in README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
TRAIN = ["train", "configs/cpu_default.yaml"]
EVAL = ["--benchmarks", "synthetic_eval", "--n", "8", "--k", "8", "--max-tokens", "6"]


def _dynamo(args: list[str]) -> tuple[str, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", *args], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"readme_numbers: `dynamo {' '.join(args)}` failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return proc.stdout, seconds


def tenth_means(rewards: list[float]) -> tuple[float, float]:
    """Mean reward of the first and of the last tenth of the steps (at least one step each)."""
    tenth = max(1, len(rewards) // 10)
    return sum(rewards[:tenth]) / tenth, sum(rewards[-tenth:]) / tenth


def machine() -> str:
    """The machine the numbers come from: CPU model and cores (the CPU's floating-point kernels shape them)."""
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores"


def measure(work: Path) -> tuple[dict[str, str], dict[str, float]]:
    run = work / "cpu_default"
    _, train_seconds = _dynamo([*TRAIN, f"trainer.output_dir={run}"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [row["reward_mean"] for row in rows if "reward_mean" in row]
    first, last = tenth_means(rewards)
    _, eval_seconds = _dynamo(["eval", "--checkpoint", str(run), *EVAL, "--output", str(work / "eval")])
    summary = json.loads((work / "eval" / "summary.json").read_text())
    avg = summary["benchmarks"]["synthetic_eval"]
    when = f"{datetime.date.today().isoformat()}, {machine()}"
    return {
        "main": (f"- `dynamo train configs/cpu_default.yaml`: mean reward {first:.2f} in the first tenth of the steps, "
                 f"{last:.2f} in the last ({when})"),
        "eval": (f"- then `dynamo eval --checkpoint outputs/cpu_default --benchmarks synthetic_eval --n 8 --k 8 "
                 f"--max-tokens 6`: pass@1 {100 * avg['pass@1']:.1f}, pass@8 {100 * avg['pass@8']:.1f} ({when})"),
    }, {"train": train_seconds, "eval": eval_seconds}


def rewrite(text: str, blocks: dict[str, str]) -> str:
    for name, body in blocks.items():
        pattern = re.compile(rf"(<!-- readme_numbers:{name} -->\n?)(.*?)(\n?<!-- /readme_numbers:{name} -->)", re.S)
        if not pattern.search(text):
            sys.exit(f"readme_numbers: README.md has no <!-- readme_numbers:{name} --> block")
        text = pattern.sub(lambda m: m.group(1) + body + m.group(3), text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the new blocks; do not write README.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="readme_numbers_") as work:
        blocks, times = measure(Path(work))
    for name, body in blocks.items():
        print(f"[{name}]\n{body}")
    print(f"seconds (start-up included): train {times['train']:.0f}, eval {times['eval']:.0f}")
    if not args.dry_run:
        README.write_text(rewrite(README.read_text(encoding="utf-8"), blocks), encoding="utf-8")
        print(f"rewrote {README}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
