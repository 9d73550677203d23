"""What ``python -m checkpoints_convert`` does once its arguments are parsed (``cli.py`` parses them without
importing any of this, so ``--help`` answers at once): run the chosen conversion, check or signature, and turn the
errors a user can act on into one line and an exit status."""

from __future__ import annotations

import argparse
import sys

from checkpoints_convert import convert
from checkpoints_convert.launch import RankError, is_driver
from checkpoints_convert.sign import sign_checkpoint
from checkpoints_convert.verify import verify
from megatron_dynamo.config import ConfigError
from megatron_dynamo.models.checkpoint_io import CheckpointError
from megatron_dynamo.models.checkpoint_io.signing import CheckpointKeyError
from megatron_dynamo.models.mappings import MappingError
from megatron_dynamo.models.qwen import UnsupportedModelConfig

# The exit statuses the converter documents (README, docs/checkpoints.md).
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_MISMATCH = 0, 1, 2, 3


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command (``args.command``); the exit status."""
    try:
        if args.command == "sign":
            print(sign_checkpoint(args.directory), file=sys.stderr)
        elif args.command == "hf-to-megatron":
            convert.hf_to_megatron(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype,
                                   force=args.force, quiet=args.quiet, max_item_bytes=args.max_item_size)
        elif args.command == "megatron-to-hf":
            convert.megatron_to_hf(args.megatron, args.out, hf_config_dir=args.hf_config, tokenizer_dir=args.tokenizer,
                                   dtype=args.dtype, tp=args.tp, pp=args.pp, ep=args.ep,
                                   max_shard_bytes=args.max_shard_size, force=args.force, quiet=args.quiet)
        else:
            result = verify(args.hf, args.megatron, tp=args.tp, pp=args.pp, ep=args.ep, tol=args.tol,
                            batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed, quiet=args.quiet)
            if is_driver():
                print(f"max_abs_logit_diff {result.max_abs_diff:.6e}")
                if not result.passed:
                    print(f"error: max |logit diff| {result.max_abs_diff:.3e} is above the tolerance "
                          f"{result.tolerance:g}", file=sys.stderr)
                    return EXIT_MISMATCH
    except CheckpointKeyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointError, ConfigError, MappingError, UnsupportedModelConfig, RankError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK
