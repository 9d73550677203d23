"""The Qwen model in Megatron-Core on CPU (gloo): layouts agree, DP agrees, training lowers the loss, HF parity."""

import pytest
import torch

from hf_reference import TINY_QWEN2, TINY_QWEN3, hf_model, hf_state_dict
from multiproc import run_on_ranks

BATCH, SEQ = 4, 24


def make_batch(vocab: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (BATCH, SEQ + 1), generator=g)
    mask = torch.ones(BATCH, SEQ)
    mask[1, 15:] = 0  # a shorter sequence: its tail must not count
    mask[3, :5] = 0  # prompt tokens excluded from the loss
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask}


def token_mean_lm_loss(denominator: float):
    """Next-token cross-entropy summed over the micro-batch and divided by the global token count."""
    from megatron.core import tensor_parallel

    def loss_fn(logits, mb):
        per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), mb["labels"])
        loss = (per_token * mb["loss_mask"]).sum() / denominator
        full = tensor_parallel.gather_from_tensor_model_parallel_region(logits.detach())
        return loss, {"loss": loss.detach(), "logits": full}

    return loss_fn


def _layout_worker(rank, world_size, tp, pp, config, steps, dtype="fp32"):
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    info = runtime.init_distributed(runtime.ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), seed=0)
    state = hf_state_dict(config)
    actor = MegatronActor(config, dtype=dtype, optim=OptimConfig(lr=1e-3, weight_decay=0.0, clip_grad=0.0),
                          hf_weights=state.__getitem__)
    batch = make_batch(actor.arch.vocab_size)
    loss_fn = token_mean_lm_loss(batch["loss_mask"].sum().item())
    # Two micro-batches of two sequences each exercise the schedule's accumulation.
    micro = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]
    losses, logits = [], None
    for step in range(steps):
        results = actor.forward_backward(micro, loss_fn)
        if results:
            losses.append(sum(r["loss"] for r in results).item())
            if step == 0:
                logits = torch.cat([r["logits"] for r in results])
        actor.optimizer_step()
    return {"pp_rank": info.pp_rank, "losses": losses, "logits": logits}


def _last_stage(results):
    return [r for r in results if r["logits"] is not None][-1]


@pytest.fixture(scope="module")
def tp1_reference():
    return _last_stage(run_on_ranks(_layout_worker, 1, 1, 1, TINY_QWEN2, 4))


@pytest.mark.distributed
def test_tp1_matches_hf_transformers(tp1_reference):
    batch = make_batch(128)
    with torch.no_grad():
        ref = hf_model(TINY_QWEN2)(input_ids=batch["input_ids"]).logits
    assert (tp1_reference["logits"] - ref).abs().max().item() <= 1e-4


@pytest.mark.distributed
def test_training_steps_lower_the_loss(tp1_reference):
    losses = tp1_reference["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


@pytest.mark.distributed
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_layouts_give_same_logits_and_loss(tp1_reference, tp, pp):
    other = _last_stage(run_on_ranks(_layout_worker, tp * pp, tp, pp, TINY_QWEN2, 4))
    assert (other["logits"] - tp1_reference["logits"]).abs().max().item() <= 1e-5
    # The first loss is the same forward; later ones also check that the optimizer updates agree.
    assert other["losses"][0] == pytest.approx(tp1_reference["losses"][0], abs=1e-5)
    assert other["losses"] == pytest.approx(tp1_reference["losses"], abs=1e-4)


def _dp_grad_worker(rank, world_size, config):
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    info = runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    actor = MegatronActor(config, optim=OptimConfig(lr=1e-3), hf_weights=hf_state_dict(config).__getitem__)
    batch = make_batch(actor.arch.vocab_size)
    loss_fn = token_mean_lm_loss(batch["loss_mask"].sum().item())
    per_rank = BATCH // info.dp_size
    shard = {k: v[info.dp_rank * per_rank:(info.dp_rank + 1) * per_rank] for k, v in batch.items()}
    actor.forward_backward([shard], loss_fn)
    return {name: p.main_grad.clone() for name, p in actor.named_parameters()}


@pytest.mark.distributed
def test_dp2_gradients_equal_dp1():
    (dp1,) = run_on_ranks(_dp_grad_worker, 1, TINY_QWEN2)
    dp2 = run_on_ranks(_dp_grad_worker, 2, TINY_QWEN2)
    for name, grad in dp1.items():
        assert grad.abs().max() > 0, name
        for rank in range(2):
            torch.testing.assert_close(dp2[rank][name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.distributed
def test_qwen3_runs_at_tp2_and_matches_hf():
    result = _last_stage(run_on_ranks(_layout_worker, 2, 2, 1, TINY_QWEN3, 2))
    batch = make_batch(128)
    with torch.no_grad():
        ref = hf_model(TINY_QWEN3)(input_ids=batch["input_ids"]).logits
    assert (result["logits"] - ref).abs().max().item() <= 1e-4
    assert result["losses"][1] < result["losses"][0]


def _recompute_grad_worker(rank, world_size, config, tp):
    from megatron_dynamo.models.qwen import RECOMPUTE_MODES, recompute_kwargs
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    runtime.init_distributed(runtime.ParallelConfig(tensor_parallel=tp), seed=0)
    state = hf_state_dict(config)
    grads = {}
    for mode in RECOMPUTE_MODES:
        actor = MegatronActor(config, optim=OptimConfig(lr=1e-3), hf_weights=state.__getitem__,
                              **recompute_kwargs(mode))
        batch = make_batch(actor.arch.vocab_size)
        results = actor.forward_backward([batch], token_mean_lm_loss(batch["loss_mask"].sum().item()))
        grads[mode] = ({name: p.main_grad.clone() for name, p in actor.named_parameters()},
                       sum(r["loss"] for r in results).item())
    return grads


@pytest.mark.distributed
def test_recompute_gives_the_same_loss_and_gradients():
    """trainer.recompute (selective: the core attention; full: every layer from its input) reruns the forward in the
    backward: the loss and every gradient equal those of keeping the activations, at TP 1 and TP 2."""
    for tp in (1, 2):
        for grads in run_on_ranks(_recompute_grad_worker, tp, TINY_QWEN2, tp):
            kept, loss = grads["off"]
            for mode in ("selective", "full"):
                assert grads[mode][1] == loss, (tp, mode)
                for name, grad in kept.items():
                    assert grad.abs().max() > 0, name
                    torch.testing.assert_close(grads[mode][0][name], grad, rtol=0, atol=0, msg=(tp, mode, name))
