"""Training in this process's ranks, for ``dynamo train`` and the launch entry points (``launch.entry.train``):
under torchrun / srun this process is one rank (:func:`megatron_dynamo.parallel.runtime.launched_externally`);
otherwise it runs the job's ranks itself, spawning them when there are several.

The job's layout is resolved here, once (:func:`resolve_topology`: the launcher's world size or ``--nproc`` with the
run's ``parallel`` and ``rollout`` sections), and handed down to every rank."""

from __future__ import annotations

import logging
import os
import subprocess

import torch

from megatron_dynamo import heap, library_logs
from megatron_dynamo.models.local_linear import bound_primitive_cache
from megatron_dynamo.parallel.placement import JobGroups, join_job
from megatron_dynamo.parallel.process_guard import children_in_own_session, start_guard
from megatron_dynamo.parallel.runtime import detect_launch, launched_externally
from megatron_dynamo.parallel.spawn import run_on_ranks
from megatron_dynamo.parallel.stop_signals import STOP_SIGNALS, stop_on_signals
from megatron_dynamo.parallel.topology import JobTopology
from megatron_dynamo.trainer.engine_ranks import serve_engine_ranks
from megatron_dynamo.trainer.errors import RolloutError
from megatron_dynamo.trainer.trainer import Trainer, TrainingError


def job_world_size(run, nproc: int | None) -> int:
    """The job's ranks: the launcher's world size, else ``--nproc``, else tensor x pipeline parallel (plus the
    engine ranks of ``rollout.placement: separate``)."""
    if launched_externally():
        return detect_launch().world_size
    engine_ranks = run.rollout.engine_ranks if run.rollout.placement == "separate" else 0
    return nproc or run.parallel.tensor_parallel * run.parallel.pipeline_parallel + engine_ranks


def resolve_topology(run, nproc: int | None = None) -> JobTopology:
    """The job's topology from the run's ``parallel`` and ``rollout`` sections and its world size
    (:func:`job_world_size`), or ConfigError (one line) when the layout does not fit the ranks."""
    return JobTopology.resolve(job_world_size(run, nproc), run.parallel, run.rollout)


def device_memory() -> int | None:
    """Bytes of this process's GPU (its local rank's, under torchrun/srun), for the memory plan; None without CUDA
    or nvidia-smi (a CPU run has no device plan). Asked of nvidia-smi, not torch: torch's device properties make a
    CUDA context in this process, which the launcher of spawned ranks would hold on GPU 0 for the whole run."""
    if not torch.cuda.is_available():
        return None
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=30)
        totals = [int(line) for line in query.stdout.split()] if query.returncode == 0 else []
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return totals[detect_launch().local_rank % len(totals)] * 2 ** 20 if totals else None  # MiB


def launch_training(run, topology: JobTopology, resume: bool) -> None:
    """Train ``run`` (a validated RunConfig) in this process's rank(s) of ``topology`` (:func:`resolve_topology`):
    under torchrun/srun this process is one rank; otherwise it runs all the job's ranks, spawning them when more than
    one. Raises TrainingError / RolloutError / RankError with a message for the user."""
    start_guard()  # however this process ends, nothing it started (vLLM, reward workers, ranks) outlives it
    if launched_externally():
        train_on_rank(detect_launch().rank, topology.world_size, topology, run, resume)
    elif topology.world_size == 1:
        train_on_rank(0, 1, topology, run, resume)
    else:
        # A failed rank reports one line for the errors a user can act on, its traceback for anything else.
        # Engines on ranks of their own: each rank joins its role's process group itself (parallel.placement).
        run_on_ranks(train_on_rank, topology.world_size, topology, run, resume,
                     user_errors=(TrainingError, RolloutError), forward=STOP_SIGNALS, init_group=not topology.separate)


def train_on_rank(rank: int, world_size: int, topology: JobTopology, run, resume: bool):
    """One rank's run (``world_size``: the topology's, as the rank spawner passes it). SIGINT / SIGTERM end it at the
    next step boundary (see ``Trainer.train``); the processes it starts (vLLM, reward workers) run in sessions of their
    own so that Ctrl-C reaches the trainer only."""
    library_logs.progress_and_errors(logging.INFO if rank == 0 else logging.WARNING)
    bound_primitive_cache()  # before this rank's first oneDNN kernel (its linear layers', vLLM's)
    if not run.logging.verbose:
        # Megatron logs every parameter name and its optimizer config at INFO: keep our progress line readable.
        for noisy in ("megatron", "megatron.core", "vllm"):
            logging.getLogger(noisy).setLevel(logging.WARNING)

        library_logs.install()  # a spawned rank (--nproc) starts without the launcher's filters (library_logs.WARNINGS)
    with stop_on_signals("dynamo train: {signal} received: stopping after the current step (SIGINT or SIGTERM "
                         "again stops at once)" if rank == 0 else None), children_in_own_session():
        groups = None
        if topology.separate:  # the last rollout.engine_ranks ranks only generate
            groups = join_role_world(topology, rank)
            if groups.role == "engine":
                serve_engine_ranks(run, groups)
                return None
        with heap.start_up():
            trainer = Trainer(run, resume=resume, groups=groups)
        try:
            history = trainer.train()
        finally:
            trainer.close()
    return history if rank == 0 else None


def join_role_world(topology: JobTopology, rank: int) -> JobGroups:
    """This rank's place in a job whose engines run on ranks of their own: its role world as the default process
    group, and the bridge groups (``parallel.placement.join_job``), at the launcher's rendezvous address."""
    launch = detect_launch()
    os.environ.setdefault("MASTER_ADDR", launch.master_addr)  # vLLM's external launcher reads them
    os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    return join_job(topology, rank, launch.master_addr, launch.master_port)
