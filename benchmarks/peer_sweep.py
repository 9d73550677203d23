"""The peer benchmark's sweep (``benchmarks/bench_peer.py --sweep``): the step time of ours and of TRL's GRPOTrainer
against the response length x the model size.

    python benchmarks/bench_peer.py --sweep [--sweep-lengths 16,64,256,1024] [--sweep-models tiny,30m,100m,0.5b]
                                    [--sweep-budget-s S] [--sweep-memory-gib G] [--steps 3] [--work DIR]

Models (``MODELS``): configs/models/tiny-qwen2.json, bench-qwen2-30m.json, bench-qwen2-100m.json and
bench-qwen2-0.5b.json, each from random weights (no warm-up, as the large shape: an HF export of the initial
weights, ``trainer.steps=0 checkpoint.export_hf=true trainer.sft_warmup_steps=0``, once per model under ``--work``).
The sweep's copy of a model's config has ``max_position_embeddings`` raised to the longest prompt plus the longest
swept response where it is shorter (the tiny model's 256; RoPE has no weights, so nothing else changes). Each point:
configs/cpu_default.yaml's prompts, 2 prompts x 4 samples a step, one mini-batch, micro-batches of 4 sequences (ours:
token budgets of 4 x (16 + length), as the large shape), lr 1e-6, and every response exactly the point's length on
both sides (ours ``rollout.min_response_tokens`` = ``rollout.max_response_tokens``; TRL ``min_new_tokens``), so the
work is exact. A point whose measured response lengths differ from its length is refused.

Steps: 3 a run by default (``--steps``, at least 3): the step time is the median from step 3, so a point's time is
its one steady step (steps 1 and 2 carry the one-time costs). One run per side per point, the side that goes first
alternating from point to point (``order``). A point is recorded with both step times, ours / TRL, both sides'
parts, peak PSS and measured mean response length.

Order and budget: points run smallest work first (parameters x (prompt + response tokens)); once
``--sweep-budget-s`` seconds of wall time are spent, the points left are recorded as ``not run``. A point whose
estimated peak memory (``memory_estimate_gib``: our larger side, weights, gradients, Adam, the engine's copy, the
KV cache and one micro-batch's activations) exceeds ``--sweep-memory-gib`` (default: the memory available when it
would start) is ``skipped`` with the reason, and so is a point whose export or runs fail: the sweep goes on.

Output: the table (a row per model, a column per length: ours s / TRL s / ours / TRL), the JSON
``<--json-dir>/bench_peer_sweep.json`` (the machine, the settings, every point; no process-tree samples) and the plot
(benchmarks/peer_plot.py, ``--plot``; redrawn from the JSON alone with ``--plot-only``).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import psutil
from peer_plot import plot_sweep  # benchmarks/ (on sys.path wherever this is imported)
from peer_report import machine_info, machine_line
from peer_runs import ROOT, export_model, peer_spec, run_config, run_ours, run_trl

MODELS = {"tiny": "configs/models/tiny-qwen2.json", "30m": "configs/models/bench-qwen2-30m.json",
          "100m": "configs/models/bench-qwen2-100m.json", "0.5b": "configs/models/bench-qwen2-0.5b.json"}
RECIPE = "configs/cpu_default.yaml"
PROMPT_TOKENS = 16  # the recipe's data.max_prompt_tokens
PROMPTS, GROUP, MICRO, LR = 2, 4, 4, 1e-6
BASE_GIB = 1.5  # a run's processes before the model: Python, torch, vLLM, Megatron, reward workers (CPU default)


def add_options(parser) -> None:
    parser.add_argument("--sweep", action="store_true", help="step time against response length x model size")
    parser.add_argument("--sweep-lengths", default="16,64,256,1024", help="response lengths, tokens")
    parser.add_argument("--sweep-models", default=",".join(MODELS), help=f"models, of {', '.join(MODELS)}")
    parser.add_argument("--sweep-budget-s", type=float, default=None,
                        help="wall seconds for the sweep; the points left then are recorded as not run")
    parser.add_argument("--sweep-memory-gib", type=float, default=None,
                        help="skip points estimated to need more (default: the memory available at the point)")


def check_options(args) -> None:
    """The sweep's options parsed in place (``sweep_lengths``, ``sweep_models`` become lists); a bad one raises
    ValueError with the reason."""
    try:
        args.sweep_lengths = [int(x) for x in str(args.sweep_lengths).split(",")]
    except ValueError:
        raise ValueError(f"--sweep-lengths: comma-separated integers, got {args.sweep_lengths!r}") from None
    if min(args.sweep_lengths) < 1:
        raise ValueError(f"--sweep-lengths must be >= 1, got {args.sweep_lengths}")
    args.sweep_models = str(args.sweep_models).split(",")
    unknown = [m for m in args.sweep_models if m not in MODELS]
    if unknown:
        raise ValueError(f"--sweep-models: unknown {', '.join(unknown)} (known: {', '.join(MODELS)})")
    if args.sweep_budget_s is not None and args.sweep_budget_s <= 0:
        raise ValueError(f"--sweep-budget-s must be > 0, got {args.sweep_budget_s}")
    if args.sweep and args.steps is not None and args.steps < 3:
        raise ValueError("--steps must be >= 3 for the sweep (the step time is the median from step 3)")


def model_params(cfg: dict) -> int:
    """A Qwen2 config's parameters: embeddings (and an untied output layer), attention with q/k/v biases, the
    gated MLP and the norms."""
    h, ffn, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    attention = h * heads * head_dim * 2 + 2 * h * kv * head_dim + (heads + 2 * kv) * head_dim
    layer = attention + 3 * h * ffn + 2 * h
    embeddings = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return cfg["num_hidden_layers"] * layer + embeddings + h


def memory_estimate_gib(cfg: dict, length: int) -> float:
    """Our run's peak memory at a point, roughly (module docstring): fp32 weights, gradients, Adam's two moments and
    the engine's copy; the KV cache of the step's sequences; a micro-batch's activations kept for the backward
    (per token and layer about 10 hidden + 4 MLP values, and two attention rows of the sequence per head)."""
    seq = PROMPT_TOKENS + length
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    weights = 5 * 4 * model_params(cfg)
    kv_cache = PROMPTS * GROUP * seq * layers * cfg["num_key_value_heads"] * head_dim * 2 * 4
    per_token_layer = 10 * cfg["hidden_size"] + 4 * cfg["intermediate_size"] + 2 * heads * seq
    activations = MICRO * seq * layers * per_token_layer * 4
    return BASE_GIB + (weights + kv_cache + activations) / 2**30


def sweep_model_config(name: str, lengths: list[int], work: Path) -> Path:
    """The sweep's copy of a model's config: ``max_position_embeddings`` at least the longest sequence."""
    cfg = json.loads((ROOT / MODELS[name]).read_text())
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), PROMPT_TOKENS + max(lengths))
    path = work / "models" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2))
    return path


def plan_points(models: dict[str, dict], lengths: list[int]) -> list[dict]:
    """Every (model, length) point, smallest work first: parameters x (prompt + response tokens)."""
    points = [{"model": name, "length": length, "params": model_params(cfg),
               "work": model_params(cfg) * (PROMPT_TOKENS + length),
               "estimate_gib": round(memory_estimate_gib(cfg, length), 2)}
              for name, cfg in models.items() for length in lengths]
    return sorted(points, key=lambda p: (p["work"], p["length"]))


def setup_of(model_config: Path, length: int) -> dict:
    """A point's setup for peer_runs (recipe, the model and its export, the RL run's overrides)."""
    return {"recipe": RECIPE,
            "overrides": [f"model.config={model_config}", "trainer.sft_warmup_steps=0",
                          f"rollout.max_response_tokens={length}"],
            "rl": [f"rollout.min_response_tokens={length}", f"data.prompts_per_step={PROMPTS}",
                   f"trainer.mini_batch_prompts={PROMPTS}", f"dynamo.allocation.n_avg={GROUP}",
                   f"trainer.micro_batch_size={MICRO}", f"trainer.micro_batch_tokens={MICRO * (PROMPT_TOKENS + length)}",
                   f"optim.lr={LR}"]}


def length_mismatch(side: str, summary: dict, length: int) -> str | None:
    """Why a side's run does not count at a point of ``length`` (a step whose mean response length is another),
    else None."""
    wrong = [m for m in summary["response_lengths"] if abs(m - length) > 1e-9]
    if wrong:
        return (f"{side}'s responses are not all {length} tokens: mean response lengths per step "
                f"{', '.join(f'{m:g}' for m in summary['response_lengths'])}")
    return None


def measure_point(point: dict, index: int, args, work: Path) -> dict:
    """Both sides' runs at one point (the side that goes first alternates with ``index``); the point's fields."""
    model_dir = work / point["model"]
    config = sweep_model_config(point["model"], args.sweep_lengths, work)
    setup = setup_of(config, point["length"])
    exported = model_dir / "warm" / "hf" / "config.json"
    positions = json.loads(config.read_text())["max_position_embeddings"]
    if exported.is_file() and json.loads(exported.read_text())["max_position_embeddings"] != positions:
        shutil.rmtree(model_dir / "warm")  # exported by an earlier sweep here, for other lengths
    hf = export_model({**setup, "overrides": setup["overrides"][:2]}, model_dir)
    shutil.rmtree(model_dir / "warm" / "checkpoints", ignore_errors=True)  # the export is all the sweep needs
    steps = args.steps or 3
    _, run = run_config(setup, hf, steps)
    base = model_dir / f"len{point['length']}"
    summaries = {}
    order = ("ours", "trl") if index % 2 == 0 else ("trl", "ours")
    for side in order:
        out = base.with_name(f"{base.name}_{side}")
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        if side == "ours":
            summaries[side], _ = run_ours(setup, hf, steps, out, args.interval, pss_interval=args.pss_interval)
            shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the run's last step, saved: not needed
        else:
            summaries[side], _ = run_trl(peer_spec(run, hf, steps, out), out, args.interval, args.pss_interval)
        print(f"bench_peer: sweep {point['model']} {point['length']} {side}: step {summaries[side]['step_s']:.3f} s",
              flush=True)
    fields = {"order": list(order), "ours": summaries["ours"], "trl": summaries["trl"],
              "ratio": summaries["ours"]["step_s"] / summaries["trl"]["step_s"]}
    reasons = [r for side in ("ours", "trl") if (r := length_mismatch(side, summaries[side], point["length"]))]
    return {**fields, "status": "refused", "reason": "; ".join(reasons)} if reasons else {**fields, "status": "measured"}


def run_points(points: list[dict], measure, budget_s: float | None, memory_gib, clock=time.monotonic) -> list[dict]:
    """Each point in order, measured by ``measure(point, index)`` unless the budget is spent (``not run``), its
    estimate exceeds ``memory_gib()`` (``skipped``) or ``measure`` fails (``skipped``, with the error)."""
    start, results = clock(), []
    for index, point in enumerate(points):
        results.append({**point, **point_outcome(point, index, measure, budget_s - (clock() - start)
                                                 if budget_s is not None else None, memory_gib, clock)})
        if results[-1]["status"] != "measured":
            print(f"bench_peer: sweep {point['model']} {point['length']}: {results[-1]['status']}: "
                  f"{results[-1]['reason']}", flush=True)
    return results


def point_outcome(point: dict, index: int, measure, budget_left_s: float | None, memory_gib, clock) -> dict:
    """One point's fields (``run_points``)."""
    if budget_left_s is not None and budget_left_s <= 0:
        return {"status": "not run", "reason": "the sweep's budget was spent"}
    limit = memory_gib()
    if point["estimate_gib"] > limit:
        return {"status": "skipped",
                "reason": f"estimated {point['estimate_gib']:.1f} GiB of memory, {limit:.1f} GiB available"}
    began = clock()
    try:
        fields = measure(point, index)
    except Exception as exc:  # noqa: BLE001 - a failed point is recorded, the sweep goes on
        lines = str(exc).splitlines() or [""]
        fields = {"status": "skipped", "reason": f"{type(exc).__name__}: {lines[0]}", "detail": lines[1:]}
    return {**fields, "seconds": clock() - began}


def cell(point: dict) -> str:
    if point["status"] != "measured":
        return point["status"]
    return f"{point['ours']['step_s']:.3f} / {point['trl']['step_s']:.3f} / {point['ratio']:.2f}x"


def sweep_table(result: dict) -> str:
    """Markdown: a row per model, a column per length; each cell ours s / TRL s / ours / TRL, or the point's status
    (the reasons under the table)."""
    lengths = result["settings"]["lengths"]
    by_key = {(p["model"], p["length"]): p for p in result["points"]}
    lines = [f"### step time, ours / TRL: {PROMPTS} prompts x {GROUP}, responses of exactly the length, "
             f"{result['settings']['steps']} steps", ""]
    if result.get("machine"):
        lines += [machine_line(result["machine"]), ""]
    lines += ["| model | " + " | ".join(f"{n} tokens: ours s / TRL s / ratio" for n in lengths) + " |",
              "|---" * (len(lengths) + 1) + "|"]
    for model in result["settings"]["models"]:
        params = next(p["params"] for p in result["points"] if p["model"] == model)
        lines.append(f"| {model} ({params / 1e6:.0f}M) | "
                     + " | ".join(cell(by_key[(model, n)]) for n in lengths) + " |")
    reasons = [f"- {p['model']} x {p['length']}: {p['status']}: {p['reason']}" for p in result["points"]
               if p["status"] != "measured"]
    return "\n".join(lines + ([""] + reasons if reasons else []))


def run_sweep(args, work: Path) -> str:
    """The sweep (module docstring): its table, with where the JSON and the plot went."""
    work = work / "sweep"
    models = {m: json.loads((ROOT / MODELS[m]).read_text()) for m in args.sweep_models}
    points = plan_points(models, args.sweep_lengths)
    started = time.time()
    results = run_points(points, lambda point, index: measure_point(point, index, args, work), args.sweep_budget_s,
                         lambda: args.sweep_memory_gib or psutil.virtual_memory().available / 2**30)
    result = {"kind": "sweep", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
              "settings": {"lengths": args.sweep_lengths, "models": args.sweep_models, "steps": args.steps or 3,
                           "prompts": PROMPTS, "group": GROUP, "micro_batch": MICRO, "lr": LR, "recipe": RECIPE,
                           "budget_s": args.sweep_budget_s, "model_configs": {m: MODELS[m] for m in models}},
              "elapsed_s": time.time() - started, "points": results}
    result["table"] = sweep_table(result)
    out = Path(args.json_dir) / "bench_peer_sweep.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot = plot_sweep(result, args.plot)
    return result["table"] + f"\n\n(JSON: {out}; plot: {plot})"
