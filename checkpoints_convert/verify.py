"""``verify``: the logits of a converted Megatron checkpoint against HF transformers' on one random token batch."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from megatron.core import parallel_state, tensor_parallel

from checkpoints_convert.convert import (check_layout, compare_architectures, console, converter_model,
                                         verified_source)
from checkpoints_convert.launch import Layout, is_driver, run_ranks
from megatron_dynamo.models.checkpoint_io import (CheckpointError, load_model_checkpoint, parse_qwen_config,
                                                  read_checkpoint_info, read_hf_config, torch_dtype)
from megatron_dynamo.parallel import runtime


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    max_abs_diff: float
    mean_abs_diff: float
    argmax_agreement: float
    tolerance: float
    dtype: str
    tp: int
    pp: int
    ep: int = 1

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance


DEFAULT_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-1}


def _verify_rank(megatron_dir: str, layout: Layout, input_ids: torch.Tensor) -> torch.Tensor | None:
    runtime.init_distributed(layout.parallel_config(), seed=0)
    ckpt = read_checkpoint_info(megatron_dir)
    model = converter_model(ckpt.arch, ckpt.dtype)
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
           quiet: bool = False, ep: int = 1) -> VerifyResult | None:
    """Run one random token batch through HF transformers (``hf_dir``) and the Megatron model loaded from
    ``megatron_dir`` at ``tp`` x ``pp`` (experts over ``ep`` ranks); compare the logits. Returns the result on the
    driver (None elsewhere)."""
    log = console(quiet)
    ckpt = read_checkpoint_info(megatron_dir)
    verified_source(megatron_dir, "verify", log)
    compare_architectures(parse_qwen_config(read_hf_config(hf_dir)), ckpt.arch, f"{hf_dir}/config.json",
                           f"checkpoint {megatron_dir}")
    layout = Layout(tp, pp, ep)
    check_layout(ckpt.arch, layout)
    if batch_size < 1 or not 1 <= seq_len <= ckpt.arch.max_position_embeddings:
        raise CheckpointError(f"--batch-size must be >= 1 and --seq-len in [1, {ckpt.arch.max_position_embeddings}]")
    tolerance = DEFAULT_TOLERANCE[ckpt.dtype] if tol is None else tol
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, ckpt.arch.vocab_size, (batch_size, seq_len), generator=generator)
    results = run_ranks(_verify_rank, layout, str(Path(megatron_dir).absolute()), layout, input_ids)
    if not is_driver():
        return None
    megatron = next(r for r in results if r is not None)
    reference = hf_logits(hf_dir, input_ids, torch_dtype(ckpt.dtype))
    diff = (megatron - reference).abs()
    result = VerifyResult(
        max_abs_diff=diff.max().item(), mean_abs_diff=diff.mean().item(),
        argmax_agreement=(megatron.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        tolerance=tolerance, dtype=ckpt.dtype, tp=tp, pp=pp, ep=ep)
    log(f"verify: {batch_size}x{seq_len} tokens, dtype {ckpt.dtype}, megatron {layout}: "
        f"max |logit diff| = {result.max_abs_diff:.3e} (mean {result.mean_abs_diff:.3e}, "
        f"argmax agreement {result.argmax_agreement:.4f}), tolerance {tolerance:g}: "
        f"{'PASS' if result.passed else 'FAIL'}")
    return result
