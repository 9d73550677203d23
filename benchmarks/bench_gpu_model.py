"""Step time of a Qwen-shaped model (random weights) in bf16 with the Transformer-Engine spec on one GPU.

    python benchmarks/bench_gpu_model.py [--config configs/models/qwen2.5-math-1.5b.json] [--seq-len 2048]

Prints forward+backward+optimizer seconds per step and tokens/s for the TE spec and, for comparison in the same
run, Megatron's local (pure PyTorch) spec (the local spec alone where Transformer Engine does not import). Needs
CUDA. scripts/gpu_check.sh (part model_1p5b) measures the same model at several sequence lengths with the
forward, backward and optimizer times apart.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dynamo.parallel.spawn import run_on_ranks  # noqa: E402


def _worker(rank, world_size, config, use_te, batch, seq_len, steps):
    from megatron.core import tensor_parallel

    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    actor = MegatronActor(config, dtype="bf16", optim=OptimConfig(lr=1e-6), use_te=use_te)
    ids = torch.randint(0, actor.arch.vocab_size, (batch, seq_len + 1), device="cuda")
    mb = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def loss_fn(logits, m):
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), m["labels"]).mean()
        return loss, {}

    for _ in range(2):  # warm-up
        actor.forward_backward([mb], loss_fn)
        actor.optimizer_step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        actor.forward_backward([mb], loss_fn)
        actor.optimizer_step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    return {"s_per_step": seconds, "tokens_per_s": batch * seq_len / seconds,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "gpu": torch.cuda.get_device_name()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/models/qwen2.5-math-1.5b.json", help="HF config.json")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    from megatron_dynamo.models.qwen import te_available

    specs = (True, False) if te_available() else (False,)
    if len(specs) == 1:
        print("Transformer Engine does not import here: measuring the local spec only")
    rows = []
    for use_te in specs:
        (r,) = run_on_ranks(_worker, 1, args.config, use_te, args.batch, args.seq_len, args.steps)
        rows.append(("transformer-engine" if use_te else "local", r))
    print(f"\n{args.config}, bf16, {args.batch}x{args.seq_len} tokens/step, {rows[0][1]['gpu']}")
    print(f"{'spec':<20}{'s/step':>10}{'tokens/s':>12}{'peak GiB':>10}{'vs local':>10}")
    base = rows[-1][1]["tokens_per_s"]
    for name, r in rows:
        print(f"{name:<20}{r['s_per_step']:>10.3f}{r['tokens_per_s']:>12.0f}{r['peak_gib']:>10.1f}"
              f"{r['tokens_per_s'] / base:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
