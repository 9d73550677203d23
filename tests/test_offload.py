"""rollout.offload_training_state: Megatron's whole training state (parameters, DDP gradient buffers, Adam moments)
leaves the device for the rollout and comes back bit for bit, with every tensor object and view intact; a run with
it gives the losses of a run without it."""

from __future__ import annotations

import os

import pytest
import torch

from hf_reference import TINY_QWEN2

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _offload_worker(rank, world_size):
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig
    from megatron_dynamo.trainer.offload import HostOffload, training_state_tensors

    runtime.init_distributed(runtime.ParallelConfig(), seed=3)
    actor = MegatronActor(TINY_QWEN2, optim=OptimConfig(lr=1e-3))
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))

    def loss_fn(logits, mb):
        loss = logits.float().logsumexp(-1).mean()
        return loss, {"loss": loss.detach()}

    def train_step():
        results = actor.forward_backward([{"input_ids": ids}], loss_fn)
        actor.optimizer_step()
        return float(results[0]["loss"]) if results else 0.0

    train_step()  # Adam's moments exist from here on
    tensors = training_state_tensors(actor.chunks, actor.optimizer)
    before = [t.detach().clone() for t in tensors]
    offload = HostOffload(tensors)
    held = offload.nbytes
    offload.offload()
    offload.offload()  # idempotent
    emptied = all(t.untyped_storage().nbytes() == 0 for t in tensors if t.numel())
    offload.reload()
    offload.reload()
    restored = all(torch.equal(a, b) for a, b in zip(before, tensors))
    return {"held": held, "emptied": emptied, "restored": restored, "next_loss": train_step()}


@pytest.mark.slow
def test_offload_round_trip_keeps_every_byte_and_training_goes_on():
    from multiproc import run_on_ranks

    (out,) = run_on_ranks(_offload_worker, 1)
    params = sum(p.numel() * 4 for p in __import__("hf_reference").hf_model(TINY_QWEN2, seed=0).parameters())
    # parameters + gradient buffer + two Adam moments, all fp32: about four copies of the model
    assert out["held"] >= 3.5 * params, (out["held"], params)
    assert out["emptied"] and out["restored"], out
    assert torch.isfinite(torch.tensor(out["next_loss"]))


@pytest.mark.slow
def test_a_run_with_offload_equals_one_without(tmp_path):
    import json
    import subprocess
    import sys

    def run(name, *extra):
        out = tmp_path / name
        cmd = [sys.executable, "-m", "megatron_dynamo.cli", "train", os.path.join(REPO, "configs", "cpu_default.yaml"),
               f"trainer.output_dir={out}", "trainer.steps=2", "trainer.sft_warmup_steps=5", "data.prompts_per_step=8",
               "trainer.mini_batch_prompts=4", "data.synthetic_problems=16", "logging.tensorboard=false",
               "logging.plot=false", "logging.rollouts=true", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return rows, (out / "rollouts.jsonl").read_text()

    plain, plain_rollouts = run("plain")
    offloaded, offloaded_rollouts = run("offload", "rollout.offload_training_state=true")
    assert offloaded_rollouts == plain_rollouts
    for a, b in zip(plain, offloaded):
        for key in ("loss", "grad_norm", "entropy_mean", "reward_mean"):
            assert a[key] == b[key], key
