"""One entry that brings up torch.distributed and Megatron's parallel state, on GPU (NCCL) or CPU (gloo).

The launcher is read from the environment:
- torchrun / torch.distributed.run: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
- Slurm's srun (one task per GPU): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST (the first host
  is the rendezvous host unless MASTER_ADDR is set; the port defaults to one derived from the job id). Only a job
  step's task (srun sets SLURM_STEP_ID) is a rank: a batch script's shell has SLURM_PROCID=0 and the job's
  SLURM_NTASKS too, and a command run there directly is a single process;
- nothing: a single process (rank 0 of 1) on a free local port.
If torch.distributed is already initialised (a test harness, a launcher that did it), that group is used as is.
"""

from __future__ import annotations

import datetime
import os
import random
import re
import socket
import warnings
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist

from megatron_dynamo.parallel import cpu_compat, device_check
from megatron_dynamo.parallel.topology import (check_at_least_one, check_expert_layout,
                                               check_expert_tensor_parallel_on_cpu, check_model_parallel)


# megatron-core announces each missing optional accelerator package (apex, TE) at import; say it once in
# `dynamo info` instead of in every rank's log.
for _pattern in (".*Apex is not installed.*", ".*Transformer Engine and Apex are not installed.*",
                 ".*Transformer Engine is not installed.*"):
    warnings.filterwarnings("ignore", message=_pattern)


@dataclass(frozen=True)
class ParallelConfig:
    """The model-parallel layout. The data-parallel size is what is left: world size / (tp * pp * cp).

    Keys:
        tensor_parallel {>= 1}: ranks that split each layer (Megatron's TP).
        pipeline_parallel {>= 1}: ranks that split the layers into stages (PP).
        virtual_pipeline_parallel {>= 1}: model chunks per pipeline stage (interleaved schedule); null: one.
        context_parallel {1}: must stay 1: sequences are not split over context-parallel ranks yet.
        sequence_parallel: split the activations outside the tensor-parallel regions over the TP ranks (needs TP > 1).
        expert_parallel {>= 1}: mixture-of-experts models: ranks the experts of each MoE layer are divided over (EP);
            must divide the model's experts, and 1 for a dense model.
        expert_tensor_parallel {>= 1}: ranks that split each expert (Megatron's ETP; 1 without CUDA). The expert
            groups (expert_parallel x expert_tensor_parallel) must divide the training ranks of a pipeline stage.
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline_parallel: int | None = None
    context_parallel: int = 1
    sequence_parallel: bool = False
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1

    def validate(self, world_size: int | None = None) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel",
                     "expert_tensor_parallel"):
            check_at_least_one(f"parallel.{name}", getattr(self, name))
        if self.virtual_pipeline_parallel is not None:  # null: one model chunk per stage
            check_at_least_one("parallel.virtual_pipeline_parallel", self.virtual_pipeline_parallel)
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError("parallel.sequence_parallel needs tensor_parallel > 1")
        if self.context_parallel > 1:
            # Megatron would run, but on whole sequences in every CP rank's attention: wrong inputs, silently.
            raise ValueError("parallel.context_parallel > 1 is not supported yet (sequences are not split over "
                             "context-parallel ranks); use tensor/pipeline parallelism with sequence_parallel")
        if world_size is not None:
            check_model_parallel(world_size, self.tensor_parallel, self.pipeline_parallel, self.context_parallel)
            check_expert_layout(world_size, self.pipeline_parallel, self.expert_parallel, self.expert_tensor_parallel)


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


@dataclass(frozen=True)
class RuntimeInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    cp_size: int


def free_port() -> int:
    """A TCP port free on this host now (the kernel's pick): a rendezvous port for a job of this machine's own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm nodelist such as ``gpu[003-005,010],cpu01`` -> ``gpu003``."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    match = re.fullmatch(r"(.*?)\[([^\]]+)\](.*)", first)
    if not match:
        return first
    prefix, ranges, suffix = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


# What makes a process one rank of a launched job (torchrun's and torch elastic's variables, an srun task's).
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_ID", "SLURM_STEPID")


def launcher(env: Mapping[str, str] | None = None) -> str:
    """Who started this process as a rank: ``"torchrun"`` (RANK and WORLD_SIZE set: torchrun, or a launcher that
    sets the same), ``"slurm"`` (a task of an srun job step) or ``"single"`` (nobody: one process). The one test
    the trainer, ``dynamo eval`` and the checkpoint converter use."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        return "slurm"
    return "single"


def launched_externally(env: Mapping[str, str] | None = None) -> bool:
    """This process is a rank that torchrun or srun started (:func:`launcher` is not ``"single"``): the trainer,
    ``dynamo eval`` and the checkpoint converter then run as that rank instead of spawning their own."""
    return launcher(env) != "single"


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's index on its node: LOCAL_RANK (torchrun), else SLURM_LOCALID (srun), else 0. Never the
    global rank: from the second node on that names a GPU the node does not have."""
    env = os.environ if env is None else env
    return int(env.get("LOCAL_RANK") or env.get("SLURM_LOCALID") or 0)


def single_process_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) without the launcher variables: for a child process that must run as a
    single process of its own (the checkpoint converter), not take itself for a rank of this job."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k not in LAUNCH_VARIABLES}


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read rank, world size and rendezvous address from torchrun's, Slurm's, or no launcher's variables."""
    env = dict(os.environ if env is None else env)
    kind = launcher(env)
    if kind == "torchrun":
        return LaunchInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), local_rank(env),
                          env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)), "torchrun")
    if kind == "slurm":
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        addr = env.get("MASTER_ADDR") or first_slurm_host(nodelist)
        # Every task of the job must agree on the port without talking: derive it from the job id.
        port = int(env.get("MASTER_PORT") or 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        return LaunchInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), local_rank(env),
                          addr, port, "slurm")
    return LaunchInfo(0, 1, 0, "127.0.0.1", free_port(), "single")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch, and Megatron's tensor-parallel RNG tracker when parallel state is up.

    Every data-parallel replica gets the same seed (they hold the same model); the tracker gives each
    tensor-parallel rank its own stream for dropout inside model-parallel regions, as Megatron does.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_distributed(parallel: ParallelConfig = ParallelConfig(), seed: int = 1234,
                     backend: str | None = None, timeout_minutes: float = 30.0) -> RuntimeInfo:
    """Initialise torch.distributed (if needed) and Megatron's parallel state, install the CPU layer without
    CUDA, and seed every RNG. Safe to call again with another layout (the parallel state is rebuilt)."""
    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        check_expert_tensor_parallel_on_cpu(parallel.expert_tensor_parallel)
        cpu_compat.install()
    if not dist.is_initialized():
        launch = detect_launch()
        parallel.validate(launch.world_size)
        if use_cuda:
            torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
        dist.init_process_group(
            backend or ("nccl" if use_cuda else "gloo"), rank=launch.rank, world_size=launch.world_size,
            init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
            timeout=datetime.timedelta(minutes=timeout_minutes))
        node_rank = launch.local_rank
    else:
        parallel.validate(dist.get_world_size())
        node_rank = local_rank()

    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        # Explicit: Megatron's default (None) is the tensor-parallel size, which would split every expert over TP.
        expert_tensor_parallel_size=parallel.expert_tensor_parallel,
    )
    seed_everything(seed)
    device = current_device()
    return RuntimeInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=node_rank, device=device,
        backend=dist.get_backend(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        cp_size=parallel_state.get_context_parallel_world_size(),
    )


def current_device() -> torch.device:
    """The device this process trains on: its GPU, else the CPU (a simulated GPU inside
    :func:`megatron_dynamo.parallel.device_check.simulated_gpu_placement`). Model inputs and every tensor given to
    a collective of the training process groups live here."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())

    return device_check.SIMULATED_DEVICE if device_check.is_active() else torch.device("cpu")


def collective_device(group=None) -> torch.device:
    """Where a tensor for a collective over ``group`` must live: the training device for NCCL groups, the CPU for
    gloo groups (every group of a CPU run; a gloo side group on a GPU node)."""
    if "nccl" in str(dist.get_backend(group)) or device_check.is_active():
        return current_device()
    return torch.device("cpu")


def shutdown() -> None:
    """Tear down Megatron's parallel state and the default process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
