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


@pytest.mark.distributed
def test_no_other_socket_can_take_the_rendezvous_port_while_the_ranks_start(monkeypatch):
    """The port the ranks meet at is bound before they are spawned and stays bound: a socket that tries to bind it
    while they start (any connection's local port on a busy machine: CI once failed on EADDRINUSE) cannot, and the
    ranks meet. A launcher that picks a free port and leaves rank 0 to bind it seconds later loses it here."""
    import errno
    import socket

    from megatron_dynamo.parallel import spawn

    start_processes = spawn.mp.start_processes
    intruders, refused = [], []

    def start_after_an_intruder(fn, args, **kwargs):
        intruder = socket.socket()
        try:
            intruder.bind(("127.0.0.1", args[1]))  # args: (world_size, port, ...)
            intruders.append(intruder)
        except OSError as exc:
            refused.append(exc.errno)
            intruder.close()
        return start_processes(fn, args=args, **kwargs)

    monkeypatch.setattr(spawn.mp, "start_processes", start_after_an_intruder)
    try:
        assert run_on_ranks(_allreduce_rank, 2) == [3.0, 3.0]
    finally:
        for intruder in intruders:
            intruder.close()
    assert refused == [errno.EADDRINUSE]
