"""What an evaluation runs on: its settings (:class:`EvalConfig`), the benchmarks loaded by name or path, and the
rendered prompts. ``eval/runner.py`` runs it; ``eval/results.py`` holds its files and summary.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from megatron_dynamo.data.dataset import BENCHMARKS, MathExample, load_math_jsonl
from megatron_dynamo.data.templates import DEFAULT_TEMPLATE, get_template, render
from megatron_dynamo.rollout.interface import SamplingConfig


class EvalError(RuntimeError):
    """An evaluation cannot start or go on (bad settings, a prompt longer than the model's context, a directory
    that holds an evaluation made with other settings)."""


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate and how to sample.

    ``benchmarks``: names (``aime24``, ``aime25``, ``amc23``, ``math500``, ``minerva``, ``olympiadbench``, or any
    registered dataset) or JSONL / parquet paths (flat rows or verl's layout, see ``data/dataset.py``);
    ``data_dir`` holds the local files of named ones.
    ``n`` samples per problem; pass@1 and pass@k for every ``k`` are reported (each k <= n). The paper's sampling
    (Table 3: temperature 1.0, top-p 1.0, 8192 response tokens) is the default: it gives no separate evaluation
    values. ``template``: the prompt template of training. ``answer_candidates``: also accept a row's
    ``answer_candidates`` (Minerva's accepted forms). ``limit``: only the first ``limit`` problems of each
    benchmark (smoke runs). ``problems_per_batch``: problems per generation call (the unit of resumption).
    ``stop_token_ids``: ids that end a response besides the tokenizer's EOS (the trainer passes its rollout's).
    """

    benchmarks: tuple[str, ...] = BENCHMARKS
    n: int = 32
    k: tuple[int, ...] = (1, 32)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 8192
    template: str = DEFAULT_TEMPLATE
    seed: int = 0
    answer_candidates: bool = True
    limit: int | None = None
    data_dir: str | None = None
    problems_per_batch: int = 64
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # YAML and the command line hand over lists; settings.json compares tuples.
        object.__setattr__(self, "benchmarks", tuple(self.benchmarks))
        object.__setattr__(self, "k", tuple(sorted({1, *(int(k) for k in self.k)})))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def validate(self) -> None:
        if not self.benchmarks:
            raise ValueError("evaluation needs at least one benchmark")
        if len(set(self.benchmarks)) != len(self.benchmarks):
            raise ValueError(f"benchmarks repeat: {list(self.benchmarks)}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if any(not 1 <= k <= self.n for k in self.k):
            raise ValueError(f"every k must lie in [1, n={self.n}], got {list(self.k)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be None or >= 1, got {self.limit}")
        if self.problems_per_batch < 1:
            raise ValueError(f"problems_per_batch must be >= 1, got {self.problems_per_batch}")
        SamplingConfig(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens).validate()
        get_template(self.template)

    def sampling(self) -> SamplingConfig:
        # Log-probs are not needed; the text is what gets scored.
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                              seed=self.seed, stop_token_ids=self.stop_token_ids, logprobs=False, detokenize=True)

    def settings(self) -> dict[str, Any]:
        """Everything a sample depends on (``problems_per_batch`` does not: seeds are per problem)."""
        values = asdict(self)
        values.pop("problems_per_batch")
        values.pop("data_dir")
        return json.loads(json.dumps(values))  # tuples -> lists, as they come back from settings.json


@dataclass(frozen=True)
class Benchmark:
    name: str
    path: str
    problems: tuple[MathExample, ...]


def benchmark_name(name_or_path: str) -> str:
    """The short name of a benchmark: itself for a registered name, the file stem for a path."""
    text = os.fspath(name_or_path)
    return Path(text).stem if text.endswith((".jsonl", ".json", ".parquet")) or os.sep in text else text


def load_benchmarks(config: EvalConfig) -> list[Benchmark]:
    """Read every benchmark (all of them before any generation: a missing file fails fast)."""
    benchmarks, seen = [], set()
    for entry in config.benchmarks:
        name = benchmark_name(entry)
        if name in seen:
            raise EvalError(f"two benchmarks are called {name!r}; rename one of the files")
        seen.add(name)
        dataset = load_math_jsonl(entry, config.data_dir, source_name=name)
        problems = tuple(dataset)[: config.limit] if config.limit else tuple(dataset)
        benchmarks.append(Benchmark(name, dataset.path, problems))
    return benchmarks


def build_prompts(benchmarks: Sequence[Benchmark], template: str, tokenizer,
                  max_prompt_tokens: int | None = None) -> dict[tuple[str, str], tuple[int, ...]]:
    """Prompt token ids per (benchmark, problem id), rendered and tokenized exactly as in training; EvalError
    if any is longer than ``max_prompt_tokens``."""
    prompts = {}
    for bench in benchmarks:
        for example in bench.problems:
            text = render(template, example.problem)
            prompts[(bench.name, example.id)] = tuple(tokenizer.encode(text, add_special_tokens=False))
    if max_prompt_tokens is not None:
        too_long = [f"{b}/{p} ({len(ids)} tokens)" for (b, p), ids in prompts.items() if len(ids) > max_prompt_tokens]
        if too_long:
            raise EvalError(f"{len(too_long)} prompt(s) exceed the engine's {max_prompt_tokens} prompt tokens: "
                            f"{', '.join(too_long[:5])}{' ...' if len(too_long) > 5 else ''}; raise the model "
                            "length or evaluate fewer benchmarks")
    return prompts


# --------------------------------------------------------------------------------------------- samples file
