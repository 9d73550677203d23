"""``python -m checkpoints_convert``: HF <-> Megatron checkpoint conversion and a logits check against HF.

Exit codes: 0 success; 1 error (missing/unexpected tensor, shape mismatch, unsupported config, existing output,
...: one line on stderr naming the field or tensor, nothing left at the output path); 2 bad command line;
3 ``verify`` found logits further apart than the tolerance.
"""

from __future__ import annotations

import argparse
import os
import re
import textwrap

from megatron_dynamo import library_logs

# Spawned workers import this package (never its __main__) before they run: the console policy that main() chose
# reaches them before any library warns.
library_logs.apply_from_environment()


DESCRIPTION = """\
Convert Qwen2 / Qwen2.5 / Qwen3 and Qwen2-MoE / Qwen3-MoE checkpoints between Hugging Face safetensors and
Megatron-Core distributed checkpoints, and check a conversion against HF transformers.

All work runs on the CPU with gloo (GPUs are hidden when started as `python -m checkpoints_convert`), so the
result does not depend on GPU kernels; memory needed is about one copy of the model.

Processes: with --tp 1 --pp 1 --ep 1 everything runs in this process. Otherwise this command spawns
pp x lcm(tp, ep) worker processes itself (tp x pp without experts; torch.multiprocessing, start method spawn,
gloo on 127.0.0.1). Under torchrun (RANK/WORLD_SIZE set) it spawns nothing: start exactly that many processes,
rank 0 writes the output.

Megatron checkpoint layout: <dir>/megatron_dynamo.json (format version, dtype, source), <dir>/hf/config.json
(+ generation config and tokenizer files), <dir>/model/ (dist_checkpointing, torch_dist), <dir>/manifest.json
(size and SHA-256 of every file). It loads at any TP/PP (and EP: experts are stored by their global index).

Trust: megatron-to-hf and verify check a Megatron checkpoint as `dynamo train --resume` does before loading
anything (manifest, every file's SHA-256, no unlisted file, pickles that hold data only: loading never runs code
from a checkpoint). With DYNAMO_CHECKPOINT_KEY (or DYNAMO_CHECKPOINT_KEY_FILE, a file outside the checkpoint) set,
hf-to-megatron signs the manifest with HMAC-SHA256 and the others refuse an unsigned or wrongly signed checkpoint;
without a key the check proves integrity only. `sign DIR` writes the manifest of a checkpoint you trust.
--force replaces only an empty directory or one holding a checkpoint of the kind being written.

Exit codes: 0 ok, 1 error (message names the tensor or config field; nothing is left at --out),
2 bad arguments (or an unusable checkpoint key), 3 verify: logits differ by more than --tol."""

EPILOG = """\
examples:
  python -m checkpoints_convert hf-to-megatron --hf Qwen2.5-Math-1.5B --out ckpt/megatron --tp 2 --pp 1
  python -m checkpoints_convert verify --hf Qwen2.5-Math-1.5B --megatron ckpt/megatron --tp 1 --pp 2
  python -m checkpoints_convert megatron-to-hf --megatron ckpt/megatron --out ckpt/hf --tokenizer Qwen2.5-Math-1.5B
  python -m checkpoints_convert hf-to-megatron --hf Qwen3-30B-A3B --out ckpt/moe --tp 2 --ep 4
  torchrun --nproc-per-node 2 -m checkpoints_convert hf-to-megatron --hf DIR --out OUT --tp 2"""


def parse_size(text: str) -> int:
    """'5GB', '500MB', '300KiB', '1234' -> bytes (decimal units for KB/MB/GB, binary for KiB/MiB/GiB)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9, "T": 1e12, "TB": 1e12,
             "KI": 2**10, "KIB": 2**10, "MI": 2**20, "MIB": 2**20, "GI": 2**30, "GIB": 2**30, "TI": 2**40,
             "TIB": 2**40}[unit]
    size = int(number * scale)
    if size < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return size


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_layout_and_console(p: argparse.ArgumentParser, layout_help: str) -> None:
    """--tp / --pp / --ep (what they mean for this command: ``layout_help``), --quiet and --verbose."""
    p.add_argument("--tp", type=_positive, default=1, metavar="N",
                   help=f"tensor-parallel size {layout_help} (default 1)")
    p.add_argument("--pp", type=_positive, default=1, metavar="N",
                   help=f"pipeline-parallel size {layout_help} (default 1)")
    p.add_argument("--ep", type=_positive, default=1, metavar="N",
                   help=f"expert-parallel size {layout_help}: a mixture-of-experts model's experts divided over N "
                        "ranks, each expert whole on one (expert tensor parallel 1); N must divide the experts, "
                        "and be 1 for a dense model. Runs --pp x lcm(--tp, --ep) ranks: an N beyond --tp adds "
                        "data-parallel ranks that hold the other experts (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr (errors still print)")
    p.add_argument("--verbose", action="store_true",
                   help="the libraries' own warnings and progress bars too (left out by default, as in training)")


def _add_hf_to_megatron(sub) -> None:
    """The ``hf-to-megatron`` subcommand."""
    h2m = sub.add_parser(
        "hf-to-megatron", help="HF safetensors -> Megatron distributed checkpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            Read an HF checkpoint (config.json + model.safetensors, or shards with model.safetensors.index.json),
            check every tensor name and shape against config.json, and write a Megatron distributed checkpoint
            that the trainer (and megatron-to-hf / verify) load at any TP/PP/EP. Tensors are streamed one at a
            time from the safetensors files; each rank holds only its shard of the model (and reads only its
            own experts)."""))
    h2m.add_argument("--hf", required=True, metavar="DIR", help="HF model directory (config.json + safetensors)")
    h2m.add_argument("--out", required=True, metavar="DIR", help="output Megatron checkpoint directory (must not "
                     "exist unless --force)")
    h2m.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                     help="parameter dtype of the Megatron checkpoint; auto = the dtype the HF tensors are "
                          "stored in (default auto; fp32<->bf16 casts round to nearest)")
    h2m.add_argument("--max-item-size", type=parse_size, default=parse_size("16MiB"), metavar="SIZE",
                     help="store tensors larger than this as row pieces, so that loading the checkpoint never "
                          "buffers more than one piece (default 16MiB)")
    h2m.add_argument("--force", action="store_true", help="replace --out if it holds a Megatron checkpoint (or is "
                     "empty), atomically, on success; anything else is refused")
    _add_layout_and_console(h2m, "to shard the model with while converting; the checkpoint itself loads at any layout")


def _add_megatron_to_hf(sub) -> None:
    """The ``megatron-to-hf`` subcommand."""
    m2h = sub.add_parser(
        "megatron-to-hf", help="Megatron checkpoint -> HF safetensors + index + config.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            Load a Megatron model checkpoint and write HF safetensors shards, model.safetensors.index.json,
            config.json (with the output dtype), generation_config.json and tokenizer files, loadable by
            transformers.AutoModelForCausalLM.from_pretrained. Tensors are gathered and written one at a
            time (the model is held once, never twice)."""))
    m2h.add_argument("--megatron", required=True, metavar="DIR", help="Megatron model checkpoint directory")
    m2h.add_argument("--out", required=True, metavar="DIR", help="output HF directory (must not exist unless --force)")
    m2h.add_argument("--hf-config", metavar="DIR", default=None,
                     help="take config.json (and generation_config.json) from this HF directory instead of the "
                          "copy stored in the checkpoint; it must describe the same architecture")
    m2h.add_argument("--tokenizer", metavar="DIR", default=None,
                     help="copy tokenizer files (tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, "
                          "...) from this directory (default: the ones stored in the checkpoint, if any)")
    m2h.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                     help="dtype of the written tensors (default: the checkpoint's dtype)")
    m2h.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), metavar="SIZE",
                     help="largest safetensors shard, e.g. 5GB, 500MB, 2GiB (default 5GB; a larger single tensor "
                          "gets a shard of its own)")
    m2h.add_argument("--force", action="store_true", help="replace --out if it holds an HF model (or is empty), "
                     "atomically, on success; anything else is refused")
    _add_layout_and_console(m2h, "to load the checkpoint with before gathering")


def _add_verify(sub) -> None:
    """The ``verify`` subcommand."""
    ver = sub.add_parser(
        "verify", help="compare HF transformers logits with the Megatron model's",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            Load the HF model with transformers (eager attention, CPU) and the Megatron checkpoint at --tp x --pp,
            run the same random token batch through both in the checkpoint's dtype, print the largest absolute
            logit difference, and exit with status 3 if it is above --tol."""))
    ver.add_argument("--hf", required=True, metavar="DIR", help="HF model directory")
    ver.add_argument("--megatron", required=True, metavar="DIR", help="Megatron model checkpoint directory")
    ver.add_argument("--tol", type=float, default=None,
                     help="largest allowed |logit difference| (default 1e-4 for fp32, 1e-1 for bf16 checkpoints, "
                          "where two different bf16 kernels are compared)")
    ver.add_argument("--batch-size", type=_positive, default=2, metavar="B", help="sequences in the batch (default 2)")
    ver.add_argument("--seq-len", type=_positive, default=32, metavar="S", help="tokens per sequence (default 32)")
    ver.add_argument("--seed", type=int, default=0, help="seed of the random token batch (default 0)")
    _add_layout_and_console(ver, "to load the Megatron checkpoint with")


def _add_sign(sub) -> None:
    """The ``sign`` subcommand."""
    sign = sub.add_parser(
        "sign", help="write the manifest of a Megatron checkpoint you trust, signed with the configured key",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            Check a Megatron model checkpoint (the converter's output or a training step_N directory) and write
            its manifest.json: the size and SHA-256 of every file, with an HMAC-SHA256 signature when
            DYNAMO_CHECKPOINT_KEY (or DYNAMO_CHECKPOINT_KEY_FILE) is set. For a checkpoint saved before manifests
            existed or before a key was configured. Refused when the files no longer match an existing manifest,
            or when a pickle of the checkpoint holds anything but data."""))
    sign.add_argument("directory", metavar="DIR", help="Megatron model checkpoint directory")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoints_convert", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{hf-to-megatron,megatron-to-hf,verify,sign}")
    for add in (_add_hf_to_megatron, _add_megatron_to_hf, _add_verify, _add_sign):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # The trainer's quiet console (megatron_dynamo/library_logs.py): the library warnings that say nothing the user
    # can act on are left out, here and in the worker processes, and so are transformers' progress bars.
    library_logs.apply(args.verbose)
    if not args.verbose:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    # The conversion's modules (torch, Megatron-Core: seconds to import) load only once the arguments parsed, so
    # --help and a usage error answer at once.
    from checkpoints_convert.commands import run_command

    return run_command(args)
