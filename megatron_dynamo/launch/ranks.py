"""Training in this process's ranks, for ``dynamo train`` and the launch entry points (``launch.entry.train``):
under torchrun / srun this process is one rank (:func:`megatron_dynamo.parallel.runtime.launched_externally`);
otherwise it runs the job's ranks itself, spawning them when there are several."""

from __future__ import annotations

import logging
import os

from megatron_dynamo.parallel.runtime import detect_launch, launched_externally


def launch_training(run, resume: bool, nproc: int | None = None) -> None:
    """Train ``run`` (a validated RunConfig) in this process's rank(s): under torchrun/srun this process is one
    rank; otherwise it runs ``nproc`` local ranks (default tensor x pipeline parallel size), spawning them when
    more than one. Raises TrainingError / RolloutError / RankError with a message for the user."""
    from megatron_dynamo.parallel.process_guard import start_guard
    from megatron_dynamo.parallel.spawn import run_on_ranks
    from megatron_dynamo.parallel.stop_signals import STOP_SIGNALS
    from megatron_dynamo.trainer.errors import RolloutError
    from megatron_dynamo.trainer.trainer import TrainingError

    start_guard()  # however this process ends, nothing it started (vLLM, reward workers, ranks) outlives it
    nproc = job_world_size(run, nproc)
    if launched_externally():
        launch = detect_launch()
        train_on_rank(launch.rank, launch.world_size, run, resume)
    elif nproc == 1:
        train_on_rank(0, 1, run, resume)
    else:
        # A failed rank reports one line for the errors a user can act on, its traceback for anything else.
        # Engines on ranks of their own: each rank joins its role's process group itself (parallel.placement).
        run_on_ranks(train_on_rank, nproc, run, resume, user_errors=(TrainingError, RolloutError),
                     forward=STOP_SIGNALS, init_group=run.rollout.placement != "separate")


def job_world_size(run, nproc: int | None) -> int:
    """The job's ranks: the launcher's world size, else ``--nproc``, else tensor x pipeline parallel (plus the
    engine ranks of ``rollout.placement: separate``)."""
    if launched_externally():
        return detect_launch().world_size
    engine_ranks = run.rollout.engine_ranks if run.rollout.placement == "separate" else 0
    return nproc or run.parallel.tensor_parallel * run.parallel.pipeline_parallel + engine_ranks


def train_on_rank(rank, world_size, run, resume):
    """One rank's run. SIGINT / SIGTERM end it at the next step boundary (see ``Trainer.train``); the processes it
    starts (vLLM, reward workers) run in sessions of their own so that Ctrl-C reaches the trainer only."""
    from megatron_dynamo.parallel.process_guard import children_in_own_session
    from megatron_dynamo.parallel.stop_signals import stop_on_signals
    from megatron_dynamo.trainer.trainer import Trainer

    from megatron_dynamo import library_logs

    library_logs.progress_and_errors(logging.INFO if rank == 0 else logging.WARNING)
    if not run.logging.verbose:
        # Megatron logs every parameter name and its optimizer config at INFO: keep our progress line readable.
        for noisy in ("megatron", "megatron.core", "vllm"):
            logging.getLogger(noisy).setLevel(logging.WARNING)

        library_logs.install()  # a spawned rank (--nproc) starts without the launcher's filters (library_logs.WARNINGS)
    with stop_on_signals("dynamo train: {signal} received: stopping after the current step (SIGINT or SIGTERM "
                         "again stops at once)" if rank == 0 else None), children_in_own_session():
        groups = None
        if run.rollout.placement == "separate":  # the last rollout.engine_ranks ranks only generate
            groups = join_role_world(run, rank, world_size)
            if groups.role == "engine":
                from megatron_dynamo.trainer.engine_ranks import serve_engine_ranks

                serve_engine_ranks(run, groups)
                return None
        trainer = Trainer(run, resume=resume, groups=groups)
        try:
            history = trainer.train()
        finally:
            trainer.close()
    return history if rank == 0 else None


def join_role_world(run, rank: int, world_size: int):
    """This rank's place in a job whose engines run on ranks of their own: its role world as the default process
    group, and the bridge groups (``parallel.placement.join_job``), at the launcher's rendezvous address."""
    import torch

    from megatron_dynamo.parallel.placement import Placement, join_job
    from megatron_dynamo.parallel.runtime import detect_launch

    launch = detect_launch()
    os.environ.setdefault("MASTER_ADDR", launch.master_addr)  # vLLM's external launcher reads them
    os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    return join_job(Placement.of_run(run, world_size), rank, launch.master_addr, launch.master_port)
