"""The OLD side of ``bench_weight_sync.py``: the former rollout design's packer (host byte buckets, 64-byte
aligned, one reusable buffer), its vLLM worker extension (:class:`LegacyRPCExtension`, imported by vLLM's worker by
qualname ``bench_weight_sync_legacy.LegacyRPCExtension``) and the bucketed ``collective_rpc`` update. A compact
copy of the product's former ``iter_packed_buckets`` / ``unpack_bucket`` (the product no longer has them).
"""

from __future__ import annotations

import time

import torch


LEGACY_EXTENSION = "bench_weight_sync_legacy.LegacyRPCExtension"
ALIGN_BYTES = 64
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                       torch.int64, torch.int32, torch.uint8)}



def iter_packed_buckets(named_tensors, bucket_bytes: int):
    """``(uint8 view of one reusable host buffer, [[name, dtype, shape, offset, nbytes], ...])`` per bucket of at most
    ``bucket_bytes`` (a larger tensor travels alone). Finish with a bucket before asking for the next."""
    buffer, entries, offset = None, [], 0
    for name, tensor in named_tensors:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if raw.device.type != "cpu":
            raw = raw.cpu()
        nbytes, dtype = raw.numel(), str(tensor.dtype).removeprefix("torch.")
        entry = [name, dtype, list(tensor.shape)]
        if nbytes > bucket_bytes:
            if entries:
                yield buffer[:offset], entries
                entries, offset = [], 0
            yield raw, [entry + [0, nbytes]]
            continue
        start = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
        if start + nbytes > bucket_bytes:
            yield buffer[:offset], entries
            entries, offset, start = [], 0, 0
        if buffer is None:
            buffer = torch.empty(bucket_bytes, dtype=torch.uint8)
        buffer[start:start + nbytes].copy_(raw)
        entries.append(entry + [start, nbytes])
        offset = start + nbytes
    if entries:
        yield buffer[:offset], entries


def unpack_bucket(data, entries, device="cpu") -> list[tuple[str, torch.Tensor]]:
    """Inverse of the packer (``data``: what arrived over the RPC: bytes-like); every tensor owns its memory."""
    import warnings

    view = memoryview(data).cast("B")
    with warnings.catch_warnings():  # read-only buffers are fine: every tensor is copied out
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
    return [(str(name), flat[int(off):int(off) + int(n)].view(_DTYPES[dtype]).reshape(tuple(shape))
             .to(device, copy=True)) for name, dtype, shape, off, n in entries]


class LegacyRPCExtension:
    """Added to vLLM's worker (``worker_extension_cls``) in the OLD path; called through ``LLM.collective_rpc``."""

    def bench_begin(self) -> bool:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from megatron_dynamo.rollout.vllm_reload import quiet_reload_records_of_tensorless_layers

        model = self.model_runner.model
        if not hasattr(self, "_bench_device"):  # during a reload incomplete layers sit on the meta device
            self._bench_device = next(model.parameters()).device
            quiet_reload_records_of_tensorless_layers(model)  # as the old worker did
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
        return True

    def bench_load_bucket(self, data, entries) -> int:
        from vllm.config import set_current_vllm_config

        weights = unpack_bucket(data, entries, device=self._bench_device)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            self.model_runner.model.load_weights(weights)
        return len(weights)

    def bench_finish(self) -> bool:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.model, self.vllm_config.model_config)
        for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.model_runner, name, None)
            if callable(fn):
                fn()
        return True


def legacy_update(llm, named_tensors, bucket_bytes: int) -> dict:
    """The old ``push_named_tensors``: begin, one RPC per packed bucket, finish, prefix-cache reset."""
    out = {"bytes": 0, "tensors": 0, "buckets": 0, "rpc_seconds": 0.0}
    start = time.perf_counter()
    llm.collective_rpc("bench_begin")
    try:
        for buf, entries in iter_packed_buckets(named_tensors, bucket_bytes):
            view = memoryview(buf.numpy()).cast("B") if buf.numel() else memoryview(b"")
            t0 = time.perf_counter()
            received = llm.collective_rpc("bench_load_bucket", args=(view, entries))
            out["rpc_seconds"] += time.perf_counter() - t0
            if any(r != len(entries) for r in received):
                raise RuntimeError(f"workers received {received} tensors of a {len(entries)}-tensor bucket")
            out["bytes"] += sum(e[4] for e in entries)
            out["tensors"] += len(entries)
            out["buckets"] += 1
    finally:
        llm.collective_rpc("bench_finish")
    llm.reset_prefix_cache()
    out["seconds"] = time.perf_counter() - start
    return out
