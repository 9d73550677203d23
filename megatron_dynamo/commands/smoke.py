"""Train a Qwen-shaped model in Megatron-Core for a few steps on fixed random tokens and print the loss per step.

The smallest end-to-end run of the stack (distributed runtime, CPU compatibility layer or GPU, model provider,
pipeline schedule, DDP, optimizer). Layouts with several ranks are spawned locally (gloo on CPU, NCCL on GPUs);
under torchrun/srun use --no-spawn. Example:

    dynamo smoke --config configs/models/tiny-qwen2.json --tp 2 --steps 10
"""

from __future__ import annotations

import time

import torch

from megatron_dynamo.parallel import runtime
from megatron_dynamo.parallel.spawn import run_on_ranks
from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="configs/models/tiny-qwen2.json",
                        help="HF config.json of the model (file or directory); random weights")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (ranks = tp x pp x dp)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="parameter dtype")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the tokens")
    parser.add_argument("--no-spawn", action="store_true",
                        help="do not spawn ranks: this process is one rank of a torchrun/srun launch")


def train_random_tokens(rank, world_size, tp, pp, config, dtype, steps, lr, micro_batches, mbs, seq_len, seed,
                        verbose=True):
    """One rank of the smoke run; returns {"losses" (last pipeline stage only), "step_seconds", "seconds",
    "tokens_per_step"}."""
    from megatron.core import tensor_parallel

    info = runtime.init_distributed(runtime.ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), seed=seed)
    actor = MegatronActor(config, dtype=dtype, optim=OptimConfig(lr=lr, weight_decay=0.0))
    g = torch.Generator().manual_seed(seed + info.dp_rank)
    tokens = torch.randint(0, actor.arch.vocab_size, (micro_batches, mbs, seq_len + 1), generator=g)
    batches = [{"input_ids": t[:, :-1].to(info.device), "labels": t[:, 1:].to(info.device)} for t in tokens]
    denominator = float(micro_batches * mbs * seq_len * info.dp_size)

    def loss_fn(logits, mb):
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), mb["labels"]).sum() / denominator
        return loss, {"loss": loss.detach()}

    losses, step_seconds, start = [], [], time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        results = actor.forward_backward(batches, loss_fn)
        result = actor.optimizer_step()
        step_seconds.append(time.perf_counter() - t0)
        if results:
            loss = sum(r["loss"] for r in results)
            if info.dp_size > 1:
                torch.distributed.all_reduce(loss, group=_dp_group())
            losses.append(loss.item())
            if verbose and info.tp_rank == 0 and info.dp_rank == 0:
                print(f"step {step + 1}/{steps}  loss {losses[-1]:.4f}  grad_norm {result.grad_norm:.3f}  "
                      f"{step_seconds[-1]:.2f}s", flush=True)
    return {"losses": losses, "step_seconds": step_seconds, "seconds": time.perf_counter() - start,
            "tokens_per_step": micro_batches * mbs * seq_len * info.dp_size}


def _dp_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def main(args) -> int:
    world = args.tp * args.pp * args.dp
    fn_args = (args.tp, args.pp, args.config, args.dtype, args.steps, args.lr, args.micro_batches,
               args.micro_batch_size, args.seq_len, args.seed)
    if args.no_spawn:
        results = [train_random_tokens(0, world, *fn_args)]
    else:
        results = run_on_ranks(train_random_tokens, world, *fn_args)
    losses = next(r["losses"] for r in reversed(results) if r["losses"])
    seconds = max(r["seconds"] for r in results)
    print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {seconds:.1f}s "
          f"({results[0]['tokens_per_step'] * args.steps / seconds:.0f} tokens/s, TP={args.tp} PP={args.pp} DP={args.dp})")
    return 0 if losses[-1] < losses[0] else 1
