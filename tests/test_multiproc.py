import pytest
import torch
import torch.distributed as dist

from multiproc import run_on_ranks


def _allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


@pytest.mark.distributed
def test_run_on_ranks_collects_results():
    assert run_on_ranks(_allreduce_rank, 2) == [3.0, 3.0]


@pytest.mark.distributed
def test_run_on_ranks_reports_rank_error():
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_on_ranks(_fail_on_rank1, 2)


def _threads(rank, world_size):
    return torch.get_num_threads()


@pytest.mark.distributed
def test_ranks_share_the_cpus_this_process_may_use():
    """Threads per rank follow the affinity mask (a `dynamo ablate --jobs` slot, a container), not the machine."""
    import os

    allowed = sorted(os.sched_getaffinity(0))
    assert run_on_ranks(_threads, 1) == [len(allowed)]
    os.sched_setaffinity(0, allowed[:1])  # the spawned ranks inherit it
    try:
        assert run_on_ranks(_threads, 2) == [1, 1]
        assert run_on_ranks(_threads, 1) == [1]
    finally:
        os.sched_setaffinity(0, allowed)
