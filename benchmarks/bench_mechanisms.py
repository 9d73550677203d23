"""How much room each DynaMO mechanism has on a task, measured directly at a fixed policy (issue 26).

One command, on a warmed-up checkpoint (e.g. the SFT start of ``dynamo ablate configs/cpu_testbed.yaml``):

    python benchmarks/bench_mechanisms.py --checkpoint OUT/sft/seed1234/checkpoints/step_000000 \\
        [--recipe configs/cpu_testbed.yaml] [--runs OUT/runs/dynamo/seed1 OUT/runs/grpo/seed1 ...] [--json FILE]

The policy is sampled with Hugging Face ``generate`` (temperature and top-p of the recipe) and scored with the
trainer's reward (math-verify); per-token statistics come from a forward pass of the same model.

1. **Difficulty mix** (held-out split of the recipe, ``--n`` samples a problem): pass@1, pass@k up to k = n, the
   share of problems with pass rate 0 or 1 at n samples, pass@1 per level.
2. **Per-token entropy** of those responses: within each response the 10th / 50th / 90th percentile of H_t,
   averaged over responses (how much entropy varies *inside* a response), the pooled percentiles, and the mean H_t
   of decision tokens (the first token of a line) against the others.
3. **GC / UMS factors** (eqs. 3-4, ``algorithms.modulation``) on one step of the recipe (``prompts_per_step``
   training prompts x ``n_avg`` responses, GRPO advantages, on-policy ratio 1): p10 / p50 / p90 of beta_comp over
   tokens with A > 0 and of beta_stab over all tokens. Factors pinned at their caps have no room.
4. **DRA, predicted** (eq. 23): P_i = the unbiased p(1-p) of each training prompt from a pool of ``--pool``
   samples; steps of ``prompts_per_step`` random prompts; the allocator's counts (n_avg, [n_min, n_max], power 1
   and 0.5) and ``predicted_variance_ratio``; mean over ``--trials`` steps.
5. **DRA, realised** by resampling at the fixed policy: the same steps, each prompt's n_i responses drawn with
   replacement from its pool, GRPO advantages, the gradient estimate g = (1/B) sum_ij A_ij grad log pi(y_ij) with
   every response's gradient count-sketched to ``--sketch`` dimensions (random bucket and sign per parameter, which
   keeps squared norms in expectation). Reported for uniform n_avg and allocated counts at the same budget:
   tr Cov(g), |E g|^2, their ratio (noise to signal), the eq. 23 quantity sum_i Var(mean reward_i) measured
   over the resamples, and the share of zero-advantage groups.
6. ``--runs``: each run's ``entropy_mean`` trajectory (first, middle, last step), modulation p10 / p90 of the
   factor product, held-out pass@k of its final row, and rollouts to ``--threshold`` (trailing 5-step reward mean).

Prints tables and writes everything to ``--json``. CPU, numpy + torch; no vLLM (the engine is not needed for a
fixed policy). A few minutes on 2 cores at the defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_dynamo.algorithms import allocate_rollouts, predicted_variance_ratio  # noqa: E402
from megatron_dynamo.algorithms.advantages import group_advantages  # noqa: E402
from megatron_dynamo.algorithms.config import ModulationConfig  # noqa: E402
from megatron_dynamo.algorithms.modulation import (ModulationInputs, modulation_factors,  # noqa: E402
                                                   modulation_scope)
from megatron_dynamo.data.dataset import GENERATED_TASKS, generated_test_split  # noqa: E402
from megatron_dynamo.data.templates import render  # noqa: E402
from megatron_dynamo.eval.passk import mean_pass_at_k  # noqa: E402


def load_policy(checkpoint: str, work_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dynamo.eval.model_source import prepare_model

    source = prepare_model(checkpoint, work_dir)
    model = AutoModelForCausalLM.from_pretrained(source.hf_dir, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(source.hf_dir)


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], n: int, max_new: int, temperature: float, top_p: float,
           seed: int, batch: int = 256) -> list[list[int]]:
    """``n`` sampled responses (token ids, without EOS and padding) per prompt, prompt-major."""
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    flat = [p for p in prompts for _ in range(n)]
    out: list[list[int]] = []
    for start in range(0, len(flat), batch):
        chunk = flat[start:start + batch]
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in chunk]
        width = max(map(len, ids))
        input_ids = torch.tensor([[eos] * (width - len(x)) + x for x in ids])  # left padding
        attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        generated = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True,
                                   temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=max_new,
                                   eos_token_id=eos, pad_token_id=eos)[:, width:].tolist()
        for row in generated:
            out.append(row[:row.index(eos)] if eos in row else row)
    return out


def token_stats(model, tokenizer, prompt_ids: list[list[int]], responses: list[list[int]], temperature: float,
                batch: int = 128, grads: bool = False, sketch: tuple | None = None):
    """Per response: (entropy, logp, sum_pi2_lambda) tensors over its tokens (+ EOS), and, with ``grads``, the
    count-sketch of grad sum_t log pi(y_t)."""
    eos = tokenizer.eos_token_id
    stats, sketches = [], []
    if grads:
        params = [p for p in model.parameters() if p.requires_grad]
        buckets, signs, dim = sketch
        for i, (p_ids, r_ids) in enumerate(zip(prompt_ids, responses)):
            seq = torch.tensor([p_ids + r_ids + [eos]])
            logits = model(seq).logits[0, len(p_ids) - 1:-1] / temperature
            logp = torch.log_softmax(logits.double(), -1).gather(1, seq[0, len(p_ids):, None])[:, 0].sum()
            model.zero_grad(set_to_none=True)
            logp.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params]).double()
            sketches.append(torch.zeros(dim, dtype=torch.float64).index_add_(0, buckets, signs * flat))
        return torch.stack(sketches)
    with torch.no_grad():
        for start in range(0, len(responses), batch):
            seqs = [p + r + [eos] for p, r in zip(prompt_ids[start:start + batch], responses[start:start + batch])]
            width = max(map(len, seqs))
            ids = torch.tensor([s + [eos] * (width - len(s)) for s in seqs])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
            logits = model(ids, attention_mask=mask).logits.double() / temperature
            logprobs = torch.log_softmax(logits, -1)
            probs = logprobs.exp()
            entropy = -(probs * logprobs).sum(-1)
            lam = (probs ** 2 * (logprobs + entropy[..., None])).sum(-1)
            for row, (p, r) in enumerate(zip(prompt_ids[start:start + batch], responses[start:start + batch])):
                positions = torch.arange(len(p) - 1, len(p) + len(r))  # predicting r_0 .. r_last, EOS
                targets = ids[row, positions + 1]
                stats.append((entropy[row, positions], logprobs[row, positions, targets], lam[row, positions]))
    return stats


def unbiased_p1p(c: np.ndarray, n: int) -> np.ndarray:
    return c * (n - c) / (n * (n - 1))


def percentiles(x, qs=(10, 50, 90)) -> list[float]:
    return [round(float(v), 4) for v in np.percentile(np.asarray(x, dtype=np.float64), qs)]


def run_summary(run_dir: Path, threshold: float, window: int = 5) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "entropy_mean" in r]
    entropy = [r["entropy_mean"] for r in rows]
    rewards = np.array([r.get("reward_mean", np.nan) for r in rows])
    rollouts = np.cumsum([r.get("rollouts", 0) for r in rows])
    reached = next((int(rollouts[i]) for i in range(len(rows))
                    if i + 1 >= window and np.nanmean(rewards[i + 1 - window:i + 1]) >= threshold), None)
    last = rows[-1] if rows else {}
    return {"steps": len(rows), "entropy_first_mid_last": [round(entropy[0], 4), round(entropy[len(entropy) // 2], 4),
                                                          round(entropy[-1], 4)] if entropy else None,
            "scale_p10_p90": [last.get("modulation/scale_p10"), last.get("modulation/scale_p90")],
            "eval": {k: v for k, v in last.items() if k.startswith("eval/avg/")},
            "rollouts_to_threshold": reached, "budget": int(rollouts[-1]) if len(rows) else 0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="the fixed policy: a run's checkpoint or an HF dir")
    parser.add_argument("--recipe", default=str(ROOT / "configs/cpu_testbed.yaml"), help="the task and settings")
    parser.add_argument("--n", type=int, default=16, help="samples per held-out problem (pass@k up to k = n)")
    parser.add_argument("--problems", type=int, default=500, help="held-out problems used (0: all)")
    parser.add_argument("--pool", type=int, default=24, help="samples per training prompt for the DRA measures")
    parser.add_argument("--grad-prompts", type=int, default=48, help="training prompts in the gradient resampling")
    parser.add_argument("--sketch", type=int, default=4096, help="count-sketch dimension of the gradients")
    parser.add_argument("--trials", type=int, default=2000, help="resampled steps for the DRA measures")
    parser.add_argument("--runs", nargs="*", default=[], help="run directories to summarise (metrics.jsonl)")
    parser.add_argument("--threshold", type=float, default=0.5, help="reward threshold for rollouts-to-threshold")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the measurements here")
    args = parser.parse_args(argv)
    for name in ("n", "pool", "grad_prompts", "sketch", "trials"):
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')} must be >= 2")
    recipe = yaml.safe_load(Path(args.recipe).read_text())
    data, rollout, dynamo = recipe["data"], recipe["rollout"], recipe["dynamo"]
    alloc = dynamo["allocation"]
    if args.pool < alloc["n_max"]:
        parser.error(f"--pool ({args.pool}) must be >= dynamo.allocation.n_max ({alloc['n_max']})")
    temperature, top_p, max_new = rollout["temperature"], rollout["top_p"], rollout["max_response_tokens"]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.time()
    from megatron_dynamo.reward import MathRewardScorer

    scorer = MathRewardScorer(num_workers=1)
    with tempfile.TemporaryDirectory() as work:
        model, tokenizer = load_policy(args.checkpoint, work)
    result: dict = {"checkpoint": args.checkpoint, "recipe": args.recipe}

    def score(examples, responses, n):
        texts = [tokenizer.decode(r) for r in responses]
        refs = [ex.answer for ex in examples for _ in range(n)]
        return np.array(scorer.score(texts, refs).rewards).reshape(len(examples), n) > 0, texts

    # 1-2: held-out mix and entropy
    bench = recipe["evaluation"]["benchmarks"][0]
    task = generated_test_split(bench)
    held_out = task.test()[:args.problems or None]
    prompts = [render(data["template"], ex.problem) for ex in held_out]
    responses = sample(model, tokenizer, prompts, args.n, max_new, temperature, top_p, args.seed)
    correct, texts = score(held_out, responses, args.n)
    counts = correct.sum(1)
    ks = sorted({1, *(k for k in (2, 4, 8, 16, 32, 64) if k <= args.n), args.n})
    levels = sorted({ex.extras.get("level") for ex in held_out})
    result["mix"] = {
        "problems": len(held_out), "n": args.n,
        "pass@k": {k: round(100 * mean_pass_at_k([(args.n, int(c)) for c in counts], k), 2) for k in ks},
        "share_pass_rate_0": round(float((counts == 0).mean()), 3),
        "share_pass_rate_1": round(float((counts == args.n).mean()), 3),
        "pass@1_by_level": {lv: round(100 * float(np.mean([c / args.n for c, ex in zip(counts, held_out)
                                                           if ex.extras.get("level") == lv])), 1) for lv in levels},
        "response_tokens_mean": round(float(np.mean([len(r) + 1 for r in responses])), 1)}
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts for _ in range(args.n)]
    first = list(range(0, len(responses), args.n))  # one response per problem for the entropy statistics
    stats = token_stats(model, tokenizer, [prompt_ids[i] for i in first], [responses[i] for i in first], temperature)
    within = np.array([percentiles(h.numpy()) for h, _, _ in stats])
    pooled = torch.cat([h for h, _, _ in stats]).numpy()
    decision, other = [], []
    for i, (h, _, _) in zip(first, stats):
        text = tokenizer.decode(responses[i]) + "\n"
        starts = {0} | {j + 1 for j, ch in enumerate(text[:-1]) if ch == "\n"}
        for j, value in enumerate(h.tolist()):
            (decision if j in starts else other).append(value)
    result["entropy"] = {
        "within_response_p10_p50_p90_mean": [round(float(v), 4) for v in within.mean(0)],
        "pooled_p10_p50_p90": percentiles(pooled), "mean": round(float(pooled.mean()), 4),
        "decision_tokens_mean": round(float(np.mean(decision)), 4),
        "other_tokens_mean": round(float(np.mean(other)), 4),
        "share_tokens_above_0.5_nats": round(float((pooled > 0.5).mean()), 4)}

    # 3-5: training prompts (one step for the factors; pools for DRA)
    train = GENERATED_TASKS[data["train"]].make(data["synthetic_problems"], data["seed"])
    rng = np.random.default_rng(args.seed)
    pool_examples = [train[int(i)] for i in rng.permutation(len(train))[:args.grad_prompts]]
    pool_prompts = [render(data["template"], ex.problem) for ex in pool_examples]
    pool = sample(model, tokenizer, pool_prompts, args.pool, max_new, temperature, top_p, args.seed + 1)
    pool_correct, _ = score(pool_examples, pool, args.pool)
    pool_c = pool_correct.sum(1)
    N, n_avg = data["prompts_per_step"], alloc["n_avg"]
    step = np.arange(N) if N <= len(pool_examples) else None
    if step is not None:  # one step: the first N pool prompts, the first n_avg samples each
        ids = [i * args.pool + j for i in step for j in range(n_avg)]
        rewards = torch.tensor(pool_correct[step, :n_avg].reshape(-1), dtype=torch.float64)
        adv = group_advantages(rewards, torch.arange(N).repeat_interleave(n_avg))
        p_ids = [tokenizer.encode(pool_prompts[i // args.pool], add_special_tokens=False) for i in ids]
        st = token_stats(model, tokenizer, p_ids, [pool[i] for i in ids], temperature)
        width = max(len(h) for h, _, _ in st)
        pad = lambda xs: torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in xs])  # noqa: E731
        mask = pad([torch.ones(len(h)) for h, _, _ in st]).bool()
        mod = dynamo["modulation"]
        cfg = ModulationConfig(**{k: v for k, v in mod.items() if k in ModulationConfig.__dataclass_fields__})
        inputs = ModulationInputs(advantages=adv[:, None].expand(-1, width) * mask, entropy=pad([s[0] for s in st]),
                                  mask=mask, logp=pad([s[1] for s in st]), sum_pi2_lambda=pad([s[2] for s in st]),
                                  ratio=torch.ones(len(st), width, dtype=torch.float64), clipped_mask=None)
        factors = modulation_factors(inputs, cfg, modulation_scope(inputs, cfg))
        positive = mask & (inputs.advantages > 0)
        result["modulation"] = {
            "tokens": int(mask.sum()), "positive_tokens": int(positive.sum()),
            "beta_comp_p10_p50_p90_pos": percentiles(factors.beta_comp[positive].numpy()) if positive.any() else None,
            "beta_comp_cap": 1 + cfg.alpha,
            "beta_stab_p10_p50_p90": percentiles(factors.beta_stab[mask].numpy())}
    P = unbiased_p1p(pool_c.astype(float), args.pool)
    p_hat = pool_c / args.pool
    lo, hi = alloc["n_min"], alloc["n_max"]
    batches = [rng.choice(len(pool_examples), N, replace=False) for _ in range(args.trials)]
    predicted = {}
    for power in (1.0, 0.5):
        predicted[power] = float(np.mean([predicted_variance_ratio(P[b], allocate_rollouts(P[b], N * n_avg, lo, hi,
                                                                                             power)) for b in batches]))
    result["dra_predicted"] = {"pool": args.pool, "prompts": len(pool_examples),
                               "share_P_zero": round(float((P == 0).mean()), 3),
                               "ratio_power1": round(predicted[1.0], 4), "ratio_power0.5": round(predicted[0.5], 4)}
    # 5: realised, by resampling responses from the pools
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    g = torch.Generator().manual_seed(args.seed)
    sketch = (torch.randint(0, args.sketch, (total,), generator=g),
              torch.randint(0, 2, (total,), generator=g).double() * 2 - 1, args.sketch)
    grad_ids = [tokenizer.encode(pool_prompts[i // args.pool], add_special_tokens=False)
                for i in range(len(pool))]
    grads = token_stats(model, tokenizer, grad_ids, pool, temperature, grads=True, sketch=sketch).numpy()
    grads = grads.reshape(len(pool_examples), args.pool, -1)
    realised = {}
    for name, power in (("uniform", None), ("power1", 1.0), ("power0.5", 0.5)):
        estimates, mean_var, zero = [], [], []
        for b in batches:
            n_i = np.full(N, n_avg) if power is None else allocate_rollouts(P[b], N * n_avg, lo, hi, power)
            total_g = np.zeros(grads.shape[-1])
            sq = 0.0
            for prompt, k in zip(b, n_i):
                pick = rng.integers(0, args.pool, int(k))
                r = pool_correct[prompt, pick].astype(float)
                a = (r - r.mean()) / (r.std(ddof=1) + 1e-6) if k > 1 else np.zeros(1)
                zero.append(r.min() == r.max())
                total_g += a @ grads[prompt, pick]
                sq += (r.mean() - p_hat[prompt]) ** 2
            estimates.append(total_g / (N * n_avg))
            mean_var.append(sq)
        est = np.array(estimates)
        cov = float(((est - est.mean(0)) ** 2).sum(1).mean())
        signal = float((est.mean(0) ** 2).sum())
        realised[name] = {"trace_cov": cov, "signal": signal, "noise_to_signal": cov / signal if signal else None,
                          "sum_var_group_mean": float(np.mean(mean_var)), "zero_adv_groups": float(np.mean(zero))}
    def ratio(a, b):  # None where uniform has nothing to compare with (e.g. every reward 0)
        return a / b if a is not None and b else None

    for name in ("power1", "power0.5"):
        for key, out in (("trace_cov", "ratio_trace_cov_vs_uniform"), ("sum_var_group_mean", "ratio_eq23_vs_uniform"),
                         ("noise_to_signal", "ratio_noise_to_signal_vs_uniform")):
            realised[name][out] = ratio(realised[name][key], realised["uniform"][key])
    result["dra_realised"] = realised
    result["runs"] = {run: run_summary(Path(run), args.threshold) for run in args.runs}
    result["seconds"] = round(time.time() - t0, 1)
    scorer.close()
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
