"""How a conversion runs its ranks: in this process, in spawned gloo processes, or under torchrun.

- **single**: ``--tp 1 --pp 1`` without a launcher: the work runs in this process.
- **spawn**: more than one rank (:attr:`Layout.world_size`) without a launcher: this process (the *driver*) spawns
  the worker processes with ``torch.multiprocessing`` (start method ``spawn``), each joining a gloo group on
  127.0.0.1. The driver stays light (no model), collects each rank's return value and re-raises the first rank
  error with its message.
- **torchrun**: ``RANK``/``WORLD_SIZE`` are set (``torchrun --nproc-per-node N python -m checkpoints_convert ...``,
  or a harness that already initialised torch.distributed): every process runs the command, the world size must
  equal the layout's, rank 0 is the driver, and rank results are gathered to it.

Either way the per-rank function runs with torch.distributed initialised (gloo) and returns a picklable value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from megatron_dynamo.config import ConfigError
from megatron_dynamo.models.checkpoint_io import CheckpointError
from megatron_dynamo.models.mappings import MappingError
from megatron_dynamo.models.qwen import UnsupportedModelConfig
from megatron_dynamo.parallel import runtime
from megatron_dynamo.parallel.spawn import RankError, run_on_ranks


@dataclass(frozen=True)
class Layout:
    """The parallel layout a conversion runs at: ``tp`` x ``pp``, and a mixture-of-experts model's experts divided
    over ``ep`` ranks (expert tensor parallel 1: each expert whole on its rank)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        """``pp`` stages of lcm(tp, ep) ranks: Megatron's expert groups tile each stage's ranks, so an ``ep`` that
        ``tp`` does not cover adds data-parallel replicas (``--ep 2`` alone: two ranks, four of eight experts each)."""
        return self.pp * math.lcm(self.tp, self.ep)

    @property
    def named(self) -> str:
        """How the ranks' count is spelt in messages: ``--tp x --pp``, with experts ``--pp x lcm(--tp, --ep)``."""
        return "--tp x --pp" if self.ep == 1 else "--pp x lcm(--tp, --ep)"

    def parallel_config(self) -> runtime.ParallelConfig:
        return runtime.ParallelConfig(tensor_parallel=self.tp, pipeline_parallel=self.pp, expert_parallel=self.ep)

    def __str__(self) -> str:
        return f"tp={self.tp} pp={self.pp}" + (f" ep={self.ep}" if self.ep > 1 else "")


def under_launcher() -> bool:
    """True when started as one rank of several by torchrun or srun (``runtime.launched_externally``, the test the
    trainer and ``dynamo eval`` use too), or in an initialised process group: every rank runs the command. A launch
    of one process (convert.sbatch's single srun task) is no launcher: it spawns its TP x PP workers itself."""
    if dist.is_available() and dist.is_initialized():
        return True
    return runtime.launched_externally() and runtime.detect_launch().world_size > 1


def launcher_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return runtime.detect_launch().world_size


def is_driver() -> bool:
    """The process that validates, owns the output directory and reports: rank 0 under a launcher."""
    if not under_launcher():
        return True
    if dist.is_initialized():
        return dist.get_rank() == 0
    return runtime.detect_launch().rank == 0


def check_launcher_world(layout: Layout) -> None:
    """Under a launcher, the processes started must be the layout's ranks (RankError, one line, otherwise)."""
    world_size = layout.world_size
    if under_launcher() and launcher_world_size() != world_size:
        raise RankError([(-1, f"launched with {launcher_world_size()} processes but {layout.named} = {world_size}; "
                              f"start exactly {world_size} (torchrun --nproc-per-node {world_size} ...)")])


def ensure_launcher_group(layout: Layout) -> None:
    """Under a launcher: check the world size and initialise the gloo group (if nobody has yet)."""
    check_launcher_world(layout)
    if not dist.is_initialized():
        launch = runtime.detect_launch()
        dist.init_process_group("gloo", rank=launch.rank, world_size=launch.world_size,
                                init_method=f"tcp://{launch.master_addr}:{launch.master_port}")


def broadcast_from_driver(value: Any) -> Any:
    """Under a launcher, rank 0's ``value`` on every rank; otherwise ``value``."""
    if not (under_launcher() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _call_without_rank(rank: int, world_size: int, fn: Callable, *args) -> Any:
    return fn(*args)


def run_ranks(fn: Callable, layout: Layout, *args) -> list[Any] | None:
    """Run ``fn(*args)`` on the ``layout``'s ranks (torch.distributed initialised, gloo).

    Returns the list of rank results on the driver and ``None`` on other ranks under a launcher. A failing rank
    raises :class:`RankError` (spawn mode) or its own exception (single / launcher mode).
    """
    world_size = layout.world_size
    if under_launcher():
        ensure_launcher_group(layout)
        result = fn(*args)
        gathered = [None] * world_size if dist.get_rank() == 0 else None
        dist.gather_object(result, gathered, dst=0)
        return gathered
    if world_size == 1:
        started_here = not dist.is_initialized()
        try:
            return [fn(*args)]
        finally:
            if started_here:
                runtime.shutdown()
    # One line for the errors a user can act on, the traceback for anything else.
    return run_on_ranks(_call_without_rank, world_size, fn, *args,
                        user_errors=(CheckpointError, ConfigError, MappingError, UnsupportedModelConfig, RankError))
