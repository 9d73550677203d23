"""Small random training samples shared by the tests that run the real actor (one helper instead of a copy per
test file): six responses of growing length over three prompts, rewards 0/1, advantages 1, 0.5, ..., -1.5; and
their micro-batches with old log-probs, ready for an update. Also the periodic-evaluation overrides the end-to-end
training tests share, and the engine-vs-Megatron log-prob comparison of the weight-sync tests."""

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


#: How far the engine's log-probs may lie from the Megatron actor's on the same weights (float32 on CPU), dense or
#: mixture of experts (tests/test_rollout.py, tests/test_moe_rollout.py).
LOGPROB_TOL = 1e-4


def megatron_logprobs(actor, responses) -> list[torch.Tensor]:
    """Teacher-forced log pi(response token | prefix) from the Megatron model (TP=1: full vocabulary)."""
    seqs = [list(r.prompt_token_ids) + list(r.token_ids) for r in responses]
    input_ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, :len(s)] = torch.tensor(s)

    def loss_fn(logits, mb):
        return logits.sum() * 0.0, {"logp": torch.log_softmax(logits.float(), dim=-1).detach()}

    (result,) = actor.forward_backward([{"input_ids": input_ids}], loss_fn, forward_only=True)
    logp = result["logp"]
    out = []
    for i, r in enumerate(responses):
        p = len(r.prompt_token_ids)
        positions = torch.arange(p - 1, p - 1 + len(r.token_ids))
        out.append(logp[i, positions, torch.tensor(r.token_ids)])
    return out


def max_logprob_error(actor, responses) -> float:
    """The largest |engine log-prob - Megatron log-prob| over the tokens of ``responses``."""
    reference = megatron_logprobs(actor, responses)
    return max(float((ref - torch.tensor(r.logprobs, dtype=torch.float32)).abs().max())
               for ref, r in zip(reference, responses))


def train_metrics(output_dir, *args: str, timeout: int = 900) -> list[dict]:
    """``dynamo train <args> trainer.output_dir=<output_dir>`` in a child process (must succeed) and the rows of
    its metrics.jsonl."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, "-m", "megatron_dynamo.cli", "train", *args, f"trainer.output_dir={output_dir}"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
