"""Import smoke test of the GPU image (docker/Dockerfile): every module the GPU path needs imports, and the versions
are the locked ones. Exit 1 naming each failed import. ``--allow-missing-cuda`` (docker/check_steps.sh in a plain
venv without CUDA) reports the imports that need the CUDA build (torch CUDA, TE, vLLM's CUDA build) as not run."""

from __future__ import annotations

import importlib
import sys
import traceback

MODULES = ["torch", "transformers", "megatron.core", "transformer_engine.pytorch", "vllm", "math_verify",
           "megatron_dynamo.cli", "megatron_dynamo.models.qwen"]
CUDA_ONLY = {"transformer_engine.pytorch", "vllm"}


def main(argv: list[str]) -> int:
    allow_missing = "--allow-missing-cuda" in argv
    failed = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - report each import, whatever it raises
            line = traceback.format_exception_only(type(err), err)[-1].strip()
            if allow_missing and name in CUDA_ONLY:
                print(f"NOT RUN  {name}: needs the CUDA image ({line})")
                continue
            print(f"FAIL     {name}: {line}")
            failed.append(name)
            continue
        print(f"ok       {name} {getattr(module, '__version__', '')}")
    if "torch" in failed:
        return 1
    import torch

    print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, CUDA available {torch.cuda.is_available()}")
    if not allow_missing and torch.version.cuda is None:
        print("FAIL     torch is not a CUDA build")
        failed.append("torch-cuda")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
