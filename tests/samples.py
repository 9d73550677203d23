"""Small random training samples shared by the tests that run the real actor (one helper instead of a copy per
test file): six responses of growing length over three prompts, rewards 0/1, advantages 1, 0.5, ..., -1.5; and
their micro-batches with old log-probs, ready for an update. Also the periodic-evaluation overrides the end-to-end
training tests share."""

import json
import os

import torch


def synthetic_eval_args(output_dir, n: int = 4, k=(2, 4)) -> list[str]:
    """Overrides for a periodic evaluation (before training and every 2 steps) on a JSONL benchmark of 8 synthetic
    problems, written into ``output_dir``."""
    from megatron_dynamo.data.synthetic import make_synthetic_task

    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "synthetic_eval.jsonl")
    with open(path, "w") as f:
        for ex in make_synthetic_task(16, seed=0)[:8]:
            f.write(json.dumps({"id": ex.id, "problem": ex.problem, "answer": ex.answer}) + "\n")
    return ["evaluation.every=2", "evaluation.at_start=true", f"evaluation.benchmarks=[{path}]", f"evaluation.n={n}",
            f"evaluation.k=[{','.join(str(x) for x in k)}]"]


def random_samples(vocab: int, seed: int, count: int = 6):
    """``count`` samples with token ids in [1, vocab): prompt i has 4 + i % 3 tokens, response i has 3 + 2 i."""
    from megatron_dynamo.trainer.batch import Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        prompt = tuple(torch.randint(1, vocab, (4 + i % 3,), generator=g).tolist())
        response = tuple(torch.randint(1, vocab, (3 + 2 * i,), generator=g).tolist())
        samples.append(Sample(i, f"p{i // 2}", prompt, response, reward=float(i % 2), advantage=1.0 - 0.5 * i))
    return samples


def perturbed_old_logp(stats: dict[int, dict[str, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Old log-probs a little off the current ones (``stats``: per sample index, the token stats' ``logp``), so that
    ratios differ from 1 and some tokens clip."""
    return {i: v["logp"] + 0.3 * torch.sin(torch.arange(v["logp"].numel()) + i) for i, v in stats.items()}


def micro_batches_with_old_logp(run, actor, samples, last_stage: bool = True):
    """The trainer's ``PolicyUpdater`` for ``run`` over ``actor``, its micro-batches of ``samples``, their
    token stats (the forward-only pass) and :func:`perturbed_old_logp` of them, scattered into the micro-batches as
    ``old_logp`` (zeros off the last pipeline stage, which has no logits). Returns (updater, micro, stats, old)."""
    from megatron_dynamo.trainer.batch import token_values
    from megatron_dynamo.trainer.update import PolicyUpdater

    updater = PolicyUpdater(run, actor, pad_token_id=0)
    micro = updater.micro_batches_for(samples)
    stats = updater.forward_token_stats(micro)
    old = perturbed_old_logp(stats)
    for mb in micro:
        mb.old_logp = token_values(mb, old if last_stage else None)
    return updater, micro, stats, old
