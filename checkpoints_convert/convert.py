"""The three conversions as functions (the CLI in :mod:`checkpoints_convert.cli` parses arguments and calls them).

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
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from megatron.core import parallel_state, tensor_parallel

from checkpoints_convert.launch import broadcast_from_driver, is_driver, run_ranks, under_launcher
from megatron_dynamo.models.checkpoint_io import (SAFE_WEIGHTS_INDEX_NAME, CheckpointError, HFCheckpointReader,
                                                  SafetensorsShardWriter, atomic_output_dir, dtype_name,
                                                  is_model_checkpoint, load_model_checkpoint, parse_qwen_config,
                                                  read_checkpoint_info, read_hf_config, save_model_checkpoint,
                                                  torch_dtype, write_checkpoint_info, write_hf_side_files)
from megatron_dynamo.models.checkpoint_io.signing import signing_key, trust_line
from megatron_dynamo.models.checkpoint_io.verify import verify_checkpoint, write_full_manifest
from megatron_dynamo.models.export import iter_hf_weights
from megatron_dynamo.models.mappings import (MappingError, check_hf_tensor_shapes, hf_parameter_shapes,
                                             layer_mappings, load_hf_weights)
from megatron_dynamo.models.megatron_model import MegatronModel
from megatron_dynamo.models.qwen import QwenArchitecture, UnsupportedModelConfig
from megatron_dynamo.parallel import runtime

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _quiet(message: str) -> None:
    pass


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


def check_layout(arch: QwenArchitecture, tp: int, pp: int) -> None:
    """Reject a TP/PP layout the architecture cannot be split into, naming the config field."""
    if tp < 1 or pp < 1:
        raise UnsupportedModelConfig(f"--tp and --pp must be >= 1 (got --tp {tp} --pp {pp})")
    for field, value in (("num_attention_heads", arch.num_attention_heads),
                         ("num_key_value_heads", arch.num_key_value_heads),
                         ("vocab_size", arch.vocab_size), ("intermediate_size", arch.intermediate_size)):
        if value % tp:
            raise UnsupportedModelConfig(f"config.json: {field}={value} is not divisible by --tp {tp}")
    if arch.num_layers % pp:
        raise UnsupportedModelConfig(f"config.json: num_hidden_layers={arch.num_layers} is not divisible by --pp {pp}")


def _compare_architectures(a: QwenArchitecture, b: QwenArchitecture, what_a: str, what_b: str) -> None:
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
def _output_dir(out: str | os.PathLike, force: bool) -> Iterator[Path]:
    """:func:`atomic_output_dir` on the driver; under a launcher its temporary path is shared with every rank and
    the ranks wait until the driver has renamed it into place."""
    if not under_launcher():
        with atomic_output_dir(out, force) as tmp:
            yield tmp
        return
    import torch.distributed as dist

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
def _hf_to_megatron_rank(hf_dir: str, arch: QwenArchitecture, dtype: str, tp: int, pp: int, out: str,
                         quiet: bool, max_item_bytes: int) -> dict[str, Any]:
    info = runtime.init_distributed(runtime.ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), seed=0)
    reader = HFCheckpointReader(hf_dir)
    # Each rank reads the tensors of its own pipeline stage; count them for the progress line.
    first, last = info.pp_rank == 0, info.pp_rank == pp - 1
    per_stage = arch.num_layers // pp
    stage_layers = range(info.pp_rank * per_stage, (info.pp_rank + 1) * per_stage)
    layer_tensors = sum(len(m.hf_names) for layer in stage_layers
                        for m in layer_mappings(arch, moe_layer=arch.is_moe_layer(layer)))
    total = layer_tensors + first + last + (last and not (arch.tie_word_embeddings and first))
    progress = Progress(f"hf-to-megatron (rank {info.rank})", total, _quiet if quiet else _stderr,
                        enabled=info.rank == 0)
    seen: set[str] = set()

    def count(name: str, tensor: torch.Tensor) -> torch.Tensor:
        progress.bytes += tensor.numel() * tensor.element_size()
        if name not in seen:
            seen.add(name)
            progress.update(tensor, count_bytes=False)
        return tensor

    # perform_initialization=False: every parameter is overwritten from the checkpoint (load_hf_weights checks
    # that each one has a mapping), so random initialisation would be wasted time. Untouched parameters of
    # torch.empty are not even resident, so memory grows only as parameters are filled.
    model = MegatronModel(arch, dtype=dtype, perform_initialization=False)
    # Row streaming: big tensors (embeddings, fused QKV/fc1 parts) go from the file into the parameter in
    # bounded pieces; only row-parallel weights (o_proj, down_proj: one layer each) are read whole.
    load_hf_weights(model.chunks, arch, lambda name: count(name, reader.get(name)), model.use_te,
                    read_rows=lambda name, start, stop: count(name, reader.read_rows(name, start, stop)),
                    hf_shapes=reader.shapes())
    if info.rank == 0 and not quiet:
        _stderr(f"hf-to-megatron: writing the distributed checkpoint (tp={tp}, pp={pp})")
    save_model_checkpoint(model.chunks, out, release_params=True, max_item_bytes=max_item_bytes)
    return {"tensors_read": progress.count, "bytes_read": progress.bytes}


def hf_to_megatron(hf_dir: str | os.PathLike, out: str | os.PathLike, tp: int = 1, pp: int = 1,
                   dtype: str = "auto", force: bool = False, quiet: bool = False,
                   max_item_bytes: int = 16 * 2**20) -> dict[str, Any]:
    """Convert an HF safetensors checkpoint into a Megatron model checkpoint saved at ``tp`` x ``pp``.

    ``dtype``: ``fp32``, ``bf16`` or ``auto`` (the dtype the HF tensors are stored in). ``max_item_bytes``:
    tensors larger than this are stored as row pieces (bounds the read buffer of whoever loads the
    checkpoint). Returns a summary dict.
    """
    log = _quiet if quiet else _stderr
    start = time.perf_counter()
    hf_dir = Path(hf_dir).absolute()
    cfg = read_hf_config(hf_dir)
    arch = parse_qwen_config(cfg)
    check_layout(arch, tp, pp)
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
            f"{size_text(reader.total_bytes())}) -> {out} as {dtype} at tp={tp} pp={pp}")
    with _output_dir(out, force) as tmp:
        results = run_ranks(_hf_to_megatron_rank, tp * pp, str(hf_dir), arch, dtype, tp, pp, str(tmp), quiet,
                            max_item_bytes)
        if is_driver():
            write_checkpoint_info(
                tmp, cfg, dtype,
                source={"kind": "hf", "path": str(hf_dir), "tensors": len(reader.names()),
                        "bytes": reader.total_bytes()},
                saved_with={"tensor_parallel": tp, "pipeline_parallel": pp},
                hf_files_from=[hf_dir])
            write_full_manifest(tmp, key)  # last: it lists every file, signed when a key is configured
    summary = {"out": str(Path(out).absolute()), "dtype": dtype, "tp": tp, "pp": pp,
               "bytes": reader.total_bytes(), "seconds": time.perf_counter() - start, "ranks": results}
    if is_driver():
        log(f"hf-to-megatron: done in {summary['seconds']:.1f} s -> {summary['out']}")
    return summary


# ------------------------------------------------------------------------------------------------ megatron-to-hf
def _megatron_to_hf_rank(megatron_dir: str, tp: int, pp: int, out: str, out_dtype: str, max_shard_bytes: int,
                         quiet: bool) -> dict[str, Any]:
    info = runtime.init_distributed(runtime.ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), seed=0)
    ckpt = read_checkpoint_info(megatron_dir)
    model = MegatronModel(ckpt.arch, dtype=ckpt.dtype, perform_initialization=False)
    load_model_checkpoint(model.chunks, ckpt.directory)
    dtype = torch_dtype(out_dtype)
    shapes = hf_parameter_shapes(ckpt.arch)
    writer = None
    if info.rank == 0:
        writer = SafetensorsShardWriter(out, [(n, s, dtype) for n, s in shapes.items()], max_shard_bytes)
    progress = Progress("megatron-to-hf", len(shapes), _quiet if quiet else _stderr, enabled=info.rank == 0)
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
                   force: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Write an HF checkpoint (safetensors shards, index, config.json, generation config and tokenizer files)
    from a Megatron model checkpoint, loading it at ``tp`` x ``pp`` (1 x 1 is fine for any saved layout).

    ``hf_config_dir``: take config.json (and generation_config.json) from there instead of the checkpoint (it
    must describe the same architecture). ``tokenizer_dir``: copy tokenizer files from there (default: those
    stored in the checkpoint, if any). ``dtype``: output dtype (default: the checkpoint's).
    """
    log = _quiet if quiet else _stderr
    start = time.perf_counter()
    check_replaceable(out, force, "hf")
    ckpt = read_checkpoint_info(megatron_dir)
    verified_source(megatron_dir, "megatron-to-hf", log)
    config, config_source = ckpt.hf_config, ckpt.hf_dir
    if hf_config_dir is not None:
        config, config_source = read_hf_config(hf_config_dir), Path(hf_config_dir)
        _compare_architectures(parse_qwen_config(config), ckpt.arch, f"{hf_config_dir}/config.json",
                               f"checkpoint {megatron_dir}")
    check_layout(ckpt.arch, tp, pp)
    out_dtype = dtype or ckpt.dtype
    torch_dtype(out_dtype)
    if is_driver():
        log(f"megatron-to-hf: {megatron_dir} ({ckpt.arch.model_type}, {ckpt.dtype}) -> {out} as {out_dtype} "
            f"(loaded at tp={tp} pp={pp})")
    with _output_dir(out, force) as tmp:
        results = run_ranks(_megatron_to_hf_rank, tp * pp, str(Path(megatron_dir).absolute()), tp, pp, str(tmp),
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


# ------------------------------------------------------------------------------------------------ verify
@dataclasses.dataclass(frozen=True)
class VerifyResult:
    max_abs_diff: float
    mean_abs_diff: float
    argmax_agreement: float
    tolerance: float
    dtype: str
    tp: int
    pp: int

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance


DEFAULT_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-1}


def _verify_rank(megatron_dir: str, tp: int, pp: int, input_ids: torch.Tensor) -> torch.Tensor | None:
    runtime.init_distributed(runtime.ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), seed=0)
    ckpt = read_checkpoint_info(megatron_dir)
    model = MegatronModel(ckpt.arch, dtype=ckpt.dtype, perform_initialization=False)
    load_model_checkpoint(model.chunks, ckpt.directory)

    def keep_logits(logits: torch.Tensor, micro_batch):
        full = tensor_parallel.gather_from_tensor_model_parallel_region(logits.detach())
        return logits.sum() * 0.0, {"logits": full}

    results = model.forward_backward([{"input_ids": input_ids}], keep_logits, forward_only=True)
    if results and parallel_state.get_tensor_model_parallel_rank() == 0:
        return results[0]["logits"].float()
    return None


def hf_logits(hf_dir: str | os.PathLike, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Logits of the HF transformers model stored in ``hf_dir`` (eager attention, eval mode, CPU)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype,
                                                              attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def verify(hf_dir: str | os.PathLike, megatron_dir: str | os.PathLike, tp: int = 1, pp: int = 1,
           tol: float | None = None, batch_size: int = 2, seq_len: int = 32, seed: int = 0,
           quiet: bool = False) -> VerifyResult | None:
    """Run one random token batch through HF transformers (``hf_dir``) and the Megatron model loaded from
    ``megatron_dir`` at ``tp`` x ``pp``; compare the logits. Returns the result on the driver (None elsewhere)."""
    log = _quiet if quiet else _stderr
    ckpt = read_checkpoint_info(megatron_dir)
    verified_source(megatron_dir, "verify", log)
    _compare_architectures(parse_qwen_config(read_hf_config(hf_dir)), ckpt.arch, f"{hf_dir}/config.json",
                           f"checkpoint {megatron_dir}")
    check_layout(ckpt.arch, tp, pp)
    if batch_size < 1 or not 1 <= seq_len <= ckpt.arch.max_position_embeddings:
        raise CheckpointError(f"--batch-size must be >= 1 and --seq-len in [1, {ckpt.arch.max_position_embeddings}]")
    tolerance = DEFAULT_TOLERANCE[ckpt.dtype] if tol is None else tol
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, ckpt.arch.vocab_size, (batch_size, seq_len), generator=generator)
    results = run_ranks(_verify_rank, tp * pp, str(Path(megatron_dir).absolute()), tp, pp, input_ids)
    if not is_driver():
        return None
    megatron = next(r for r in results if r is not None)
    reference = hf_logits(hf_dir, input_ids, torch_dtype(ckpt.dtype))
    diff = (megatron - reference).abs()
    result = VerifyResult(
        max_abs_diff=diff.max().item(), mean_abs_diff=diff.mean().item(),
        argmax_agreement=(megatron.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        tolerance=tolerance, dtype=ckpt.dtype, tp=tp, pp=pp)
    log(f"verify: {batch_size}x{seq_len} tokens, dtype {ckpt.dtype}, megatron tp={tp} pp={pp}: "
        f"max |logit diff| = {result.max_abs_diff:.3e} (mean {result.mean_abs_diff:.3e}, "
        f"argmax agreement {result.argmax_agreement:.4f}), tolerance {tolerance:g}: "
        f"{'PASS' if result.passed else 'FAIL'}")
    return result
