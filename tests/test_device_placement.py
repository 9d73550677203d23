"""Tensors on the device the model lives on, without a GPU: the placement check itself, then real training runs
under it (SFT warm-up, rollout, old log-probs, modulation scope, update, checkpoint, weight sync) at TP=2 with
sequence parallelism, PP=2 and DP=2; sequence parallelism gives the gradients of plain tensor parallelism; a
non-finite gradient leaves weights and optimizer state untouched on every rank."""

import os

import pytest
import torch

from hf_reference import REPO
from multiproc import run_on_ranks

CPU_DEFAULT = os.path.join(REPO, "configs", "cpu_default.yaml")


# ---------------------------------------------------------------------------------------------- the check itself
def _check_worker(rank, world_size):
    import torch.distributed as dist

    from megatron_dynamo.parallel import device_check, runtime

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    found = {}
    with device_check.simulated_gpu_placement():
        device = runtime.current_device()
        on_device = torch.ones(3, device=device)
        follows = torch.zeros(2, device=on_device.device)  # t.device of a device tensor is the device
        host = torch.ones(3)
        found["device"] = (str(device), device_check.place(on_device), device_check.place(follows),
                           device_check.place(host), device_check.place(host.to(device)),
                           device_check.place(on_device.cpu()), device_check.place(on_device * 2 + 1))
        for name, fn in {
            "mix": lambda: on_device + host,
            "collective": lambda: dist.all_reduce(torch.tensor([1.0])),
            "numpy": lambda: on_device.numpy(),
            "index_put": lambda: on_device.__setitem__(torch.tensor([0, 1]), torch.ones(2)),
        }.items():
            try:
                fn()
                found[name] = None
            except device_check.DevicePlacementError as exc:
                found[name] = str(exc)
        # What CUDA allows: scalars, CPU indices, copies, object collectives, device tensors in collectives.
        allowed = on_device + torch.tensor(2.0)
        allowed = allowed[torch.tensor([0, 2])]
        on_device[0:2] = torch.ones(2)
        on_device.copy_(host)
        dist.all_reduce(allowed)
        box = [{"a": 1}]
        dist.broadcast_object_list(box, src=0)
    dist.all_reduce(torch.tensor([1.0]))  # outside the mode, nothing is checked
    return found


@pytest.mark.distributed
def test_placement_check_flags_what_cuda_refuses():
    out = run_on_ranks(_check_worker, 2)[0]
    assert out["device"] == ("cuda:0", "device", "device", "host", "device", "host", "device")
    assert "mixes device tensors with a host tensor (3,)" in out["mix"]
    assert "all_reduce got a host tensor (1,)" in out["collective"]
    assert "numpy() of a device tensor" in out["numpy"]
    assert out["index_put"] is not None


# ---------------------------------------------------------------------------------------------- training steps
def _trainer_worker(rank, world_size, output_dir, overrides):
    from megatron_dynamo.parallel import device_check
    from megatron_dynamo.trainer.config import load_run_config
    from megatron_dynamo.trainer.trainer import Trainer

    run = load_run_config(CPU_DEFAULT, [f"trainer.output_dir={output_dir}", "trainer.sft_warmup_steps=2",
                                        "trainer.steps=1", "data.prompts_per_step=8", "trainer.mini_batch_prompts=4",
                                        "trainer.micro_batch_size=4", "trainer.micro_batch_tokens=0",
                                        "dynamo.allocation.n_avg=4",
                                        "dynamo.allocation.n_min=2", "dynamo.allocation.n_max=6",
                                        "logging.tensorboard=false", "logging.plot=false", *overrides])
    from megatron_dynamo.parallel import runtime

    runtime.init_distributed(run.parallel, seed=run.trainer.seed)
    with device_check.simulated_gpu_placement():
        trainer = Trainer(run)
        try:
            history = trainer.train()
            params = {n: device_check.place(p) for n, p in trainer.actor.named_parameters()}
        finally:
            trainer.close()
    return {"metrics": history[-1] if history else None, "param_places": sorted(set(params.values()))}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", [["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"],
                                    pytest.param(["parallel.pipeline_parallel=2"], marks=pytest.mark.extended)],
                         ids=["tp2-sp", "pp2"])
def test_training_steps_keep_tensors_on_the_model_device(tmp_path, layout):
    results = run_on_ranks(_trainer_worker, 2, str(tmp_path / "run"), layout)
    metrics = results[0]["metrics"]
    assert metrics is not None and metrics["optimizer_steps"] == 2 and metrics["loss"] == metrics["loss"]
    assert all(r["param_places"] == ["device"] for r in results)
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "trainer_state.json").is_file()


def _dp_worker(rank, world_size, output_dir):
    return _trainer_worker(rank, world_size, output_dir, [])


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_step_keeps_tensors_on_the_model_device(tmp_path):
    # DP=2: the modulation scope and the loss checks are reduced over ranks; a rank may get fewer samples.
    results = run_on_ranks(_dp_worker, 2, str(tmp_path / "run"))
    assert results[0]["metrics"]["optimizer_steps"] == 2


# ---------------------------------------------------------------------------------------------- sequence parallel
def _sp_worker(rank, world_size, config, sequence_parallel, seq_len):
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig
    from megatron_dynamo.trainer.batch import Sample, make_micro_batches

    from hf_reference import hf_state_dict

    runtime.init_distributed(runtime.ParallelConfig(tensor_parallel=2, sequence_parallel=sequence_parallel), seed=0)
    state = hf_state_dict(config)
    actor = MegatronActor(config, optim=OptimConfig(lr=1e-3, clip_grad=0.0), hf_weights=state.__getitem__,
                          sequence_parallel=sequence_parallel)
    gen = torch.Generator().manual_seed(0)
    samples = [Sample(i, f"p{i}", tuple(torch.randint(0, 100, (3 + i,), generator=gen).tolist()),
                      tuple(torch.randint(0, 100, (seq_len - 4 - 2 * i,), generator=gen).tolist()), 1.0, 1.0)
               for i in range(3)]
    micro = make_micro_batches(samples, 2, 0, fixed_shape=False, seq_multiple=actor.sequence_multiple)

    def loss_fn(logits, mb):
        from megatron.core import tensor_parallel

        token_loss = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), mb.labels)
        loss = (token_loss * mb.loss_mask).sum() / 100.0
        return loss, {"loss": loss.detach(), "logits_sum": logits.detach().double().sum()}

    results = actor.forward_backward(micro, loss_fn)
    # After finalize_model_grads: the norms' gradients are summed over the TP ranks' sequence slices under SP.
    grads = {n: p.main_grad.detach().clone() for n, p in actor.named_parameters()}
    stepped = actor.optimizer_step().update_successful
    return {"shapes": [tuple(mb.input_ids.shape) for mb in micro], "loss": [float(r["loss"]) for r in results],
            "grads": grads, "stepped": stepped}


@pytest.mark.extended
@pytest.mark.distributed
def test_sequence_parallel_equals_plain_tensor_parallel():
    from hf_reference import TINY_QWEN2

    # The longest sequence has 15 input tokens: sequence parallelism pads micro-batches to a multiple of TP=2.
    plain = run_on_ranks(_sp_worker, 2, TINY_QWEN2, False, 17)
    sp = run_on_ranks(_sp_worker, 2, TINY_QWEN2, True, 17)
    assert [s[1] for s in plain[0]["shapes"]] == [15, 15] and [s[1] for s in sp[0]["shapes"]] == [16, 16]
    for rank in range(2):
        assert sp[rank]["loss"] == pytest.approx(plain[rank]["loss"], rel=1e-5)
        for name, grad in plain[rank]["grads"].items():
            # Summation order differs (reduce-scatter vs all-reduce): tolerance relative to the gradient's scale.
            torch.testing.assert_close(sp[rank]["grads"][name], grad, rtol=1e-4, atol=1e-4 * float(grad.abs().max()),
                                       msg=name)
        assert sp[rank]["stepped"] and plain[rank]["stepped"]


# ---------------------------------------------------------------------------------------------- non-finite gradients
def _nan_grad_worker(rank, world_size, config):
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)  # DP=2
    actor = MegatronActor(config, optim=OptimConfig(lr=1e-2, clip_grad=1.0))
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(rank))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def loss_fn(logits, mb):
        from megatron.core import tensor_parallel

        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), mb["labels"]).sum() / 32.0
        return loss, {"loss": loss.detach()}

    def snapshot():
        params = {n: p.detach().clone() for n, p in actor.named_parameters()}
        state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                 for s in actor.optimizer.optimizer.state.values()]
        return params, state

    actor.forward_backward([batch], loss_fn)
    first = actor.optimizer_step()  # a good step first, so that Adam has state to protect
    before, state_before = snapshot()
    actor.forward_backward([batch], loss_fn)
    if rank == 1:  # one rank's gradient goes bad after the DP all-reduce: every rank must skip together
        next(p for _, p in actor.named_parameters()).main_grad.view(-1)[3] = float("nan")
    skipped = actor.optimizer_step()
    after, state_after = snapshot()
    unchanged = all(torch.equal(before[n], after[n]) for n in before) and all(
        all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)
        for a, b in zip(state_before, state_after))
    actor.forward_backward([batch], loss_fn)
    again = actor.optimizer_step()  # the zeroed gradient buffers train on
    changed = any(not torch.equal(after[n], p) for n, p in actor.named_parameters())
    return {"first": first.update_successful, "skipped": skipped.update_successful, "unchanged": unchanged,
            "again": again.update_successful, "changed": changed}


@pytest.mark.distributed
def test_a_non_finite_gradient_leaves_weights_and_optimizer_state_unchanged():
    from hf_reference import TINY_QWEN2

    for out in run_on_ranks(_nan_grad_worker, 2, TINY_QWEN2):
        assert out == {"first": True, "skipped": False, "unchanged": True, "again": True, "changed": True}
