"""Evaluate a model on the paper's benchmarks: n samples per problem with vLLM, scored by the training reward.

    dynamo eval --checkpoint outputs/run                          # a run's latest checkpoint, all six benchmarks
    dynamo eval --checkpoint Qwen/Qwen2.5-Math-1.5B --benchmarks aime24,amc23 --n 32 --k 32   # a hub id
    dynamo eval --checkpoint ckpt/megatron --benchmarks my_set.jsonl --n 4 --max-tokens 1024 --limit 20

--checkpoint takes an HF model directory, a hub id (Qwen/Qwen2.5-Math-1.5B: its snapshot in the Hugging Face cache,
downloaded there unless HF_HUB_OFFLINE=1; HF_HOME / HF_HUB_CACHE say where), a Megatron checkpoint (converted to HF
once, into the output directory), a training run's checkpoints/ directory or the run's output directory (its latest
checkpoint). --tokenizer takes a directory or a hub id too.
Benchmarks: aime24, aime25, amc23, math500, minerva, olympiadbench ("all": the six, the default), any registered
dataset name, or a JSONL / parquet path of the same shape (verl's RL parquet layout too); named ones are read from
--data-dir, else the default data directory ($MEGATRON_DYNAMO_DATA_DIR, else data/), where `dynamo data prepare NAME`
puts them.

Output (--output): samples.jsonl (one line per sample: benchmark, problem id, sample index, response, extracted
answer, correct), summary.json (per benchmark and averaged: pass@1 and pass@k, problems, samples, settings), and
the paper's table on stdout; default directory outputs/eval/<checkpoint name>-<8 hex of its absolute path>. Run the
same command again to resume an interrupted evaluation: finished problems are kept, the rest is generated with the
same per-problem seeds; on a finished one it prints the table again without converting or generating
(--overwrite: evaluate again). A Megatron checkpoint's conversion is reused while its path and files are the same.

Several engines: `--nproc N` runs N ranks on this machine (one GPU each; gloo processes on CPU), in engines of
--tensor-parallel consecutive ranks: N / tensor_parallel engines generate side by side, each batch of problems split
over them. Under torchrun / srun (RANK and WORLD_SIZE, or SLURM_PROCID, set) every process is one rank and --nproc
is ignored: `torchrun --nproc-per-node 8 -m megatron_dynamo.cli -- eval ...` (the `--` keeps torchrun from taking
--n for one of its own options). The samples, summary.json and the table are the same as with one engine
(per-problem seeds), timing aside; rank 0 writes the files and prints the table.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_dynamo import library_logs
from megatron_dynamo.commands.eval_output import (checkpoint_key, default_output, finished_evaluation, forget_results,
                                                  other_model, record_finished)
from megatron_dynamo.cpus import threads_per_rank
from megatron_dynamo.data.dataset import BENCHMARKS, DatasetNotAvailableError
from megatron_dynamo.eval.model_source import prepare_model, resolve_checkpoint
from megatron_dynamo.eval.runner import EvalConfig, EvalError, evaluate, format_table, load_benchmarks
from megatron_dynamo.models.checkpoint_io.signing import signing_key, trust_line
from megatron_dynamo.models.hub import HubModelError, is_hub_reference, resolve_model_dir
from megatron_dynamo.parallel.process_guard import start_guard
from megatron_dynamo.parallel.runtime import detect_launch, launched_externally
from megatron_dynamo.parallel.spawn import RankError, run_on_ranks
from megatron_dynamo.parallel.topology import JobTopology, check_at_least_one
from megatron_dynamo.reward.math_reward import MathRewardScorer, reward_workers_per_scorer
from megatron_dynamo.rollout.vllm_engine import VLLMEngine, VLLMNotAvailableError


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_arguments(parser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="HF model dir or hub id, Megatron checkpoint, or a training run's (checkpoints) directory")
    parser.add_argument("--benchmarks", default="all", metavar="LIST",
                        help=f"comma-separated names or JSONL / parquet paths; 'all' = {','.join(BENCHMARKS)}")
    parser.add_argument("--data-dir", default=None, metavar="DIR",
                        help="directory holding the benchmark files, as `dynamo data prepare --out` writes them "
                             "(default: $MEGATRON_DYNAMO_DATA_DIR, else data/, where `dynamo data prepare` writes)")
    parser.add_argument("--output", default=None, metavar="DIR",
                        help="output directory (default: outputs/eval/<checkpoint name>-<hash of its path>, so "
                             "two runs' step_N never share one); resumes if it holds part of the same evaluation, "
                             "and a finished one is shown again, not redone (--overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="evaluate again even when the output directory holds this evaluation finished (its "
                             "samples and summary are replaced; a cached conversion of the same checkpoint is kept)")
    parser.add_argument("--n", type=int, default=32, help="samples per problem (paper: 32)")
    parser.add_argument("--k", default=None, metavar="LIST",
                        help="comma-separated k for pass@k besides pass@1 (default: n)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (paper: 1.0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling top-p (paper: 1.0)")
    parser.add_argument("--max-tokens", type=int, default=8192,
                        help="response token limit; longer responses count as wrong (paper: 8192)")
    parser.add_argument("--template", default=None,
                        help="prompt template (default: the training run's when the checkpoint has one, else "
                             "qwen_math_boxed)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed; each problem's seeds derive from it")
    parser.add_argument("--answer-only", action="store_true",
                        help="accept only a row's `answer`, not its `answer_candidates` (Minerva's accepted forms)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first LIMIT problems of each benchmark")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="tokenizer directory or hub id (default: the one in or next to the checkpoint)")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="vLLM tensor-parallel size: ranks (GPUs) per engine")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to spawn on this machine (one GPU each; default 1): nproc / tensor-parallel "
                             "engines share every batch of problems, with the same samples and summary as one "
                             "engine; ignored under torchrun/srun, where each process is one rank")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="vLLM dtype (default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="vLLM context length (default: the model's max_position_embeddings)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of GPU memory vLLM may take")
    parser.add_argument("--problems-per-batch", type=int, default=64,
                        help="problems per generation call (finished batches survive an interruption)")
    parser.add_argument("--reward-workers", type=int, default=None,
                        help="math-verify worker processes (default: min(4, CPUs))")
    parser.add_argument("--reward-timeout", type=int, default=5,
                        help="math-verify seconds per answer; a timeout scores 0")
    parser.add_argument("--label", default=None, help="row label of the printed table (default: checkpoint name)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (on a terminal) or per-batch progress lines (otherwise)")
    parser.add_argument("--verbose", action="store_true",
                        help="the libraries' own logs and warnings too (vLLM's start-up, Megatron's conversion)")


def _eval_config(args, template: str):
    benchmarks = list(BENCHMARKS) if args.benchmarks == "all" else _csv(args.benchmarks)
    ks = [int(k) for k in _csv(args.k)] if args.k else [args.n]
    config = EvalConfig(benchmarks=tuple(benchmarks), n=args.n, k=tuple(ks), temperature=args.temperature,
                        top_p=args.top_p, max_tokens=args.max_tokens, template=template, seed=args.seed,
                        answer_candidates=not args.answer_only, limit=args.limit, data_dir=args.data_dir,
                        problems_per_batch=args.problems_per_batch)
    config.validate()
    return config


@dataclass(frozen=True)
class EvalJob:
    """What every rank needs to evaluate (picklable: it goes to spawned ranks)."""

    hf_dir: str
    converted: bool  # a Megatron checkpoint converted to hf_dir
    tokenizer_dir: str
    config: EvalConfig
    output: str
    model: str
    max_model_len: int
    topology: JobTopology
    dtype: str | None
    gpu_memory_utilization: float
    seed: int
    reward_workers: int | None
    reward_timeout: int
    progress: bool
    verbose: bool


def evaluate_on_rank(rank: int, world_size: int, job: EvalJob):
    """One rank's part of ``dynamo eval``: its engine (collective with the other ranks), a scorer on the engines'
    leaders, the collective evaluation, the engine closed last (that ends the process group). Rank 0 returns the
    summary, the others None. Without a process group (one process) vLLM starts its own."""
    from transformers import AutoTokenizer  # the tokenizer library: only where a model is evaluated

    library_logs.apply(job.verbose)
    tensor_parallel = job.topology.rollout.tensor_parallel
    layout = job.topology.engine_layout(rank)
    # Unless given: the node's cores shared by its engines' scorers (the scorer's own default with one engine).
    workers = job.reward_workers if job.reward_workers is not None else reward_workers_per_scorer(tensor_parallel)
    tokenizer = AutoTokenizer.from_pretrained(job.tokenizer_dir)
    scorer = (MathRewardScorer(num_workers=workers, timeout_seconds=job.reward_timeout) if layout.is_leader
              else nullcontext())
    with scorer, VLLMEngine(job.hf_dir, tokenizer=job.tokenizer_dir, tensor_parallel=tensor_parallel,
                            dtype=job.dtype, max_model_len=job.max_model_len, seed=job.seed,
                            gpu_memory_utilization=job.gpu_memory_utilization) as engine:
        summary = evaluate(engine, tokenizer, scorer if layout.is_leader else None, job.config, job.output,
                           model=job.model, max_prompt_tokens=job.max_model_len - 1, progress=job.progress)
    return summary if rank == 0 else None


def _init_external_group() -> None:
    """Under torchrun / srun: this process's rank of the job's process group (NCCL with one GPU per rank, gloo on
    CPU). A long timeout: the other ranks wait while rank 0 converts a Megatron checkpoint."""
    if dist.is_initialized():
        return
    launch = detect_launch()
    os.environ.setdefault("MASTER_ADDR", launch.master_addr)
    os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    os.environ.setdefault("LOCAL_RANK", str(launch.local_rank))
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    else:  # share the cores between the ranks of this machine
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or 1)
        torch.set_num_threads(threads_per_rank(local))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=launch.rank,
                            world_size=launch.world_size,
                            init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                            timeout=datetime.timedelta(hours=2))


def _topology(args, external: bool) -> JobTopology:
    """The ranks (torchrun/srun's, else --nproc) in engines of --tensor-parallel: checked before anything loads."""
    world = detect_launch().world_size if external else (args.nproc if args.nproc is not None else 1)
    check_at_least_one("--nproc", world)
    named = f"the {world} ranks of this torchrun/srun job" if external else f"--nproc {world}"
    return JobTopology.engines_only(world, args.tensor_parallel, named, "--tensor-parallel")


def _check_inputs(args) -> tuple[EvalConfig, Any]:
    """Everything that can be checked without a model: the settings, the checkpoint path, the benchmark files."""
    if args.k is not None and not _csv(args.k):
        raise ValueError("--k is empty")
    config = _eval_config(args, args.template or "qwen_math_boxed")
    source = resolve_checkpoint(args.checkpoint)
    if args.tokenizer is not None:
        try:
            args.tokenizer = str(resolve_model_dir(args.tokenizer, "tokenizer"))
        except HubModelError as exc:
            raise EvalError(f"--tokenizer {exc}") from None
    load_benchmarks(config)
    return config, source


def main(args) -> int:
    library_logs.apply(args.verbose)  # the table and the progress, not vLLM's start-up chatter (see library_logs)
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    external = launched_externally()
    rank = detect_launch().rank if external else 0

    def fail(message) -> int:
        if rank == 0:
            print(f"dynamo eval: {message}", file=sys.stderr)
        return 2

    try:
        topology = _topology(args, external)  # the layout first
        config, source = _check_inputs(args)
    except (ValueError, KeyError, EvalError, DatasetNotAvailableError) as exc:
        return fail(exc)
    # A hub id's snapshot directory is named by its commit: outputs and the table use the model's name.
    name = str(args.checkpoint).rstrip("/").split("/")[-1] if is_hub_reference(args.checkpoint) else source.name
    output = Path(args.output or default_output(source, name))
    finished = None if args.overwrite else finished_evaluation(output, checkpoint_key(source), args)
    if finished is not None:
        if rank == 0:
            print(f"dynamo eval: {output} already holds this evaluation of {source} (finished); showing it "
                  "(--overwrite evaluates again)")
            print(format_table([(args.label or name, finished)]))
            print(f"\n{output / 'samples.jsonl'}\n{output / 'summary.json'}")
        return 0
    if args.overwrite and rank == 0:
        forget_results(output)
    other = other_model(output, source)
    if other is not None:  # before any conversion writes into it
        return fail(f"{output} holds the evaluation of another model ({other}); choose another --output or pass "
                    "--overwrite to replace it")
    start_guard()  # however this process ends (kill -9 included), the ranks and reward workers go too
    summary = _evaluate_job(args, config, source, output, topology, rank, fail, collective=external and
                            topology.world_size > 1)
    if isinstance(summary, int) or rank != 0:
        return summary if isinstance(summary, int) else 0
    record_finished(output, checkpoint_key(source), args)
    print(format_table([(args.label or name, summary)]))
    rate = summary["problems_per_second"]
    print(f"\n{output / 'samples.jsonl'}\n{output / 'summary.json'}"
          + (f"\n{summary['generated_problems']} problems generated in {summary['seconds']:.1f} s "
             f"({rate:.2f} problems/s)" if rate else ""))
    return 0


def _evaluate_job(args, config, source, output: Path, topology: JobTopology, rank: int, fail, collective: bool):
    """The model prepared (converted once), then evaluated on this process's rank(s): rank 0's summary, None on the
    other ranks, or the exit status of a failure."""
    if collective:
        _init_external_group()
    try:
        job = _prepare(args, config, source, output, topology, rank, fail, collective)
        if isinstance(job, int):
            return job
        if rank == 0:
            engines = topology.rollout.num_engines
            origin = f"converted to {job.hf_dir}" if job.converted else "HF"
            print(f"dynamo eval: {job.model} ({origin}), "
                  f"{', '.join(job.config.benchmarks)}, n={job.config.n}, template {job.config.template}"
                  + (f", {engines} engines of {topology.rollout.tensor_parallel} rank(s)" if engines > 1 else ""),
                  flush=True)
            if job.converted:  # the converter checked it as --resume does: say what that proves
                print(f"dynamo eval: {job.model} verified; {trust_line(signing_key())}", flush=True)
        if collective or topology.world_size == 1:
            return evaluate_on_rank(rank, topology.world_size, job)
        try:
            return run_on_ranks(evaluate_on_rank, topology.world_size, job, user_errors=(
                EvalError, ValueError, FileNotFoundError, VLLMNotAvailableError))[0]
        except RankError as exc:
            return fail(exc)
    except EvalError as exc:
        return fail(exc)
    finally:
        if collective and dist.is_initialized():  # a failure before the engine (which ends the group) was built
            dist.destroy_process_group()


def _prepare(args, config, source, output: Path, topology: JobTopology, rank: int, fail, collective: bool):
    """The HF model directory (a Megatron checkpoint converted once, by rank 0 when collective), the template and
    stop tokens: an :class:`EvalJob`, or the exit status of a failure."""
    def prepared():
        try:
            return prepare_model(source, output, tokenizer=args.tokenizer), None
        except (EvalError, ValueError, KeyError) as exc:
            return None, str(exc)

    if collective:  # rank 0 converts; the others then find its result (the output directory must be shared)
        model, error = prepared() if rank == 0 else (None, None)
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            return fail(box[0])
        if rank != 0:
            model, error = prepared()
    else:
        model, error = prepared()
    if error is not None:
        return fail(error)
    if args.template is None and model.training_config:
        try:
            config = _eval_config(args, model.training_config.get("data", {}).get("template", config.template))
        except (ValueError, KeyError) as exc:
            return fail(exc)

    from transformers import AutoTokenizer  # the tokenizer library: only where a model is evaluated

    tokenizer_dir = args.tokenizer or str(model.hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    try:  # the same stop tokens as the training rollouts: EOS, generation_config.json, the template's end of turn
        config = replace(config, stop_token_ids=model.stop_token_ids(tokenizer, config.template, args.tokenizer))
    except EvalError as exc:
        return fail(exc)
    hf_config = json.loads((model.hf_dir / "config.json").read_text())
    max_model_len = args.max_model_len or int(hf_config.get("max_position_embeddings", 4096))
    return EvalJob(hf_dir=str(model.hf_dir), converted=model.is_megatron, tokenizer_dir=tokenizer_dir,
                   config=config, output=str(output), model=str(model.source), max_model_len=max_model_len,
                   topology=topology, dtype=args.dtype,
                   gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
                   reward_workers=args.reward_workers, reward_timeout=args.reward_timeout,
                   progress=not args.no_progress, verbose=args.verbose)
