"""HF <-> Megatron checkpoint conversion for Qwen2 / Qwen2.5 / Qwen3 and Qwen2-MoE / Qwen3-MoE:
``python -m checkpoints_convert --help``.

Library use (each call validates first and writes its output atomically):

- :func:`checkpoints_convert.convert.hf_to_megatron` (HF safetensors -> Megatron distributed checkpoint)
- :func:`checkpoints_convert.convert.megatron_to_hf` (Megatron checkpoint -> HF safetensors + index + config)
- :func:`checkpoints_convert.verify.verify` (HF transformers logits vs Megatron logits)

The parameter mappings live in :mod:`megatron_dynamo.models.mappings`, the streaming export in
:mod:`megatron_dynamo.models.export` and the file formats in :mod:`megatron_dynamo.models.checkpoint_io`.
"""

from checkpoints_convert.cli import main
from megatron_dynamo.models.export import export_to_hf  # the converter in a child process (trainer, dynamo eval)

__all__ = ["export_to_hf", "main"]
