"""Helpers the parts share: the part context, Megatron set-up, small models and prompts, child processes."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_parts.registry import REPO, TINY_QWEN2, log


@dataclass
class Ctx:
    cpu: bool
    work: Path
    deadline: float  # time.monotonic() by which the part must have returned
    notes: list[str] = field(default_factory=list)
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # closed when the part returns

    @property
    def gpu(self) -> bool:
        return not self.cpu

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def device(self):
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if self.gpu else torch.device("cpu")


def sync_device(ctx: Ctx) -> None:
    if ctx.gpu:
        import torch

        torch.cuda.synchronize()


def gib(nbytes: float) -> float:
    return nbytes / 2**30


def device_used_gib() -> float:
    """GPU memory in use on device 0 by every process (total - free)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return gib(total - free)


def load_config(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def small_qwen2(vocab: int = 4096) -> dict[str, Any]:
    """A small Qwen2 with realistic head size (64) and GQA, for spec parity and CPU stand-ins."""
    cfg = load_config(TINY_QWEN2)
    cfg.update(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=1024)
    return cfg


def init_megatron(ctx: Ctx, seed: int = 0, placement: bool = True):
    """Megatron's parallel state for one rank (NCCL on the GPU). In --cpu mode, with ``placement``, the rest of the
    part runs under CUDA's placement rules (``parallel.device_check``): a host tensor reaching the model or a
    collective fails there as it would on a GPU."""
    from megatron_dynamo.parallel import runtime

    info = runtime.init_distributed(runtime.ParallelConfig(), seed=seed)
    if ctx.cpu and placement:
        try:
            from megatron_dynamo.parallel.device_check import simulated_gpu_placement
        except ImportError:
            ctx.notes.append("parallel.device_check is not available: CUDA placement rules not simulated")
        else:
            ctx.stack.enter_context(simulated_gpu_placement())
            ctx.notes.append("--cpu: ran under simulated CUDA placement rules (parallel.device_check)")
    return info


def shutdown_megatron() -> None:
    try:
        from megatron_dynamo.parallel import runtime

        runtime.shutdown()
    except Exception as exc:  # noqa: BLE001
        log(f"shutdown: {exc}")


def te_enabled() -> bool:
    from megatron_dynamo.models.qwen import te_available

    return te_available()


def free_cuda(ctx: Ctx) -> None:
    import gc

    gc.collect()
    if ctx.gpu:
        import torch

        torch.cuda.empty_cache()


def hf_state(cfg: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Random HF Qwen weights (norms perturbed, so a swapped norm mapping shows) as an fp32 CPU state dict."""
    import torch
    import transformers

    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sharpen(actor, arch) -> float:
    """Scale the final norm so that random-init logits have a std of ~3 (a peaked distribution, like a trained
    model's), instead of near-uniform log-probs that would hide a log-prob mismatch. Returns the scale."""
    import torch

    scale = 3.0 / (arch.initializer_range * math.sqrt(arch.hidden_size))
    found = False
    with torch.no_grad():
        for name, param in actor.named_parameters():
            if name.endswith("final_layernorm.weight"):
                param.fill_(scale)
                found = True
    if not found:
        raise RuntimeError("no final_layernorm.weight in the Megatron model")
    return scale


def write_model_dir(cfg: dict[str, Any], out: Path, dtype: str) -> Path:
    """config.json + the offline character tokenizer: what vLLM needs to start with dummy weights."""
    from megatron_dynamo.data import build_char_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg, torch_dtype="bfloat16" if dtype == "bf16" else "float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    build_char_tokenizer(str(out))
    return out


def make_prompts(n: int, max_tokens: int = 96, seed: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """``n`` (prompt id, token ids) pairs: synthetic problems in the boxed-answer template, character tokens."""
    from megatron_dynamo.data import build_char_tokenizer, make_synthetic_task, render

    tokenizer = build_char_tokenizer()
    out = []
    for ex in make_synthetic_task(n, seed=seed):
        ids = tokenizer.encode(render("qwen_math_boxed", ex.problem), add_special_tokens=False)
        out.append((ex.id, tuple(ids[-max_tokens:])))
    return out


def error_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def rel_error(a, b) -> float:
    import torch

    a, b = a.double(), b.double()
    denom = torch.linalg.vector_norm(b).item()
    return torch.linalg.vector_norm(a - b).item() / denom if denom else float("inf")


def kill_tree(pid: int) -> None:
    try:
        import psutil

        proc = psutil.Process(pid)
        procs = proc.children(recursive=True) + [proc]
    except Exception:  # noqa: BLE001
        procs = []
    for p in procs:
        try:
            p.kill()
        except Exception:  # noqa: BLE001
            pass


def run_streaming(cmd: list[str], deadline_s: float, env: dict[str, str] | None = None,
                   keep: int = 400) -> tuple[int | None, list[str]]:
    """Run ``cmd`` in the repo root, echo its output (into the check's log), kill it (and its children) after
    ``deadline_s`` seconds. Returns (exit code or None when killed, the last ``keep`` lines)."""
    tail: deque[str] = deque(maxlen=keep)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, bufsize=1, errors="replace")
    killed = threading.Event()

    def watchdog():
        killed.set()
        kill_tree(proc.pid)

    timer = threading.Timer(max(1.0, deadline_s), watchdog)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line.rstrip("\n"))
        proc.wait()
    finally:
        timer.cancel()
    sys.stdout.flush()
    return (None if killed.is_set() else proc.returncode), list(tail)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env
