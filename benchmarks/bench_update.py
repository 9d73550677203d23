"""The RL update at a long-response, 152k-vocabulary shape: peak memory of the fused output layer vs the unfused one,
and tokens/s of dynamic (token-budget) and packed micro-batches vs fixed padded ones (issue 15).

    python benchmarks/bench_update.py                       CPU: hidden 256, 2 layers, vocab 151936, 8192 tokens
    python benchmarks/bench_update.py --device cuda --model configs/models/qwen2.5-math-1.5b.json --tokens 16384

What runs is the trainer's own update, ``PolicyUpdater.update`` of megatron_dynamo/trainer/update.py, on the real
Megatron actor (``MegatronActor``, random init, Megatron's Adam): the old-log-prob pass (``token_stats_fn``, forward
only), the modulation scopes, then per PPO mini-batch the training forward/backward with ``dynamo_loss_fn`` and the
optimizer step, all through ``MegatronActor.forward_backward``. Every trainer option comes from the run config, as
in ``dynamo train``; the variants differ only in these keys:

    unfused   trainer.fused_output_layer=false   layout L             the [tokens, V/tp] logits materialised
    fused     trainer.fused_output_layer=true    layout L             logits only chunk by chunk, response positions
    padded    fused, trainer.micro_batch_tokens=0, micro_batch_size=--micro-batch-size rows, pack_sequences=false
    dynamic   fused, trainer.micro_batch_tokens=--micro-batch-tokens, pack_sequences=false (padded rows)
    packed    fused, trainer.micro_batch_tokens=--micro-batch-tokens, pack_sequences=true (one row, no padding)

Layout L is --micro-batch-tokens with pack_sequences=auto (packed where Transformer Engine is, padded otherwise):
the recommended setting. Memory ratios are against ``unfused``, speed ratios against ``padded``, all measured in the
same run. Variants whose resolved settings coincide (on the CPU "fused" is "dynamic": auto does not pack on the
local spec) run once and share a row.

The samples: a DRA-like batch, prompts with 4..12 responses each (the allocator's range), prompt lengths uniform in
--prompt-tokens, response lengths log-normal (sigma 0.9: the median about two thirds of the mean, the longest a few
times the mean) scaled to --tokens response tokens in all and capped at --max-response; at least --responses
responses; random tokens, random group advantages. The same samples in every variant. --mini-batches PPO mini-batches (optimizer steps) split by prompt.

Each variant runs in a fresh process (one measurement cannot inherit another's heap): model and optimizer built,
one small warm-up update (Adam's state allocated, kernels loaded), then --repeats measured updates.
Peak memory:
  CUDA: torch.cuda.max_memory_allocated() after a reset, minus memory_allocated() before the update (exact,
        allocator-level); the absolute peak is given too.
  CPU:  the kernel's peak resident set size: VmHWM reset to the current RSS (write 5 to /proc/self/clear_refs)
        before the update, VmHWM minus that RSS after it (large tensors are mmapped and returned on free, so this
        is the peak of live memory plus allocator slack; see benchmarks/bench_token_stats.py). Without the reset
        (ru_maxrss, never reset) a row is marked '*': a lower bound.
Time: wall seconds of the update (old-log-prob + scopes + training + optimizer steps; CUDA synchronised), the
fastest of --repeats; tokens/s = real sequence tokens (prompt + response, no padding) per second. "computed" is
what the model processed, padding included (rows x length per micro-batch, or the packed row).

The machine it ran on may be shared (this project's CPU box has 2 cores and other sessions): the fastest of
--repeats and variants run back to back are what it can do about that.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("unfused", "fused", "padded", "dynamic", "packed")
QWEN_VOCAB = 151936


# The peak-memory window of the token-stats benchmark (VmHWM reset through /proc/self/clear_refs; its docstring).
from bench_token_stats import read_peak, start_peak_window  # noqa: E402
from bench_update_batch import dra_like_batch  # noqa: E402
from bench_update_table import MiB, format_table, table_rows  # noqa: E402
from megatron_dynamo.algorithms.config import SCOPE_SOURCES  # noqa: E402


# ------------------------------------------------------------------------------------------------ variants
def variant_overrides(variant: str, args) -> list[str]:
    """The run-config keys of a variant (see the module docstring)."""
    mbt, rows = args.micro_batch_tokens, args.micro_batch_size
    layout_l = [f"trainer.micro_batch_tokens={mbt}", "trainer.pack_sequences=auto"]
    return {
        "unfused": ["trainer.fused_output_layer=false", *layout_l],
        "fused": ["trainer.fused_output_layer=true", *layout_l],
        "padded": ["trainer.fused_output_layer=true", "trainer.micro_batch_tokens=0", "trainer.pack_sequences=false"],
        "dynamic": ["trainer.fused_output_layer=true", f"trainer.micro_batch_tokens={mbt}",
                    "trainer.pack_sequences=false"],
        "packed": ["trainer.fused_output_layer=true", f"trainer.micro_batch_tokens={mbt}",
                   "trainer.pack_sequences=true"],
    }[variant] + [f"trainer.micro_batch_size={rows}"]


def resolved_key(overrides: list[str], use_te: bool) -> tuple:
    """What a variant's settings come to (pack_sequences=auto resolved as the trainer resolves it): variants with
    equal keys are the same measurement."""
    values = dict(o.split("=", 1) for o in overrides)
    pack = values["trainer.pack_sequences"]
    packed = bool(use_te) if pack == "auto" else pack == "true"
    mbt = int(values["trainer.micro_batch_tokens"])
    rows = int(values["trainer.micro_batch_size"]) if mbt == 0 else None
    return values["trainer.fused_output_layer"], mbt, rows, packed


def _model_config(args) -> dict:
    if args.model:
        with open(args.model) as f:
            cfg = json.load(f)
        if args.layers:
            cfg["num_hidden_layers"] = args.layers
    else:
        heads = max(1, args.hidden // 64)
        cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": args.vocab,
               "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
               "num_hidden_layers": args.layers or 2, "num_attention_heads": heads,
               "num_key_value_heads": 2 if heads % 2 == 0 else 1, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
               "hidden_act": "silu", "tie_word_embeddings": False, "use_sliding_window": False,
               "sliding_window": None, "attention_dropout": 0.0, "initializer_range": 0.02, "bos_token_id": 0,
               "eos_token_id": 0, "torch_dtype": "float32"}
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0),
                                         args.prompt_tokens[1] + args.max_response + 8)
    return cfg


# ------------------------------------------------------------------------------------------------ worker
def _worker(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg["threads"])
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor
    from megatron_dynamo.trainer.batch import Sample, sequence_length
    from megatron_dynamo.trainer.config import load_run_config
    from megatron_dynamo.trainer.step import StageTimer, StepRunner

    cuda = cfg["device"] == "cuda"
    if cuda != torch.cuda.is_available():
        raise RuntimeError(f"--device {cfg['device']} but torch.cuda.is_available() is {torch.cuda.is_available()}")
    model_path = os.path.join(cfg["workdir"], "config.json")
    with open(model_path, "w") as f:
        json.dump(cfg["model"], f)
    prompts, responses = cfg["prompts"], cfg["responses"]
    num_prompts = len(prompts)
    per_mini = -(-num_prompts // cfg["mini_batches"])
    num_prompts_padded = per_mini * cfg["mini_batches"]
    overrides = [f"model.config={model_path}", f"model.dtype={cfg['dtype']}", "model.tokenizer=char",
                 f"data.prompts_per_step={num_prompts_padded}", f"trainer.mini_batch_prompts={per_mini}",
                 f"dynamo.modulation.scope={cfg['scope']}", f"rollout.temperature={cfg['temperature']}",
                 "optim.lr=1e-6", "trainer.ppo_epochs=1", *cfg["overrides"]]
    run = load_run_config(None, overrides, algo=cfg["algo"])
    runtime.init_distributed(run.parallel, seed=0)
    actor = MegatronActor(cfg["model"], dtype=run.model.dtype, optim=run.optim,
                          sequence_parallel=run.parallel.sequence_parallel)
    runner = StepRunner(run, actor, 0, torch.bfloat16 if cuda and run.model.dtype == "bf16" else torch.float32)
    ptoks = dict((pid, tuple(t)) for pid, t in prompts)
    samples = [Sample(i, pid, ptoks[pid], tuple(r), 0.0, adv) for i, (pid, r, adv) in enumerate(responses)]
    order = [pid for pid, _ in prompts]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    # Layout of the measured update, as the trainer builds it (its own micro_batches_for).
    from megatron_dynamo.trainer.batch import split_mini_batches

    layout = {"micro_batches": 0, "computed_tokens": 0, "largest_micro_batch_tokens": 0}
    for mini in split_mini_batches(samples, order, run.trainer.mini_batch_prompts):
        if not mini:
            continue
        for mb in runner.updater.micro_batches_for(mini):
            n = int(mb.input_ids.numel())
            layout["micro_batches"] += 1
            layout["computed_tokens"] += n
            layout["largest_micro_batch_tokens"] = max(layout["largest_micro_batch_tokens"], n)
    real_tokens = sum(sequence_length(s) for s in samples)

    # Warm-up: a small update (Adam's state appears at the first step; kernels, thread pools).
    small = [s for s in samples if s.prompt_id == order[0]][:2]
    small = [Sample(i, s.prompt_id, s.prompt_tokens, s.response_tokens[:16], 0.0, s.advantage)
             for i, s in enumerate(small)]
    runner.update(small, order[:1], StageTimer(), step=0)
    sync()
    gc.collect()
    base, hwm, before_peak = start_peak_window(cuda)
    times, stages, metrics = [], {}, {}
    for _ in range(cfg["repeats"]):
        timer = StageTimer()
        sync()
        t0 = time.perf_counter()
        metrics = runner.update(samples, order, timer, step=0)
        sync()
        times.append(time.perf_counter() - t0)
        if times[-1] == min(times):
            stages = dict(timer.seconds)
    peak = read_peak(cuda, hwm)
    out = {"seconds": min(times), "all_seconds": times, "stages": stages, "peak_extra": peak - base,
           "peak_abs": peak, "base": base, "inexact": (not cuda) and before_peak > base + 16 * MiB,
           "real_tokens": real_tokens, "response_tokens": sum(len(s.response_tokens) for s in samples),
           "optimizer_steps": metrics.get("optimizer_steps"), "loss": metrics.get("loss"),
           "grad_norm": metrics.get("grad_norm"), "skipped": metrics.get("skipped"),
           "use_te": bool(actor.use_te), **layout}
    if cuda:
        out["peak_reserved"] = torch.cuda.max_memory_reserved()
    try:
        runtime.shutdown()
    except Exception:  # noqa: BLE001
        if dist.is_initialized():
            dist.destroy_process_group()
    return out


# "AssertionError: ...", "[rank0]: torch.OutOfMemoryError: ...": a traceback's last line, a rank's prefix allowed.
_EXCEPTION_LINE = re.compile(r"^(\[rank\d+\]:\s*)?([\w.]+(Error|Exception|Interrupt)\b.*)$")


def failure_line(stderr_tail: list[str], returncode: int) -> str:
    """What a failed worker died of: the last exception line of its stderr. Not simply the last line: torch prints
    warnings after the traceback (NCCL's "destroy_process_group() was not called" on a GPU), which hid the error."""
    for line in reversed(stderr_tail):
        found = _EXCEPTION_LINE.match(line.strip())
        if found:
            return found.group(2)[:300]
    return stderr_tail[-1][:300] if stderr_tail else f"exit {returncode}"


def _run_subprocess(cfg: dict, timeout: float | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_update_") as workdir:
        cfg = dict(cfg, workdir=workdir)
        spec = os.path.join(workdir, "worker.json")
        with open(spec, "w") as f:
            json.dump(cfg, f)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_worker", spec],
                                  capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-30:]
        oom = any("OutOfMemoryError" in line or "out of memory" in line.lower() for line in tail)
        return {"error": "OOM" if oom else failure_line(tail, proc.returncode), "tail": tail if not oom else tail[-3:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ CLI
def _pair(text: str) -> tuple[int, int]:
    a, _, b = text.partition(",")
    lo, hi = int(a), int(b or a)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="where the model runs (auto: cuda when available)")
    ap.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                    help="model.dtype (default: bf16 on CUDA, fp32 on the CPU)")
    ap.add_argument("--model", default=None,
                    help="an HF config.json for the model shape (e.g. configs/models/qwen2.5-math-1.5b.json); "
                         "default: a Qwen2 of --hidden, --layers, --vocab (head_dim 64, FFN 3 x hidden)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size without --model (default 256)")
    ap.add_argument("--layers", type=int, default=None,
                    help="transformer layers (default 2; with --model: the config's, or this many)")
    ap.add_argument("--vocab", type=int, default=QWEN_VOCAB, help=f"vocabulary without --model (default {QWEN_VOCAB}, "
                                                                   "Qwen2.5's)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="response tokens of the update in all (default 8192 on the CPU, 16384 on CUDA)")
    ap.add_argument("--responses", type=int, default=None,
                    help="responses at least (whole prompts of 4..12 responses; default 16 on the CPU, 32 on CUDA): "
                         "the mean response length is about --tokens / this")
    ap.add_argument("--max-response", type=int, default=None,
                    help="the longest response (default: 2048 on the CPU, 8192 on CUDA, the paper's limit)")
    ap.add_argument("--prompt-tokens", type=_pair, default=(64, 256), metavar="MIN,MAX",
                    help="prompt lengths, uniform in [MIN, MAX] (default 64,256)")
    ap.add_argument("--mini-batches", type=int, default=2,
                    help="PPO mini-batches of the update, split by prompt (default 2; the paper has 16 per step)")
    ap.add_argument("--micro-batch-size", type=int, default=4,
                    help="rows per micro-batch of the 'padded' variant, trainer.micro_batch_size (default 4)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="trainer.micro_batch_tokens of the other variants (default 2048 on the CPU, where the "
                         "unfused variant's [tokens, 151936] fp32 logits and their gradients must fit in the shared "
                         "24 GiB; 16384 on CUDA)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)} (default all)")
    ap.add_argument("--scope", default="old_policy", choices=SCOPE_SOURCES,
                    help="dynamo.modulation.scope (default old_policy)")
    ap.add_argument("--algo", default="dynamo", choices=["dynamo", "grpo"],
                    help="the loss: DynaMO's modulated PPO (default) or plain GRPO")
    ap.add_argument("--temperature", type=float, default=1.0, help="rollout.temperature of the log-probs")
    ap.add_argument("--repeats", type=int, default=None,
                    help="measured updates per variant, the fastest counts (default 1 on the CPU, 3 on CUDA)")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                    help="torch threads of each worker (default min(2, cores))")
    ap.add_argument("--seed", type=int, default=0, help="seed of the samples")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per variant before it is killed")
    ap.add_argument("--json", default=None, help="also write the settings, per-variant results and rows here")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    return ap


def run(args) -> dict:
    """Every variant in its own process; returns {"settings", "results", "rows", "table", "same_as"}."""
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cuda = device == "cuda"
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    tokens = args.tokens or (16384 if cuda else 8192)
    max_response = args.max_response or (8192 if cuda else 2048)
    args.max_response = max_response
    args.micro_batch_tokens = args.micro_batch_tokens or (16384 if cuda else 2048)
    repeats = args.repeats or (3 if cuda else 1)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise SystemExit(f"--variants: unknown {bad}; choose from {','.join(VARIANTS)}")
    model = _model_config(args)
    prompts, responses = dra_like_batch(tokens, args.responses or (16 if not cuda else 32), args.prompt_tokens,
                                        max_response, model["vocab_size"], args.seed)
    try:
        from megatron_dynamo.models.qwen import te_available

        use_te = bool(cuda and te_available())
    except Exception:  # noqa: BLE001
        use_te = False
    same_as, keys = {}, {}
    for v in variants:
        key = resolved_key(variant_overrides(v, args), use_te)
        if key in keys:
            same_as[v] = keys[key]
        else:
            keys[key] = v
    lengths = [len(r) for _, r, _ in responses]
    settings = {
        "device": device, "dtype": dtype, "threads": args.threads if not cuda else None,
        "model": (args.model or "built") + f": hidden {model['hidden_size']}, {model['num_hidden_layers']} layers, "
                 f"vocab {model['vocab_size']}, heads {model['num_attention_heads']}/{model['num_key_value_heads']}",
        "batch": f"{len(prompts)} prompts, {len(responses)} responses, {sum(lengths)} response tokens (mean "
                 f"{sum(lengths) / len(lengths):.0f}, max {max(lengths)}, {sum(x >= max_response for x in lengths)} "
                 f"at the cap {max_response}), prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens",
        "update": f"{args.mini_batches} mini-batches, {args.algo}, scope {args.scope}, micro_batch_size "
                  f"{args.micro_batch_size} (padded), micro_batch_tokens {args.micro_batch_tokens} (others), "
                  f"repeats {repeats}",
        "transformer_engine": use_te,
    }
    for k, v in settings.items():
        print(f"# {k}: {v}", flush=True)
    results: dict[str, dict] = {}
    start = time.perf_counter()
    for v in variants:
        if v in same_as:
            print(f"# {v}: the same settings as {same_as[v]} here", flush=True)
            continue
        cfg = {"variant": v, "overrides": variant_overrides(v, args), "device": device, "dtype": dtype,
               "model": model, "prompts": prompts, "responses": responses, "mini_batches": args.mini_batches,
               "scope": args.scope, "algo": args.algo, "temperature": args.temperature, "repeats": repeats,
               "threads": args.threads}
        t0 = time.perf_counter()
        results[v] = r = _run_subprocess(cfg, args.timeout)
        detail = r.get("error") or (f"{r['seconds']:.1f} s, {r['real_tokens'] / r['seconds']:.0f} tokens/s, peak "
                                    f"extra {r['peak_extra'] / MiB:.0f} MiB, {r['micro_batches']} micro-batches")
        print(f"# {v}: {detail} ({time.perf_counter() - t0:.0f} s with start-up)", flush=True)
        if r.get("tail") and r.get("error") != "OOM":
            print("\n".join("#   " + line for line in r["tail"][-12:]), flush=True)
    rows = table_rows(results, variants, same_as)
    table = format_table(rows)
    print(table)
    print(f"# x padded: update speed against 'padded' (fixed {args.micro_batch_size}-row padded micro-batches); "
          f"x unfused: peak extra memory against 'unfused'; total {time.perf_counter() - start:.0f} s")
    return {"settings": settings, "results": results, "rows": rows, "table": table, "same_as": same_as}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args._worker:
        with open(args._worker) as f:
            print(json.dumps(_worker(json.load(f))))
        return 0
    out = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    failed = [v for v, r in out["results"].items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
