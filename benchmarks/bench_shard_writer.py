"""The HF shard writer of ``megatron-to-hf``: the hand-written one (``SafetensorsShardWriter``: headers first, each
tensor ``pwrite``-n at its offset as it arrives) against safetensors' own writer (``safetensors.torch.save_file``
once per shard, each shard's tensors held until its last one arrives), on the real export shapes.

    python benchmarks/bench_shard_writer.py [--shapes 1.5b,7b,cpu-100m,cpu-tiny] [--workdir DIR] [--json FILE]

Each (shape, writer) runs in a fresh child process: the plan is ``hf_parameter_shapes`` of the model config (the
names and shapes ``megatron-to-hf`` writes), every tensor is made fresh just before it is written and dropped
after (as the export yields it when it gathers a TP-split tensor or casts the dtype), and the child reports its
peak RSS above its RSS before the first tensor (Linux ``clear_refs`` + ``VmHWM``) and the seconds from the first
tensor to the closed index (fsync included). The row ``tensors only`` makes the same tensors and writes nothing.
Both outputs are read back with ``HFCheckpointReader`` and compared tensor by tensor (every value).

Shapes: ``1.5b``: Qwen2.5-Math-1.5B, all 28 layers, bf16 (3.1 GB, one 5 GiB shard as at full size). ``7b``:
Qwen2.5-Math-7B's hidden size, vocabulary and MLP with 2 of its 28 layers (3.1 GB instead of 15.2 GB; the shard
limit scaled by the same factor, so the shards hold the same share of the model as 5 GiB shards of the full
model). ``cpu-100m``: configs/models/bench-qwen2-100m.json, fp32. ``cpu-tiny``: configs/models/tiny-qwen2.json, fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPES = {  # name: (config, layers kept, dtype)
    "1.5b": ("qwen2.5-math-1.5b.json", None, "bf16"),
    "7b": ("qwen2.5-math-7b.json", 2, "bf16"),
    "cpu-100m": ("bench-qwen2-100m.json", None, "fp32"),
    "cpu-tiny": ("tiny-qwen2.json", None, "fp32"),
}
WRITERS = ("none", "hand-written", "safetensors")
FULL_SHARD_BYTES = 5 * 2**30


class LibraryShardWriter:
    """The same contract as ``SafetensorsShardWriter`` (plan, ``write`` in any order, ``close`` -> index) on
    ``safetensors.torch.save_file``: a shard is written once all its tensors have arrived."""

    def __init__(self, directory, plan, max_shard_bytes, metadata=None):
        from megatron_dynamo.models.checkpoint_io.hf_write import plan_shards

        self.files, shards = plan_shards(plan, max_shard_bytes)  # the hand-written writer's split and file names
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.weight_map = {name: file for file, entries in zip(self.files, shards) for name, *_ in entries}
        self.total_bytes = sum(nbytes for entries in shards for *_, nbytes in entries)
        self.shapes = {name: (tuple(int(d) for d in shape), dtype) for name, shape, dtype in plan}
        self.pending = {file: {} for file in self.files}
        self.left = {file: sum(1 for f in self.weight_map.values() if f == file) for file in self.files}
        self.metadata = {"format": "pt", **(metadata or {})}

    def write(self, name, tensor):
        import torch
        from safetensors.torch import save_file

        shape, dtype = self.shapes[name]
        assert tuple(tensor.shape) == shape and tensor.dtype == dtype, name
        tensor = tensor.detach().to("cpu")
        if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone(memory_format=torch.contiguous_format)  # save_file refuses views of shared storage
        file = self.weight_map[name]
        self.pending[file][name] = tensor
        self.left[file] -= 1
        if self.left[file] == 0:
            save_file(self.pending.pop(file), str(self.directory / file), metadata=self.metadata)

    def close(self):
        assert not self.pending, f"shards never completed: {sorted(self.pending)}"
        for file in self.files:
            fd = os.open(self.directory / file, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return index


def plan_for(shape: str):
    import torch

    from megatron_dynamo.models.checkpoint_io import parse_qwen_config
    from megatron_dynamo.models.mappings import hf_parameter_shapes

    config_file, layers, dtype = SHAPES[shape]
    config = json.loads((REPO / "configs" / "models" / config_file).read_text())
    full_layers = config["num_hidden_layers"]
    if layers is not None:
        config["num_hidden_layers"] = layers
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    plan = [(n, s, torch_dtype) for n, s in hf_parameter_shapes(parse_qwen_config(config)).items()]
    if layers is None:
        return plan, FULL_SHARD_BYTES
    full = dict(config, num_hidden_layers=full_layers)
    full_bytes = sum(torch.Size(s).numel() for s in hf_parameter_shapes(parse_qwen_config(full)).values())
    scaled_bytes = sum(torch.Size(s).numel() for _, s, _ in plan)
    return plan, int(FULL_SHARD_BYTES * scaled_bytes / full_bytes)


def child(shape: str, writer_name: str, out: str) -> dict:
    import torch

    # The peak-memory window of the token-stats benchmark (VmHWM reset through /proc/self/clear_refs).
    from bench_token_stats import read_peak, start_peak_window
    from megatron_dynamo.models.checkpoint_io import SafetensorsShardWriter

    plan, shard_bytes = plan_for(shape)
    start_rss, hwm, _ = start_peak_window(cuda=False)
    start = time.perf_counter()
    cls = {"hand-written": SafetensorsShardWriter, "safetensors": LibraryShardWriter}.get(writer_name)
    writer = cls(out, plan, shard_bytes) if cls else None
    for i, (name, shape_, dtype) in enumerate(plan):
        tensor = torch.empty(shape_, dtype=dtype).fill_(i % 251 / 64)  # fresh pages, as a gathered/cast tensor
        if writer is not None:
            writer.write(name, tensor)
        del tensor
    files = writer.close() and writer.files if writer is not None else []
    seconds = time.perf_counter() - start
    return {"shape": shape, "writer": writer_name, "seconds": seconds, "files": len(files),
            "bytes": sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, s, d in plan),
            "shard_bytes": shard_bytes, "peak_extra": read_peak(False, hwm) - start_rss,
            "peak_is_exact": hwm}


def same_content(a: str, b: str) -> bool:
    import torch

    from megatron_dynamo.models.checkpoint_io import HFCheckpointReader

    ra, rb = HFCheckpointReader(a), HFCheckpointReader(b)
    if ra.shapes() != rb.shapes():
        return False
    return all(torch.equal(ra.get(n), rb.get(n)) for n in ra.names())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--workdir", help="where the shards go (default: a temporary directory, removed)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", nargs=3, metavar=("SHAPE", "WRITER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    shapes = args.shapes.split(",")
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        print(f"unknown shape(s) {', '.join(bad)}; shapes: {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_shard_writer."))
    rows = []
    try:
        for shape in shapes:
            outs = {}
            for writer in WRITERS:
                out = work / f"{shape}-{writer}"
                shutil.rmtree(out, ignore_errors=True)
                proc = subprocess.run([sys.executable, __file__, "--child", shape, writer, str(out)],
                                      capture_output=True, text=True)
                if proc.returncode:
                    print(proc.stderr, file=sys.stderr)
                    return 1
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                outs[writer] = out
            sys.path.insert(0, str(REPO))
            rows[-1]["same_content"] = same_content(str(outs["hand-written"]), str(outs["safetensors"]))
            for writer in WRITERS[1:]:
                shutil.rmtree(outs[writer], ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print("| shape | writer | GB | shards (limit GB) | peak above start, MB | s | GB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['writer']} | {r['bytes'] / 1e9:.3f} | {r['files']} ({r['shard_bytes'] / 1e9:.2f}) "
              f"| {r['peak_extra'] / 2**20:.0f} | {r['seconds']:.2f} | {r['bytes'] / 1e9 / r['seconds']:.2f} |")
    for shape in shapes:
        by = {r["writer"]: r for r in rows if r["shape"] == shape}
        hand, lib = by["hand-written"], by["safetensors"]
        print(f"{shape}: safetensors / hand-written: peak {lib['peak_extra'] / max(1, hand['peak_extra']):.2f}x, "
              f"time {lib['seconds'] / hand['seconds']:.2f}x; same tensors: {lib['same_content']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
