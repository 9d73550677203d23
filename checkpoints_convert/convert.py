"""The two conversions as functions (the CLI in :mod:`checkpoints_convert.cli` parses arguments and calls them), and
the checks they share with ``verify`` (:mod:`checkpoints_convert.verify`).

Each function validates everything it can from headers and configs first (in the driver, before any model is
built), then runs its per-rank work through :func:`checkpoints_convert.launch.run_ranks`, and writes its output
through an atomic temporary directory, so a failure leaves nothing at the output path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from checkpoints_convert.launch import (Layout, broadcast_from_driver, check_launcher_world, ensure_launcher_group,
                                        is_driver, run_ranks, under_launcher)
from megatron_dynamo.models.checkpoint_io import (SAFE_WEIGHTS_INDEX_NAME, CheckpointError, HFCheckpointReader,
                                                  SafetensorsShardWriter, atomic_output_dir, dtype_name,
                                                  is_model_checkpoint, load_model_checkpoint, parse_qwen_config,
                                                  read_checkpoint_info, read_hf_config, save_model_checkpoint,
                                                  torch_dtype, write_checkpoint_info, write_hf_side_files)
from megatron_dynamo.models.checkpoint_io.signing import signing_key, trust_line
from megatron_dynamo.models.checkpoint_io.verify import verify_checkpoint, write_full_manifest
from megatron_dynamo.models.export import iter_hf_weights
from megatron_dynamo.models.mappings import (MappingError, check_hf_tensor_shapes, chunk_mappings,
                                             hf_parameter_shapes, load_hf_weights, unwrap_model)
from megatron_dynamo.models.megatron_model import MegatronModel
from megatron_dynamo.models.qwen import QwenArchitecture, UnsupportedModelConfig
from megatron_dynamo.parallel import runtime
from megatron_dynamo.parallel.topology import check_experts

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _quiet(message: str) -> None:
    pass


def console(quiet: bool) -> Log:
    """Where a command's progress lines go: stderr, or nowhere with ``--quiet`` (errors print either way)."""
    return _quiet if quiet else _stderr


def size_text(num_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: ``3.1 MiB``, not ``0.00 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return ""  # unreachable: the loop returns at GiB


class Progress:
    """One line per ~10% of the tensors (and a final line), on the driver rank only."""

    def __init__(self, what: str, total: int, log: Log, enabled: bool = True):
        self.what, self.total, self.log, self.enabled = what, total, log, enabled
        self.count, self.bytes, self.start = 0, 0, time.perf_counter()
        self._next = max(1, total // 10)

    def update(self, tensor: torch.Tensor, count_bytes: bool = True) -> None:
        self.count += 1
        if count_bytes:
            self.bytes += tensor.numel() * tensor.element_size()
        if self.enabled and (self.count >= self._next or self.count == self.total):
            self._next += max(1, self.total // 10)
            elapsed = time.perf_counter() - self.start
            self.log(f"{self.what}: {self.count}/{self.total} tensors, {size_text(self.bytes)}, {elapsed:.1f} s")


def check_layout(arch: QwenArchitecture, layout: Layout) -> None:
    """Reject a layout the architecture cannot be split into, naming the config field (UnsupportedModelConfig or
    ConfigError), or one the launcher started another number of processes for (RankError): before any rank works."""
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    if min(tp, pp, ep) < 1:
        raise UnsupportedModelConfig(f"--tp, --pp and --ep must be >= 1 (got --tp {tp} --pp {pp} --ep {ep})")
    shared_expert = arch.moe.shared_expert_intermediate_size if arch.moe else 0
    for field, value in (("num_attention_heads", arch.num_attention_heads),
                         ("num_key_value_heads", arch.num_key_value_heads),
                         ("vocab_size", arch.vocab_size), ("intermediate_size", arch.intermediate_size),
                         ("shared_expert_intermediate_size", shared_expert)):
        if value % tp:
            raise UnsupportedModelConfig(f"config.json: {field}={value} is not divisible by --tp {tp}")
    if arch.num_layers % pp:
        raise UnsupportedModelConfig(f"config.json: num_hidden_layers={arch.num_layers} is not divisible by --pp {pp}")
    check_experts(arch.moe.num_experts if arch.moe else 0, ep, key="--ep")
    check_launcher_world(layout)


def converter_model(arch: QwenArchitecture, dtype: str) -> MegatronModel:
    """The model a conversion fills or reads, for the current parallel state: never trained, so never initialised
    (``perform_initialization=False``: every parameter is overwritten, and untouched ``torch.empty`` pages are not
    even resident) and without megatron-core's training advice for expert x tensor parallelism ("sequence
    parallelism must be used"), which does not apply to a model that only converts or runs forward."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="When using expert parallelism and tensor parallelism for training")
        return MegatronModel(arch, dtype=dtype, perform_initialization=False)


def compare_architectures(a: QwenArchitecture, b: QwenArchitecture, what_a: str, what_b: str) -> None:
    for field in dataclasses.fields(QwenArchitecture):
        if field.name == "initializer_range":
            continue
        va, vb = getattr(a, field.name), getattr(b, field.name)
        if va != vb:
            raise CheckpointError(f"{what_a} and {what_b} describe different models: {field.name}={va!r} vs {vb!r}")


def _holds(kind: str, path: Path) -> bool:
    """Whether ``path`` holds a checkpoint of ``kind``: "megatron" (this project's model checkpoint) or "hf"
    (config.json and safetensors)."""
    if kind == "megatron":
        return is_model_checkpoint(path)
    return (path / "config.json").is_file() and (any(path.glob("*.safetensors"))
                                                 or (path / SAFE_WEIGHTS_INDEX_NAME).is_file())


def check_replaceable(out: str | os.PathLike, force: bool, kind: str) -> None:
    """``--force`` replaces only a directory that holds a checkpoint of the kind being written (or nothing): a
    mistyped --out must not delete a data set or a home directory. Raises CheckpointError (one line)."""
    path = Path(out).absolute()
    if not force or not (path.exists() or path.is_symlink()):
        return
    what = {"megatron": "a Megatron checkpoint (megatron_dynamo.json)", "hf": "an HF model (config.json + "
            "*.safetensors)"}[kind]
    if path.is_symlink() or not path.is_dir() or not (_holds(kind, path) or not any(path.iterdir())):
        raise CheckpointError(f"--force replaces only an empty directory or one holding {what}; {path} is not "
                              "one: refused (nothing was written)")


def verified_source(megatron_dir: str | os.PathLike, command: str, log: Log) -> None:
    """The checks ``--resume`` makes (``models/checkpoint_io/verify.py``), before any rank loads ``megatron_dir``;
    the driver logs what they prove. Raises CheckpointError (one line). Under a launcher every process checks."""
    key = signing_key()
    verify_checkpoint(megatron_dir, key)
    if is_driver():
        log(f"{command}: {megatron_dir} verified; {trust_line(key)}")


@contextlib.contextmanager
def _output_dir(out: str | os.PathLike, force: bool, layout: Layout) -> Iterator[Path]:
    """:func:`atomic_output_dir` on the driver; under a launcher its temporary path is shared with every rank and
    the ranks wait until the driver has renamed it into place. The launcher's process group is made here (the
    ranks' work would make it later): sharing the path is the first collective of a conversion under torchrun or
    srun, and without a group every other rank got None for it."""
    if not under_launcher():
        with atomic_output_dir(out, force) as tmp:
            yield tmp
        return
    import torch.distributed as dist

    ensure_launcher_group(layout)
    if is_driver():
        context = atomic_output_dir(out, force)
        try:
            tmp = context.__enter__()
        except Exception as exc:
            broadcast_from_driver(("error", str(exc)))
            raise
        broadcast_from_driver(("ok", str(tmp)))
        try:
            yield tmp
        except BaseException:
            context.__exit__(*sys.exc_info())
            raise
        context.__exit__(None, None, None)
        dist.barrier()
    else:
        status, value = broadcast_from_driver(None)
        if status == "error":
            raise CheckpointError(value)
        yield Path(value)
        dist.barrier()


# ------------------------------------------------------------------------------------------------ hf-to-megatron
def _hf_to_megatron_rank(hf_dir: str, arch: QwenArchitecture, dtype: str, layout: Layout, out: str,
                         quiet: bool, max_item_bytes: int) -> dict[str, Any]:
    info = runtime.init_distributed(layout.parallel_config(), seed=0)
    reader = HFCheckpointReader(hf_dir)
    # Not initialised: every parameter is overwritten from the checkpoint (load_hf_weights checks that each one has
    # a mapping); memory grows only as parameters are filled.
    model = converter_model(arch, dtype)
    # Each rank reads the tensors of its own pipeline stage and its own experts; count them for the progress line.
    total = len({name for chunk in model.chunks for mapping, _ in chunk_mappings(unwrap_model(chunk), arch,
                                                                                  model.use_te)
                 for name in mapping.hf_names})
    progress = Progress(f"hf-to-megatron (rank {info.rank})", total, console(quiet),
                        enabled=info.rank == 0)
    seen: set[str] = set()

    def count(name: str, tensor: torch.Tensor) -> torch.Tensor:
        progress.bytes += tensor.numel() * tensor.element_size()
        if name not in seen:
            seen.add(name)
            progress.update(tensor, count_bytes=False)
        return tensor

    # Row streaming: big tensors (embeddings, fused QKV/fc1 parts) go from the file into the parameter in
    # bounded pieces; only row-parallel weights (o_proj, down_proj: one layer each) are read whole.
    load_hf_weights(model.chunks, arch, lambda name: count(name, reader.get(name)), model.use_te,
                    read_rows=lambda name, start, stop: count(name, reader.read_rows(name, start, stop)),
                    hf_shapes=reader.shapes())
    if info.rank == 0 and not quiet:
        _stderr(f"hf-to-megatron: writing the distributed checkpoint ({layout})")
    save_model_checkpoint(model.chunks, out, release_params=True, max_item_bytes=max_item_bytes)
    return {"tensors_read": progress.count, "bytes_read": progress.bytes}


def hf_to_megatron(hf_dir: str | os.PathLike, out: str | os.PathLike, tp: int = 1, pp: int = 1,
                   dtype: str = "auto", force: bool = False, quiet: bool = False,
                   max_item_bytes: int = 16 * 2**20, ep: int = 1) -> dict[str, Any]:
    """Convert an HF safetensors checkpoint into a Megatron model checkpoint saved at ``tp`` x ``pp`` (experts over
    ``ep`` ranks: each reads only its own).

    ``dtype``: ``fp32``, ``bf16`` or ``auto`` (the dtype the HF tensors are stored in). ``max_item_bytes``:
    tensors larger than this are stored as row pieces (bounds the read buffer of whoever loads the
    checkpoint). Returns a summary dict.
    """
    log = console(quiet)
    start = time.perf_counter()
    hf_dir = Path(hf_dir).absolute()
    cfg = read_hf_config(hf_dir)
    arch = parse_qwen_config(cfg)
    layout = Layout(tp, pp, ep)
    check_layout(arch, layout)
    reader = HFCheckpointReader(hf_dir)
    check_hf_tensor_shapes(arch, reader.shapes(), allow_tied_lm_head=True)
    if arch.tie_word_embeddings and "lm_head.weight" in reader:
        if not torch.equal(reader.get("lm_head.weight"), reader.get("model.embed_tokens.weight")):
            raise MappingError("lm_head.weight differs from model.embed_tokens.weight, but config.json says "
                               "tie_word_embeddings=true")
    if dtype == "auto":
        stored = reader.dtypes()
        if len(stored) != 1 or next(iter(stored)) not in (torch.float32, torch.bfloat16):
            raise CheckpointError(f"{hf_dir}: tensors are stored as {sorted(map(str, stored))}; pass --dtype fp32 "
                                  "or --dtype bf16")
        dtype = dtype_name(next(iter(stored)))
    torch_dtype(dtype)
    check_replaceable(out, force, "megatron")
    key = signing_key()
    if is_driver():
        log(f"hf-to-megatron: {hf_dir} ({arch.model_type}, {arch.num_layers} layers, {len(reader.names())} tensors, "
            f"{size_text(reader.total_bytes())}) -> {out} as {dtype} at {layout}")
    with _output_dir(out, force, layout) as tmp:
        results = run_ranks(_hf_to_megatron_rank, layout, str(hf_dir), arch, dtype, layout, str(tmp), quiet,
                            max_item_bytes)
        if is_driver():
            write_checkpoint_info(
                tmp, cfg, dtype,
                source={"kind": "hf", "path": str(hf_dir), "tensors": len(reader.names()),
                        "bytes": reader.total_bytes()},
                saved_with={"tensor_parallel": tp, "pipeline_parallel": pp,
                            **({"expert_parallel": ep} if arch.moe else {})},
                hf_files_from=[hf_dir])
            write_full_manifest(tmp, key)  # last: it lists every file, signed when a key is configured
    summary = {"out": str(Path(out).absolute()), "dtype": dtype, "tp": tp, "pp": pp, "ep": ep,
               "bytes": reader.total_bytes(), "seconds": time.perf_counter() - start, "ranks": results}
    if is_driver():
        log(f"hf-to-megatron: done in {summary['seconds']:.1f} s -> {summary['out']}")
    return summary


# ------------------------------------------------------------------------------------------------ megatron-to-hf
def _megatron_to_hf_rank(megatron_dir: str, layout: Layout, out: str, out_dtype: str, max_shard_bytes: int,
                         quiet: bool) -> dict[str, Any]:
    info = runtime.init_distributed(layout.parallel_config(), seed=0)
    ckpt = read_checkpoint_info(megatron_dir)
    model = converter_model(ckpt.arch, ckpt.dtype)
    load_model_checkpoint(model.chunks, ckpt.directory)
    dtype = torch_dtype(out_dtype)
    shapes = hf_parameter_shapes(ckpt.arch)
    writer = None
    if info.rank == 0:
        writer = SafetensorsShardWriter(out, [(n, s, dtype) for n, s in shapes.items()], max_shard_bytes)
    progress = Progress("megatron-to-hf", len(shapes), console(quiet), enabled=info.rank == 0)
    for name, tensor in iter_hf_weights(model.chunks, ckpt.arch, model.use_te, dst_rank=0, dtype=dtype):
        writer.write(name, tensor)
        progress.update(tensor)
    if writer is not None:
        index = writer.close()
        return {"files": writer.files, "total_size": index["metadata"]["total_size"]}
    return {}


def megatron_to_hf(megatron_dir: str | os.PathLike, out: str | os.PathLike,
                   hf_config_dir: str | os.PathLike | None = None, tokenizer_dir: str | os.PathLike | None = None,
                   dtype: str | None = None, tp: int = 1, pp: int = 1, max_shard_bytes: int = 5 * 2**30,
                   force: bool = False, quiet: bool = False, ep: int = 1) -> dict[str, Any]:
    """Write an HF checkpoint (safetensors shards, index, config.json, generation config and tokenizer files)
    from a Megatron model checkpoint, loading it at ``tp`` x ``pp`` x ``ep`` (1 x 1 x 1 is fine for any saved
    layout).

    ``hf_config_dir``: take config.json (and generation_config.json) from there instead of the checkpoint (it
    must describe the same architecture). ``tokenizer_dir``: copy tokenizer files from there (default: those
    stored in the checkpoint, if any). ``dtype``: output dtype (default: the checkpoint's).
    """
    log = console(quiet)
    start = time.perf_counter()
    check_replaceable(out, force, "hf")
    ckpt = read_checkpoint_info(megatron_dir)
    verified_source(megatron_dir, "megatron-to-hf", log)
    config, config_source = ckpt.hf_config, ckpt.hf_dir
    if hf_config_dir is not None:
        config, config_source = read_hf_config(hf_config_dir), Path(hf_config_dir)
        compare_architectures(parse_qwen_config(config), ckpt.arch, f"{hf_config_dir}/config.json",
                               f"checkpoint {megatron_dir}")
    layout = Layout(tp, pp, ep)
    check_layout(ckpt.arch, layout)
    out_dtype = dtype or ckpt.dtype
    torch_dtype(out_dtype)
    if is_driver():
        log(f"megatron-to-hf: {megatron_dir} ({ckpt.arch.model_type}, {ckpt.dtype}) -> {out} as {out_dtype} "
            f"(loaded at {layout})")
    with _output_dir(out, force, layout) as tmp:
        results = run_ranks(_megatron_to_hf_rank, layout, str(Path(megatron_dir).absolute()), layout, str(tmp),
                            out_dtype, max_shard_bytes, quiet)
        copied = []
        if is_driver():
            copied = write_hf_side_files(tmp, config, torch_dtype(out_dtype), config_dir=config_source,
                                         tokenizer_dir=tokenizer_dir or ckpt.hf_dir)
    summary = {"out": str(Path(out).absolute()), "dtype": out_dtype, "seconds": time.perf_counter() - start,
               "copied": copied, **((results or [{}])[0])}
    if is_driver():
        log(f"megatron-to-hf: done in {summary['seconds']:.1f} s -> {summary['out']}")
    return summary
