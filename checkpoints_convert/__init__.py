"""HF <-> Megatron checkpoint conversion for Qwen2 / Qwen2.5 / Qwen3: ``python -m checkpoints_convert --help``.

Library use (each call validates first and writes its output atomically):

- :func:`checkpoints_convert.convert.hf_to_megatron` (HF safetensors -> Megatron distributed checkpoint)
- :func:`checkpoints_convert.convert.megatron_to_hf` (Megatron checkpoint -> HF safetensors + index + config)
- :func:`checkpoints_convert.convert.verify` (HF transformers logits vs Megatron logits)

The parameter mappings live in :mod:`megatron_dynamo.models.mappings`, the streaming export in
:mod:`megatron_dynamo.models.export` and the file formats in :mod:`megatron_dynamo.models.checkpoint_io`.
"""

import os
import subprocess
import sys
from pathlib import Path

from checkpoints_convert.cli import main

__all__ = ["export_to_hf", "main"]


def export_to_hf(megatron_dir: str | os.PathLike, out: str | os.PathLike,
                 tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """``megatron-to-hf`` in a child process, replacing ``out`` atomically; raises RuntimeError with the
    converter's message on failure. A child process because the converter runs its ranks under torch.distributed
    itself: the trainer (which owns a process group) and ``dynamo eval`` (about to start vLLM) must not. The child
    gets this process's environment without the launcher variables (torchrun's RANK/WORLD_SIZE, srun's SLURM_PROCID
    ...): a rank of an N-process job that converts starts one single-process converter, not a rank of that job."""
    from megatron_dynamo.parallel.runtime import single_process_environment

    cmd = [sys.executable, "-m", "checkpoints_convert", "megatron-to-hf", "--megatron", str(megatron_dir),
           "--out", str(out), "--force", "--quiet"]
    if tokenizer_dir is not None:
        cmd += ["--tokenizer", str(tokenizer_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=single_process_environment())
    if proc.returncode != 0:
        raise RuntimeError(f"converting {megatron_dir} to HF failed: {proc.stderr.strip()[-2000:]}")
    return Path(out)
