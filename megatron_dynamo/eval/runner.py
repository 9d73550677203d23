"""Benchmark evaluation: n samples per problem from any generation engine, scored by the training reward code.

    summary = evaluate(engine, tokenizer, scorer, EvalConfig(benchmarks=("aime24",), n=32), "outputs/eval")

Writes into the output directory:

- ``samples.jsonl``: one line per sample (benchmark, problem id, sample index, response, extracted answer,
  correct, why, finish reason, token count), appended and fsynced one batch of problems at a time;
- ``settings.json``: what the samples depend on (sampling, template, seed, answer forms, benchmarks, model);
- ``summary.json``: per benchmark and averaged over benchmarks (the paper's "Avg." column is the plain mean of
  the benchmark columns): pass@1 and pass@k for each requested k, problems, samples, response lengths.

Resuming: run again into the same directory with the same settings. Problems whose n samples are all in
``samples.jsonl`` are not generated again; lines of unfinished problems (a batch cut by a crash, a torn last
line) are dropped first. Sample seeds depend only on (seed, problem id) -- never on the batch a problem lands in
-- so a resumed evaluation writes exactly the samples an uninterrupted one would.

Several engines: when torch.distributed is initialised with more than one rank, ``evaluate`` is collective (every
rank calls it with its own part of the job's engines, see ``rollout/sharding.py``). Rank 0 owns the files: it
checks the settings, reads what is finished and tells the others which problems are pending. Each batch of
``problems_per_batch`` problems (the whole batch, over all engines) is split over the engines by expected tokens
(:func:`~megatron_dynamo.rollout.sharding.assign_to_engines`), every engine generates its share, its leader scores
it and rank 0 writes the batch in problem order. Since seeds are per problem, the files are the same as with one
engine, timing fields aside. Every rank returns the summary.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from megatron_dynamo.data.dataset import BENCHMARKS, MathExample, load_math_jsonl
from megatron_dynamo.data.templates import DEFAULT_TEMPLATE, get_template, render
from megatron_dynamo.eval.passk import mean_pass_at_k
from megatron_dynamo.rollout.interface import GenerationRequest, SamplingConfig
from megatron_dynamo.rollout.sharding import EngineLayout, assign_to_engines, request_loads

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
SUMMARY_FILE = "summary.json"
SETTINGS_FILE = "settings.json"
AVERAGE = "avg"


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
def _read_finished(path: Path, wanted: dict[tuple[str, str], int], n: int) -> tuple[dict, int]:
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


def _write_lines(path: Path, records: Sequence[dict], mode: str) -> None:
    with open(path, mode, encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _write_json_atomic(path: Path, value: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _check_settings(output_dir: Path, settings: dict[str, Any]) -> None:
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
    _write_json_atomic(path, settings)


# ------------------------------------------------------------------------------------------------ evaluate
@dataclass
class _Progress:
    """``mode`` True: a tqdm bar of problems (rate, ETA) on a terminal, else one line per batch with the rate and
    the ETA; "bar": the bar on a terminal, nothing otherwise (evaluation during training: the training console
    stays one line per step); False: nothing."""

    total: int
    done: int
    mode: bool | str
    started: float = field(default_factory=time.perf_counter)
    generated: int = 0
    bar: Any = None

    def __post_init__(self) -> None:
        if self.mode and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.done, unit="problem", desc="eval", dynamic_ncols=True,
                            leave=self.mode is True, file=sys.stderr)

    def update(self, benchmark: str, problems: int) -> None:
        self.done += problems
        self.generated += problems
        if self.bar is not None:
            self.bar.set_postfix_str(benchmark, refresh=False)
            self.bar.update(problems)
        elif self.mode is True:
            from tqdm import tqdm

            rate = self.generated / max(time.perf_counter() - self.started, 1e-9)
            print(f"eval {benchmark}: {self.done}/{self.total} problems ({rate:.2f} problems/s, "
                  f"ETA {tqdm.format_interval((self.total - self.done) / rate)})", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _process_group():
    """``torch.distributed`` when it is initialised with more than one rank (evaluation is collective), else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover -- torch is a dependency; fakes in tests may run without a group
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _engine_layout(engine, dist) -> EngineLayout:
    """The engine layout of this rank: the engine's own (``VLLMEngine.layout``), else one engine per rank."""
    layout = getattr(engine, "layout", None)
    if layout is None:
        return EngineLayout(dist.get_rank(), dist.get_world_size(), 1)
    if layout.world_size != dist.get_world_size() or layout.rank != dist.get_rank():
        raise EvalError(f"the engine's layout (rank {layout.rank} of {layout.world_size}) is not this process's "
                        f"(rank {dist.get_rank()} of {dist.get_world_size()})")
    return layout


def _error_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, (EvalError, ValueError, OSError)) else f"{type(exc).__name__}: {exc}"


def _share_of_engine(batch: Sequence[MathExample], prompts: dict, bench: str, config: EvalConfig,
                     layout: EngineLayout | None) -> list[MathExample]:
    """The problems of ``batch`` this rank's engine generates: all of them with one engine; else its part of the
    split by expected tokens (prompt + n responses of half the token limit), the same on every rank."""
    if layout is None or layout.num_engines == 1:
        return list(batch)
    loads = request_loads([len(prompts[(bench, ex.id)]) for ex in batch], [config.n] * len(batch),
                          config.max_tokens / 2)
    assignment = assign_to_engines(loads, layout.num_engines)
    return [ex for ex, engine in zip(batch, assignment) if engine == layout.engine_index]


def _generate_records(engine, scorer, problems: Sequence[MathExample], bench: str, prompts: dict,
                      config: EvalConfig, sampling: SamplingConfig, score: bool) -> list[dict]:
    """The n samples of each problem (grouped in problem order, by sample index), as ``samples.jsonl`` records;
    ``score`` False (ranks of an engine other than its leader): generate only, return nothing."""
    if not problems:
        return []
    requests = [GenerationRequest(ex.id, prompts[(bench, ex.id)], config.n) for ex in problems]
    # step=0 always: a problem's seeds depend on (seed, problem id) only, so a resumed or re-batched evaluation,
    # one on any number of engines, and every evaluation during training draw the same random numbers per problem.
    responses = engine.generate(requests, sampling, step=0)
    if not score:
        return []
    references = {ex.id: ex.references(include_candidates=config.answer_candidates) for ex in problems}
    scored = scorer.score([r.text or "" for r in responses], [references[r.prompt_id] for r in responses],
                          finish_reasons=[r.finish_reason for r in responses])
    return [{"benchmark": bench, "problem_id": r.prompt_id, "sample_index": r.sample_index,
             "response": r.text or "", "extracted_answer": answer, "correct": bool(reward > 0),
             "why": why, "finish_reason": r.finish_reason, "num_tokens": r.num_tokens}
            for r, reward, why, answer in zip(responses, scored.rewards, scored.reasons, scored.extracted_answers)]


def _in_problem_order(parts: Sequence[Sequence[dict] | None], batch: Sequence[MathExample],
                      config: EvalConfig) -> list[dict]:
    """The records the engines sent, in the order one engine writes them: problem order, then sample index."""
    by_problem: dict[str, list[dict]] = {}
    for part in parts:
        for record in part or ():
            by_problem.setdefault(record["problem_id"], []).append(record)
    records = []
    for ex in batch:
        samples = sorted(by_problem.get(ex.id, ()), key=lambda r: r["sample_index"])
        if [r["sample_index"] for r in samples] != list(range(config.n)):
            raise EvalError(f"the engines returned samples {[r['sample_index'] for r in samples]} of problem "
                            f"{ex.id!r}, expected 0..{config.n - 1}")
        records.extend(samples)
    return records


def _open_output(output: Path, settings: dict[str, Any], prompts: dict, config: EvalConfig) -> dict:
    """Check the settings and read the finished problems (dropping the lines of unfinished ones)."""
    output.mkdir(parents=True, exist_ok=True)
    _check_settings(output, settings)
    samples_path = output / SAMPLES_FILE
    finished, dropped = _read_finished(samples_path, dict.fromkeys(prompts, 0), config.n)
    if dropped:  # rewrite without the unfinished problems, atomically, before appending
        log.warning("eval: dropping %d line(s) of unfinished problems from %s", dropped, samples_path)
        tmp = samples_path.with_suffix(".jsonl.tmp")
        _write_lines(tmp, [r for records in finished.values() for r in records], "w")
        os.replace(tmp, samples_path)
    return finished


def evaluate(engine, tokenizer, scorer, config: EvalConfig, output_dir: str | os.PathLike, *,
             model: str | None = None, max_prompt_tokens: int | None = None, progress: bool | str = True,
             on_batch: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Evaluate, resuming from ``output_dir`` if it holds part of the same evaluation; returns the summary.

    ``engine``: a :class:`~megatron_dynamo.rollout.interface.GenerationEngine` (awake); ``tokenizer``: its
    tokenizer (prompts are rendered and tokenized exactly as in training); ``scorer``: a
    :class:`~megatron_dynamo.reward.math_reward.MathRewardScorer`. ``model`` is recorded in the settings (a
    directory with another model's samples is refused). ``max_prompt_tokens``: the longest prompt the engine
    takes; a longer one is an error before anything is generated. ``on_batch(problems)`` is called after each
    written batch (tests interrupt there). ``progress``: True, a bar of problems with the ETA (a line per batch
    without a terminal); "bar", the bar on a terminal only; False, nothing.

    Collective when torch.distributed runs more than one rank (see the module doc): every rank calls it with the
    same arguments and its own engine (``engine.layout`` says which engine the rank belongs to; an engine without
    one counts as an engine of its own); ``scorer`` is used on the engines' leaders only (None elsewhere is fine);
    rank 0 writes the files and shows the progress; an error before generation (settings, prompts) is raised on
    every rank; ``on_batch`` runs on every rank.
    """
    dist = _process_group()
    output = Path(output_dir)
    layout, rank, failure, pending, finished = None, 0, None, [], {}
    try:
        if dist is not None:
            layout = _engine_layout(engine, dist)
            rank = layout.rank
        config.validate()
        benchmarks = load_benchmarks(config)
        prompts = build_prompts(benchmarks, config.template, tokenizer, max_prompt_tokens)
        settings = {**config.settings(), "benchmarks": [b.name for b in benchmarks], "model": model}
        if rank == 0:
            finished = _open_output(output, settings, prompts, config)
            pending = [key for key in prompts if key not in finished]
    except Exception as exc:  # noqa: BLE001 -- collective: every rank learns of it before anyone generates
        if dist is None:
            raise
        failure = exc
    if dist is not None:
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, (None if failure is None else _error_text(failure),
                                        pending if rank == 0 else None))
        if failure is not None:
            raise failure
        failed = [text for text, _ in states if text is not None]
        if failed:  # the same message on every rank (the lowest failed rank's)
            raise EvalError(failed[0])
        pending = states[0][1]
    if finished and progress is True and rank == 0:
        print(f"eval: resuming, {len(finished)} of {len(prompts)} problems already done", flush=True)

    sampling = config.sampling()
    samples_path = output / SAMPLES_FILE
    score = layout is None or layout.is_leader
    tracker = _Progress(total=len(prompts), done=len(prompts) - len(pending), mode=progress if rank == 0 else False)
    todo = set(pending)
    start = time.perf_counter()
    for bench in benchmarks:
        problems = [ex for ex in bench.problems if (bench.name, ex.id) in todo]
        for first in range(0, len(problems), config.problems_per_batch):
            batch = problems[first:first + config.problems_per_batch]
            mine = _share_of_engine(batch, prompts, bench.name, config, layout)
            records = _generate_records(engine, scorer, mine, bench.name, prompts, config, sampling, score)
            if dist is not None:
                parts = [None] * dist.get_world_size() if rank == 0 else None
                dist.gather_object(records if score else None, parts, dst=0)
                if rank == 0:
                    records = _in_problem_order(parts, batch, config)
            if rank == 0:
                _write_lines(samples_path, records, "a")
                for i, ex in enumerate(batch):  # grouped in problem order, by sample index
                    finished[(bench.name, ex.id)] = records[i * config.n:(i + 1) * config.n]
            tracker.update(bench.name, len(batch))
            if on_batch is not None:
                on_batch(len(batch))
    seconds = time.perf_counter() - start
    tracker.close()

    summary, failure = None, None
    if rank == 0:
        try:
            summary = summarize(benchmarks, finished, config)
            summary["settings"] = settings
            summary["generated_problems"] = tracker.generated
            summary["seconds"] = seconds
            summary["problems_per_second"] = (tracker.generated / seconds if tracker.generated and seconds > 0
                                              else None)
            _write_json_atomic(output / SUMMARY_FILE, summary)
        except Exception as exc:  # noqa: BLE001 -- the other ranks wait for the summary
            if dist is None:
                raise
            failure = exc
    if dist is not None:
        box = [(None if failure is None else _error_text(failure), summary)]
        dist.broadcast_object_list(box, src=0)
        if failure is not None:
            raise failure
        if box[0][0] is not None:
            raise EvalError(box[0][0])
        summary = box[0][1]
    return summary


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
