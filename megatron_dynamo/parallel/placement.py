"""Where the rollout engines run: on the training ranks (``colocated``) or on ranks of their own (``separate``), and
the process groups of a job whose engines run apart.

``colocated`` (the default): every rank trains and hosts a vLLM worker; one default process group holds all ranks.

``separate`` with ``rollout.engine_ranks: N``: of a job's W ranks the first W - N train and the last N only generate
and score (on a cluster the last ranks are the last nodes, so whole nodes generate). Megatron and vLLM each need a
default process group that holds exactly their ranks, so :func:`join_job` forms two *role worlds* from one
rendezvous store: the trainer ranks' default group (Megatron's world: W - N ranks) and the engine ranks' (vLLM's
world: N ranks). Two bridge groups join them, made from the same store and used through their own methods (they
are not registered with torch.distributed, whose rank translation knows only the default group):

- ``batches``: the first engine rank and every trainer rank (gloo: scored rollouts are small host tensors);
- ``control``: the first trainer rank and every engine rank (commands, and the weights: NCCL on GPUs, gloo on CPU).

Every rank of a separate job calls :func:`join_job` first, before anything else touches torch.distributed.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

PLACEMENTS = ("colocated", "separate")
Role = Literal["trainer", "engine"]


@dataclass(frozen=True)
class Placement:
    """The ranks of a job of ``world_size`` ranks whose last ``engine_ranks`` only generate (0: colocated)."""

    world_size: int
    engine_ranks: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.engine_ranks < self.world_size:
            raise ValueError(f"rollout.engine_ranks={self.engine_ranks} must leave at least one of the job's "
                             f"{self.world_size} ranks to train")

    @classmethod
    def of_run(cls, run, world_size: int) -> "Placement":
        """The placement a run's ``rollout`` section asks for in a job of ``world_size`` ranks."""
        return cls(world_size, run.rollout.engine_ranks if run.rollout.placement == "separate" else 0)

    def check(self, model_parallel: int, engine_tensor_parallel: int) -> None:
        """Raise ValueError (one line, naming the keys) unless the training ranks hold whole model-parallel groups
        and the engine ranks (all ranks, colocated) whole engines."""
        if self.separate:
            engines, what = self.engine_ranks, f"rollout.engine_ranks={self.engine_ranks}"
        else:
            engines, what = self.world_size, f"the {self.world_size} ranks (every rank hosts a vLLM worker)"
        if engines % engine_tensor_parallel:
            raise ValueError(f"rollout.tensor_parallel={engine_tensor_parallel} does not divide {what}: engines "
                             "are groups of rollout.tensor_parallel ranks")
        if self.trainer_ranks % model_parallel:
            ranks = (f"the {self.trainer_ranks} training ranks ({self.world_size} ranks minus rollout.engine_ranks="
                     f"{self.engine_ranks}) are" if self.separate else f"world size {self.world_size} is")
            raise ValueError(f"{ranks} not divisible by tensor_parallel x pipeline_parallel x context_parallel = "
                             f"{model_parallel}")

    @property
    def separate(self) -> bool:
        return self.engine_ranks > 0

    @property
    def trainer_ranks(self) -> int:
        return self.world_size - self.engine_ranks

    @property
    def first_engine_rank(self) -> int:
        """The global rank of the first engine rank: it sends every scored batch to the trainer ranks."""
        return self.trainer_ranks

    def role(self, rank: int) -> Role:
        return "engine" if self.separate and rank >= self.trainer_ranks else "trainer"

    def role_rank(self, rank: int) -> int:
        """``rank``'s rank within its role world."""
        return rank - self.trainer_ranks if self.role(rank) == "engine" else rank


def check_placement_settings(placement: str, engine_ranks: int, max_staleness: int, tensor_parallel: int) -> None:
    """The ``rollout`` section's placement keys, on their own (ValueError, one line): a job's size is checked by
    :meth:`Placement.check` when it is known."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if placement == "colocated":
        if max_staleness:
            raise ValueError(f"max_staleness must be 0 with placement colocated (its engines share the training ranks "
                             f"and sleep while they update: nothing can overlap), got {max_staleness}; set placement: "
                             "separate and engine_ranks")
        if engine_ranks:
            raise ValueError(f"engine_ranks must be 0 with placement colocated (every rank hosts an engine worker), "
                             f"got {engine_ranks}; set placement: separate")
    elif engine_ranks < 1:
        raise ValueError(f"engine_ranks must be >= 1 with placement separate (the ranks that only generate), got "
                         f"{engine_ranks}")
    elif engine_ranks % tensor_parallel:
        raise ValueError(f"engine_ranks must be a multiple of tensor_parallel ({tensor_parallel}: engines are groups of "
                         f"tensor_parallel engine ranks), got {engine_ranks}")


#: The job rank of this process's role-world rank 0 (the first engine rank on engine ranks, else 0).
_role_world_offset = 0


def job_rank(role_rank: int) -> int:
    """The rank in the whole job of ``role_rank`` of this process's default group (they differ on engine ranks of a
    separate job, whose default group holds only them): what messages name, so a user finds the process."""
    return _role_world_offset + role_rank


@dataclass
class BridgeGroup:
    """A process group between the two role worlds, with this process's rank in it and the group rank of its
    root (the rank that sends). ``device``: where tensors for it live (the GPU for NCCL, else the CPU)."""

    group: dist.ProcessGroup
    rank: int
    size: int
    root: int
    device: torch.device

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective over the group: ``tensor`` from the root to every member (in place on the others)."""
        options = dist.BroadcastOptions()
        options.rootRank = self.root
        self.group.broadcast([tensor], options).wait()
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self.group.allreduce([tensor], options).wait()
        return tensor


@dataclass
class JobGroups:
    """This process's place in a separate job: its role, and the bridge groups it belongs to (``None`` where it is
    not a member: only the first engine rank and the trainer ranks share ``batches``, only the first trainer rank
    and the engine ranks share ``control``)."""

    placement: Placement
    rank: int
    role: Role
    batches: BridgeGroup | None
    control: BridgeGroup | None


def _bridge(store, name: str, members: list[int], root: int, rank: int, backend: str,
            timeout: datetime.timedelta) -> BridgeGroup | None:
    if rank not in members:
        return None
    prefixed = dist.PrefixStore(f"bridge/{name}/", store)
    index, size = members.index(rank), len(members)
    if backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, index, size)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        group = dist.ProcessGroupGloo(prefixed, index, size, timeout)
        device = torch.device("cpu")
    return BridgeGroup(group, index, size, members.index(root), device)


def join_job(placement: Placement, rank: int, master_addr: str, master_port: int,
             timeout_minutes: float = 30.0) -> JobGroups:
    """Collective over all ranks of a separate job: rendezvous at ``master_addr:master_port``, make this rank's
    role world the default process group (gloo on CPU, NCCL on GPUs) and build the bridge groups."""
    if not placement.separate:
        raise ValueError("join_job is for jobs whose engines run on ranks of their own (rollout.placement: separate)")
    if dist.is_initialized():
        raise RuntimeError("join_job must run before torch.distributed is initialised: it forms the role worlds")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store, _, _ = next(dist.rendezvous(f"tcp://{master_addr}:{master_port}", rank=rank,
                                       world_size=placement.world_size, timeout=timeout))
    role = placement.role(rank)
    size = placement.engine_ranks if role == "engine" else placement.trainer_ranks
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.PrefixStore(f"{role}/", store),
                            rank=placement.role_rank(rank), world_size=size, timeout=timeout)
    global _role_world_offset
    _role_world_offset = rank - placement.role_rank(rank)
    trainers = list(range(placement.trainer_ranks))
    engines = list(range(placement.trainer_ranks, placement.world_size))
    first_engine = placement.first_engine_rank
    batches = _bridge(store, "batches", [first_engine, *trainers], first_engine, rank, "gloo", timeout)
    control = _bridge(store, "control", [0, *engines], 0, rank, "nccl" if gpu else "gloo", timeout)
    return JobGroups(placement, rank, role, batches, control)
