"""Checkpoint files: HF safetensors in and out, Megatron distributed checkpoints of the model, atomic directories.

One module per concern; this package re-exports their public names, so ``from megatron_dynamo.models.checkpoint_io
import X`` reads the same as before the split:

- :mod:`.formats`: file names, dtype names, :class:`CheckpointError`, :func:`read_hf_config`.
- :mod:`.hf_read`: :class:`HFCheckpointReader`, lazy by-name reading of an HF safetensors checkpoint.
- :mod:`.hf_write`: :class:`SafetensorsShardWriter` (shards + index from a plan, one tensor at a time) and
  :func:`write_hf_side_files` (config, generation config, tokenizer files).
- :mod:`.megatron_info`: ``megatron_dynamo.json`` + ``hf/`` of a model checkpoint directory (:class:`CheckpointInfo`).
- :mod:`.megatron_dist`: the model's ``megatron.core.dist_checkpointing`` save / check / load at any TP/PP/VPP.
- :mod:`.atomic`: :func:`atomic_output_dir` (a complete result or nothing), :func:`fsync_tree`.
"""

from megatron_dynamo.models.checkpoint_io.atomic import atomic_output_dir, check_output_path, fsync_tree
from megatron_dynamo.models.checkpoint_io.formats import (CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_VERSION,
                                                          CHECKPOINT_HF_DIR, CHECKPOINT_META_FILE,
                                                          CHECKPOINT_MODEL_DIR, DTYPE_NAMES, GENERATION_CONFIG_NAME,
                                                          SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME,
                                                          SAFETENSORS_DTYPES, TOKENIZER_FILES, CheckpointError,
                                                          OutputExistsError, dtype_name, read_hf_config, torch_dtype)
from megatron_dynamo.models.checkpoint_io.hf_read import HFCheckpointReader, TensorInfo, read_safetensors_header
from megatron_dynamo.models.checkpoint_io.hf_write import SafetensorsShardWriter, write_hf_side_files
from megatron_dynamo.models.checkpoint_io.megatron_dist import (check_model_checkpoint, load_model_checkpoint,
                                                                model_sharded_state_dict, save_model_checkpoint)
from megatron_dynamo.models.checkpoint_io.megatron_info import (CheckpointInfo, is_model_checkpoint,
                                                                read_checkpoint_info, write_checkpoint_info)
from megatron_dynamo.models.qwen import QwenArchitecture, parse_qwen_config

__all__ = [
    "CHECKPOINT_FORMAT", "CHECKPOINT_FORMAT_VERSION", "CHECKPOINT_HF_DIR", "CHECKPOINT_META_FILE",
    "CHECKPOINT_MODEL_DIR", "DTYPE_NAMES", "GENERATION_CONFIG_NAME", "SAFE_WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_NAME",
    "SAFETENSORS_DTYPES", "TOKENIZER_FILES", "CheckpointError", "CheckpointInfo", "HFCheckpointReader",
    "OutputExistsError", "QwenArchitecture", "SafetensorsShardWriter", "TensorInfo", "atomic_output_dir",
    "check_model_checkpoint", "check_output_path", "dtype_name", "fsync_tree", "is_model_checkpoint",
    "load_model_checkpoint", "model_sharded_state_dict", "parse_qwen_config", "read_checkpoint_info",
    "read_hf_config", "read_safetensors_header", "save_model_checkpoint", "torch_dtype", "write_checkpoint_info",
    "write_hf_side_files",
]
