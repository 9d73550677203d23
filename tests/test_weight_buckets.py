"""The weight stream between trainer and engine ranks (rollout/channel.py): tensors packed into buckets arrive equal,
whatever their dtypes, shapes and sizes against the bucket, and the sender is not held while the receiver loads."""

import time

import pytest
import torch
import torch.distributed as dist

from multiproc import run_on_ranks

from megatron_dynamo.parallel.placement import BridgeGroup
from megatron_dynamo.rollout import channel


def _weights():
    g = torch.Generator().manual_seed(0)
    return [("embed", torch.randn(7, 5, generator=g)),
            ("bias", torch.randn(3, generator=g).to(torch.bfloat16)),
            ("big", torch.randn(40, 3, generator=g)),  # 480 bytes: larger than a bucket, alone in one
            ("scalar", torch.tensor(3.25, dtype=torch.float64)),
            ("experts", torch.arange(-6, 6, dtype=torch.int16).reshape(3, 4)),
            ("odd", torch.randn(5, generator=g).to(torch.float16))]  # 10 bytes: the next one starts aligned


def _stream_worker(rank, world_size, bucket_bytes, load_seconds):
    bridge = BridgeGroup(dist.group.WORLD, rank, world_size, 0, torch.device("cpu"))
    if rank == 0:
        start = time.monotonic()
        sent = channel.send_weights(bridge, iter(_weights()), bucket_bytes=bucket_bytes)
        return {"sent": sent, "seconds": time.monotonic() - start}
    received = []
    for name, tensor in channel.receive_weights(bridge):
        time.sleep(load_seconds)  # an engine loading each tensor
        received.append((name, tensor.clone()))
    return {"received": received}


@pytest.mark.distributed
@pytest.mark.parametrize("bucket_bytes", [64, channel.BUCKET_BYTES])
def test_weights_arrive_equal_in_any_bucketing(bucket_bytes):
    sender, receiver = run_on_ranks(_stream_worker, 2, bucket_bytes, 0.0)
    expected = _weights()
    assert sender["sent"] == (sum(t.numel() * t.element_size() for _, t in expected), len(expected))
    assert [name for name, _ in receiver["received"]] == [name for name, _ in expected]
    for (_, got), (_, want) in zip(receiver["received"], expected):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


@pytest.mark.distributed
def test_the_sender_returns_before_the_engine_has_loaded_the_weights():
    """One bucket: the receiver takes it and the END behind it before it loads (0.5 s a tensor here, 3 s in all);
    the sender is done once both are across."""
    sender, receiver = run_on_ranks(_stream_worker, 2, channel.BUCKET_BYTES, 0.5)
    assert len(receiver["received"]) == len(_weights())
    assert sender["seconds"] < 1.5
