"""What the machine has (date, commit, GPU, versions, which needs are met), and installing the small
wheels a bare GPU machine lacks."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_parts.registry import NEEDS, Part, REPO, SMALL_WHEELS, log


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
