"""The cost of checkpoint checksums (issue 25): save and load of a training checkpoint with the manifest (SHA-256 of
every file, hashed in threads by the rank that wrote it; verified before ``--resume`` loads) against the same save and
load without it, measured in the same run on the same model and optimizer.

    python benchmarks/bench_checkpoint.py                       the CPU default (tiny-qwen2) and the largest CPU shape
    python benchmarks/bench_checkpoint.py --models configs/models/bench-qwen2-100m.json --repeats 3

What runs is the trainer's own code, ``megatron_dynamo.trainer.checkpoint``: ``save_checkpoint`` (model and
optimizer through Megatron dist_checkpointing, trainer_state.json, manifest, fsync, atomic rename) on the real
Megatron actor (random init, fp32, one Adam step so the optimizer state exists), one rank, gloo.

    save            save_checkpoint as the trainer calls it (hashing included)
    save, no hash   the same with the hashing step replaced by an empty manifest
    hashing         the hashing step alone (every file of the saved checkpoint, in threads): what the manifest adds
    load            load_checkpoint (model and optimizer), no verification
    verify          resume_checkpoint: sizes and SHA-256 of every file against the manifest
    load+verify     what ``--resume`` does: verify, then load
    cold            load, and verify+load, with the checkpoint's files dropped from the page cache first
                    (posix_fadvise DONTNEED): a resume on a fresh node reads them from disk

Times are wall seconds, the fastest of --repeats (after one warm-up save; the two saves alternate which goes
first). Warm: the files in the page cache (just saved). Cold: the check reads them from disk and leaves them
cached for the load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODELS = [os.path.join(REPO, "configs", "models", "tiny-qwen2.json"),
                  os.path.join(REPO, "configs", "models", "bench-qwen2-100m.json")]


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _evict(path: str) -> None:
    """Drop the checkpoint's files from the page cache (they are fsynced, so clean): the next read is from disk."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _measure(rank, world_size, model: str, root: str, repeats: int) -> dict:
    import torch

    from megatron_dynamo.models.qwen import load_hf_config
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer import checkpoint as ckpt
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig
    from megatron_dynamo.models.checkpoint_io.manifest import owned_files

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    actor = MegatronActor(model, optim=OptimConfig(lr=1e-5))
    actor.forward_backward([{"input_ids": torch.arange(1, 17).unsqueeze(0)}],
                           lambda logits, mb: (logits.float().square().mean(), {}))
    actor.optimizer_step()
    params = sum(p.numel() for _, p in actor.named_parameters())
    args = ({"history": {}}, load_hf_config(model), "fp32", 1, {"tp": 1})
    real_hash = ckpt.hash_files
    times = {k: [] for k in ("save", "save_nohash", "hash", "load", "verify", "cold_load", "cold_verify_load")}
    size = 0
    ckpt.save_checkpoint(os.path.join(root, "warmup"), 0, actor.chunks, actor.optimizer, *args)  # writer start-up
    for i in range(1, repeats + 1):
        with_root, without_root = os.path.join(root, "with"), os.path.join(root, "without")
        for variant in (("save", "save_nohash") if i % 2 else ("save_nohash", "save")):  # alternating order
            if variant == "save_nohash":
                ckpt.hash_files = lambda directory, relatives: {}
            try:
                t = time.perf_counter()
                saved = ckpt.save_checkpoint(with_root if variant == "save" else without_root, i, actor.chunks,
                                             actor.optimizer, *args)
                times[variant].append(time.perf_counter() - t)
            finally:
                ckpt.hash_files = real_hash
            if variant == "save":
                path = saved
        size = _dir_bytes(str(path))
        t = time.perf_counter()  # the hashing step of the save alone (what "save" adds to "save, no hash")
        real_hash(path, owned_files(path, 0))
        times["hash"].append(time.perf_counter() - t)
        t = time.perf_counter()
        found, lines = ckpt.resume_checkpoint(with_root)
        times["verify"].append(time.perf_counter() - t)
        assert found == path and not lines, (found, lines)
        t = time.perf_counter()
        ckpt.load_checkpoint(path, actor.chunks, actor.optimizer)
        times["load"].append(time.perf_counter() - t)
        _evict(str(path))
        t = time.perf_counter()
        ckpt.load_checkpoint(path, actor.chunks, actor.optimizer)
        times["cold_load"].append(time.perf_counter() - t)
        _evict(str(path))
        t = time.perf_counter()
        ckpt.resume_checkpoint(with_root)
        ckpt.load_checkpoint(path, actor.chunks, actor.optimizer)
        times["cold_verify_load"].append(time.perf_counter() - t)
    return {"params": params, "bytes": size, **{k: min(v) for k, v in times.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                        help="HF config.json files of the shapes to measure (default: tiny-qwen2, bench-qwen2-100m)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per variant; the fastest is shown")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary "
                        "directory, removed afterwards)")
    args = parser.parse_args(argv)
    for model in args.models:
        if not os.path.isfile(model):
            print(f"bench_checkpoint: {model}: no such file", file=sys.stderr)
            return 2
    sys.path.insert(0, REPO)
    from megatron_dynamo.parallel.spawn import run_on_ranks

    print("| model | params | checkpoint MB | save s | save, no hash s | save ratio | hashing s | load s | verify s | "
          "load+verify s | load ratio | verify MB/s | cold load s | cold load+verify s | cold ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
        try:
            (r,) = run_on_ranks(_measure, 1, model, root, args.repeats)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        mb = r["bytes"] / 1e6
        print(f"| {os.path.basename(model)} | {r['params'] / 1e6:.1f}M | {mb:.1f} | {r['save']:.2f} | "
              f"{r['save_nohash']:.2f} | {r['save'] / r['save_nohash']:.2f} | {r['hash']:.2f} | {r['load']:.2f} | "
              f"{r['verify']:.2f} | "
              f"{r['load'] + r['verify']:.2f} | {(r['load'] + r['verify']) / r['load']:.2f} | "
              f"{mb / r['verify']:.0f} | {r['cold_load']:.2f} | {r['cold_verify_load']:.2f} | "
              f"{r['cold_verify_load'] / r['cold_load']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
