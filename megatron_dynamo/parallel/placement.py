"""The process groups of a job whose engines run on ranks of their own (``rollout.placement: separate``; which ranks
those are: :class:`~megatron_dynamo.parallel.topology.JobTopology`).

Of a job's W ranks the first W - N train and the last N (``rollout.engine_ranks``) only generate and score (on a
cluster the last ranks are the last nodes, so whole nodes generate). Megatron and vLLM each need a
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

import torch
import torch.distributed as dist

from megatron_dynamo.parallel.topology import JobTopology, Role

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
    """This process's place in a separate job: the job's topology, its role, and the bridge groups it belongs to
    (``None`` where it is not a member: only the first engine rank and the trainer ranks share ``batches``, only the
    first trainer rank and the engine ranks share ``control``)."""

    topology: JobTopology
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


def join_job(topology: JobTopology, rank: int, master_addr: str, master_port: int,
             timeout_minutes: float = 30.0) -> JobGroups:
    """Collective over all ranks of a separate job: rendezvous at ``master_addr:master_port``, make this rank's
    role world the default process group (gloo on CPU, NCCL on GPUs) and build the bridge groups."""
    if not topology.separate:
        raise ValueError("join_job is for jobs whose engines run on ranks of their own (rollout.placement: separate)")
    if dist.is_initialized():
        raise RuntimeError("join_job must run before torch.distributed is initialised: it forms the role worlds")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store, _, _ = next(dist.rendezvous(f"tcp://{master_addr}:{master_port}", rank=rank,
                                       world_size=topology.world_size, timeout=timeout))
    role = topology.role(rank)
    size = topology.engine_ranks if role == "engine" else topology.parallel.ranks
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.PrefixStore(f"{role}/", store),
                            rank=topology.role_rank(rank), world_size=size, timeout=timeout)
    global _role_world_offset
    _role_world_offset = rank - topology.role_rank(rank)
    trainers = list(range(topology.parallel.ranks))
    engines = list(range(topology.first_engine_rank, topology.world_size))
    first_engine = topology.first_engine_rank
    batches = _bridge(store, "batches", [first_engine, *trainers], first_engine, rank, "gloo", timeout)
    control = _bridge(store, "control", [0, *engines], 0, rank, "nccl" if gpu else "gloo", timeout)
    return JobGroups(topology, rank, role, batches, control)
