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

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from megatron_dynamo.data.dataset import MathExample
from megatron_dynamo.eval.benchmarks import (  # noqa: F401 -- re-exported: the names importers have always used
    Benchmark,
    EvalConfig,
    EvalError,
    benchmark_name,
    build_prompts,
    load_benchmarks,
)
from megatron_dynamo.eval.results import (  # noqa: F401 -- re-exported as above
    AVERAGE,
    DISPLAY_NAMES,
    SAMPLES_FILE,
    SETTINGS_FILE,
    SUMMARY_FILE,
    check_settings,
    format_table,
    read_finished,
    summarize,
    summary_metrics,
    write_json_atomic,
    write_lines,
)
from megatron_dynamo.parallel.topology import EngineLayout
from megatron_dynamo.rollout.interface import GenerationRequest, SamplingConfig
from megatron_dynamo.rollout.sharding import assign_to_engines, request_loads

log = logging.getLogger(__name__)


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
    check_settings(output, settings)
    samples_path = output / SAMPLES_FILE
    finished, dropped = read_finished(samples_path, dict.fromkeys(prompts, 0), config.n)
    if dropped:  # rewrite without the unfinished problems, atomically, before appending
        log.warning("eval: dropping %d line(s) of unfinished problems from %s", dropped, samples_path)
        tmp = samples_path.with_suffix(".jsonl.tmp")
        write_lines(tmp, [r for records in finished.values() for r in records], "w")
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
    plan = _plan(engine, tokenizer, config, output, model, max_prompt_tokens, dist)
    if plan.finished and progress is True and plan.rank == 0:
        print(f"eval: resuming, {len(plan.finished)} of {len(plan.prompts)} problems already done", flush=True)
    tracker = _Progress(total=len(plan.prompts), done=len(plan.prompts) - len(plan.pending),
                        mode=progress if plan.rank == 0 else False)
    start = time.perf_counter()
    _generate_pending(engine, scorer, config, plan, output / SAMPLES_FILE, tracker, on_batch, dist)
    seconds = time.perf_counter() - start
    tracker.close()
    return _shared_summary(plan, config, tracker.generated, seconds, output, dist)


@dataclass
class _EvalPlan:
    """What an evaluation does, agreed by every rank: the benchmarks and their prompts, and the problems still to
    generate (``pending``); rank 0 also holds the records of the finished ones (``finished``, from the files)."""

    layout: EngineLayout | None
    rank: int
    benchmarks: list
    prompts: dict
    settings: dict[str, Any]
    finished: dict
    pending: list


def _plan(engine, tokenizer, config: EvalConfig, output: Path, model: str | None, max_prompt_tokens: int | None,
          dist) -> _EvalPlan:
    """Validate, read the benchmarks, build the prompts and open the output (rank 0); an error on any rank is
    raised on every rank before anyone generates."""
    layout, rank, failure, pending, finished = None, 0, None, [], {}
    benchmarks, prompts, settings = [], {}, {}
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
    return _EvalPlan(layout, rank, benchmarks, prompts, settings, finished, pending)


def _generate_pending(engine, scorer, config: EvalConfig, plan: _EvalPlan, samples_path: Path, tracker: _Progress,
                      on_batch: Callable[[int], None] | None, dist) -> None:
    """Generate and score the pending problems batch by batch, each engine its share; rank 0 appends each batch's
    records to ``samples_path`` and to ``plan.finished``."""
    sampling = config.sampling()
    layout, rank, prompts = plan.layout, plan.rank, plan.prompts
    score = layout is None or layout.is_leader
    todo = set(plan.pending)
    for bench in plan.benchmarks:
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
                write_lines(samples_path, records, "a")
                for i, ex in enumerate(batch):  # grouped in problem order, by sample index
                    plan.finished[(bench.name, ex.id)] = records[i * config.n:(i + 1) * config.n]
            tracker.update(bench.name, len(batch))
            if on_batch is not None:
                on_batch(len(batch))


def _shared_summary(plan: _EvalPlan, config: EvalConfig, generated: int, seconds: float, output: Path,
                    dist) -> dict[str, Any]:
    """Rank 0 summarises and writes the summary; every rank gets it (or the same error)."""
    summary, failure = None, None
    if plan.rank == 0:
        try:
            summary = summarize(plan.benchmarks, plan.finished, config)
            summary["settings"] = plan.settings
            summary["generated_problems"] = generated
            summary["seconds"] = seconds
            summary["problems_per_second"] = generated / seconds if generated and seconds > 0 else None
            write_json_atomic(output / SUMMARY_FILE, summary)
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
