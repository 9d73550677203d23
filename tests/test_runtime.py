"""Launcher detection, layout validation, the CPU compatibility layer, bf16 on CPU."""

import threading

import pytest
import torch

from megatron_dynamo.parallel.runtime import ParallelConfig, detect_launch, first_slurm_host


def test_torchrun_variables():
    info = detect_launch({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7",
                          "MASTER_PORT": "1234"})
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port, info.launcher) == \
        (3, 8, 1, "node7", 1234, "torchrun")


def test_slurm_variables():
    # What srun gives each task (SLURM_STEP_ID included: a task of a job step).
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
           "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu-a[017-018,020]"}
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.launcher) == \
        (9, 16, 1, "gpu-a017", "slurm")
    assert info.master_port == detect_launch(env).master_port == 24242
    # The batch script's own shell has the job's SLURM_PROCID/NTASKS but no step: one process, not rank 0 of 16.
    batch_shell = {k: v for k, v in env.items() if k != "SLURM_STEP_ID"}
    assert (detect_launch(batch_shell).world_size, detect_launch(batch_shell).launcher) == (1, "single")


def test_torchrun_variables_win_over_slurm():
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "9"}
    assert detect_launch(env).launcher == "torchrun"


def test_single_process_without_launcher():
    info = detect_launch({})
    assert (info.rank, info.world_size, info.launcher) == (0, 1, "single") and info.master_port > 0


@pytest.mark.parametrize("nodelist,first", [("n1", "n1"), ("n[3-5]", "n3"), ("a[01,07],b2", "a01"),
                                            ("gpu[10-11]-ib", "gpu10-ib"), ("x1,x2", "x1")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize("cfg,world,msg", [
    (ParallelConfig(tensor_parallel=0), 1, "tensor_parallel"),
    (ParallelConfig(tensor_parallel=2, pipeline_parallel=2), 6, "= 4 does not divide world size 6"),
    (ParallelConfig(sequence_parallel=True), 1, "sequence_parallel"),
    # Accepted before, and then trained on unsplit sequences in every context-parallel rank.
    (ParallelConfig(context_parallel=2), 2, "context_parallel > 1 is not supported yet"),
])
def test_bad_layouts_are_rejected(cfg, world, msg):
    with pytest.raises(ValueError, match=msg):
        cfg.validate(world)


def _cpu_compat_worker(rank, world_size):
    from megatron_dynamo.parallel import cpu_compat

    seen = {"installed": cpu_compat.install(),
            "factory": torch.zeros(2, device="cuda").device.type,
            "cuda()": torch.ones(1).cuda().device.type,
            "to": torch.ones(1).to("cuda:0").device.type,
            "type": torch.ones(1, dtype=torch.bfloat16).type()}

    def other_thread():
        seen["thread_before_install"] = cpu_compat.is_active()
        cpu_compat.install()
        seen["thread_device"] = torch.empty(1, device=torch.device("cuda", 0)).device.type

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    seen["fork_restores_outer_state"] = bool(torch.equal(outside, torch.get_rng_state()))
    with tracker.fork():
        b = torch.rand(3)
    seen["fork_advances_its_stream"] = not torch.equal(a, b)
    # Suspended for code that never names CUDA (vLLM's CPU engine), back after the block.
    with cpu_compat.suspended():
        try:
            torch.zeros(1, device="cuda")
            seen["suspended"] = "redirected"
        except (AssertionError, RuntimeError):
            seen["suspended"] = "off"
    seen["after_suspended"] = torch.zeros(1, device="cuda").device.type
    return seen


@pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is only installed without CUDA")
@pytest.mark.slow
def test_cpu_compat_redirects_cuda_in_every_thread():
    from multiproc import run_on_ranks

    # In a child process: the layer patches torch process-wide, which must not leak into other tests.
    (seen,) = run_on_ranks(_cpu_compat_worker, 1)
    assert seen == {"installed": True, "factory": "cpu", "cuda()": "cpu", "to": "cpu",
                    "type": "torch.cuda.BFloat16Tensor", "thread_before_install": False, "thread_device": "cpu",
                    "fork_restores_outer_state": True, "fork_advances_its_stream": True, "suspended": "off",
                    "after_suspended": "cpu"}


def _bf16_worker(rank, world_size, config):
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    actor = MegatronActor(config, dtype="bf16", optim=OptimConfig(lr=1e-3))
    ids = torch.randint(0, actor.arch.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def loss_fn(logits, mb):
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten())
        return loss, {"loss": loss.detach(), "dtype": str(logits.dtype)}

    losses = []
    for _ in range(3):
        losses.append(actor.forward_backward([batch], loss_fn)[0]["loss"].item())
        actor.optimizer_step()
    dtypes = {str(p.dtype) for _, p in actor.named_parameters()}
    return losses, dtypes


@pytest.mark.distributed
def test_bf16_trains_on_cpu():
    from hf_reference import TINY_QWEN3
    from multiproc import run_on_ranks

    (losses, dtypes), = run_on_ranks(_bf16_worker, 1, TINY_QWEN3)
    assert dtypes == {"torch.bfloat16"}
    assert losses[-1] < losses[0]
