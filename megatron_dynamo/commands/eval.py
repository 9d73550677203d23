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
--data-dir / $MEGATRON_DYNAMO_DATA_DIR, where `dynamo data prepare NAME --out DIR` puts them.

Output (--output): samples.jsonl (one line per sample: benchmark, problem id, sample index, response, extracted
answer, correct), summary.json (per benchmark and averaged: pass@1 and pass@k, problems, samples, settings), and
the paper's table on stdout. Run the same command again to resume an interrupted evaluation: finished problems
are kept, the rest is generated with the same per-problem seeds.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from megatron_dynamo.data.dataset import BENCHMARKS


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_arguments(parser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="HF model dir or hub id, Megatron checkpoint, or a training run's (checkpoints) directory")
    parser.add_argument("--benchmarks", default="all", metavar="LIST",
                        help=f"comma-separated names or JSONL / parquet paths; 'all' = {','.join(BENCHMARKS)}")
    parser.add_argument("--data-dir", default=None, metavar="DIR",
                        help="directory holding the benchmark files, as `dynamo data prepare --out` writes them "
                             "(default: $MEGATRON_DYNAMO_DATA_DIR)")
    parser.add_argument("--output", default=None, metavar="DIR",
                        help="output directory (default: outputs/eval/<checkpoint name>); resumes if it holds "
                             "part of the same evaluation")
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
    parser.add_argument("--tensor-parallel", type=int, default=1, help="vLLM tensor-parallel size (GPUs)")
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
    from megatron_dynamo.eval.runner import EvalConfig

    benchmarks = list(BENCHMARKS) if args.benchmarks == "all" else _csv(args.benchmarks)
    ks = [int(k) for k in _csv(args.k)] if args.k else [args.n]
    config = EvalConfig(benchmarks=tuple(benchmarks), n=args.n, k=tuple(ks), temperature=args.temperature,
                        top_p=args.top_p, max_tokens=args.max_tokens, template=template, seed=args.seed,
                        answer_candidates=not args.answer_only, limit=args.limit, data_dir=args.data_dir,
                        problems_per_batch=args.problems_per_batch)
    config.validate()
    return config


def run(args) -> int:
    from megatron_dynamo import library_logs

    library_logs.apply(args.verbose)  # the table and the progress, not vLLM's start-up chatter (see library_logs)
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from megatron_dynamo.data.dataset import DatasetNotAvailableError
    from megatron_dynamo.eval.model_source import prepare_model, resolve_checkpoint
    from megatron_dynamo.eval.runner import EvalError, evaluate, format_table, load_benchmarks
    from megatron_dynamo.models.hub import HubModelError, is_hub_reference, resolve_model_dir

    def fail(message) -> int:
        print(f"dynamo eval: {message}", file=sys.stderr)
        return 2

    # Everything that can be checked without a model is checked first: settings, the checkpoint path, the files.
    try:
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
    except (ValueError, KeyError, EvalError, DatasetNotAvailableError) as exc:
        return fail(exc)
    # A hub id's snapshot directory is named by its commit: outputs and the table use the model's name.
    name = str(args.checkpoint).rstrip("/").split("/")[-1] if is_hub_reference(args.checkpoint) else source.name
    output = Path(args.output or Path("outputs") / "eval" / name)
    try:
        model = prepare_model(source, output, tokenizer=args.tokenizer)
        if args.template is None and model.training_config:
            config = _eval_config(args, model.training_config.get("data", {}).get("template", config.template))
    except (EvalError, ValueError, KeyError) as exc:
        return fail(exc)

    from transformers import AutoTokenizer

    from megatron_dynamo.parallel.process_guard import start_guard
    from megatron_dynamo.reward.math_reward import MathRewardScorer
    from megatron_dynamo.rollout.vllm_engine import VLLMEngine

    start_guard()  # however this process ends (kill -9 included), vLLM's processes and the reward workers go too

    tokenizer_dir = args.tokenizer or str(model.hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    try:  # the same stop tokens as the training rollouts: EOS, generation_config.json, the template's end of turn
        config = replace(config, stop_token_ids=model.stop_token_ids(tokenizer, config.template, args.tokenizer))
    except EvalError as exc:
        return fail(exc)
    hf_config = json.loads((model.hf_dir / "config.json").read_text())
    max_model_len = args.max_model_len or int(hf_config.get("max_position_embeddings", 4096))
    print(f"dynamo eval: {model.source} ({'converted to ' + str(model.hf_dir) if model.is_megatron else 'HF'}), "
          f"{', '.join(config.benchmarks)}, n={config.n}, template {config.template}", flush=True)
    try:
        with MathRewardScorer(num_workers=args.reward_workers, timeout_seconds=args.reward_timeout) as scorer, \
                VLLMEngine(str(model.hf_dir), tokenizer=tokenizer_dir, tensor_parallel_size=args.tensor_parallel,
                           dtype=args.dtype, max_model_len=max_model_len, seed=args.seed,
                           gpu_memory_utilization=args.gpu_memory_utilization) as engine:
            summary = evaluate(engine, tokenizer, scorer, config, output, model=str(model.source),
                               max_prompt_tokens=max_model_len - 1, progress=not args.no_progress)
    except EvalError as exc:
        return fail(exc)
    print(format_table([(args.label or name, summary)]))
    rate = summary["problems_per_second"]
    print(f"\n{output / 'samples.jsonl'}\n{output / 'summary.json'}"
          + (f"\n{summary['generated_problems']} problems generated in {summary['seconds']:.1f} s "
             f"({rate:.2f} problems/s)" if rate else ""))
    return 0
