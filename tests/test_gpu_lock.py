"""The GPU install cannot silently break: resolving setup.py's core + gpu requirements for the GPU platform (CPython
3.11/3.12, manylinux_2_28 x86_64) with uv, which reads wheel metadata only, with requirements-gpu.lock as
constraints, gives exactly requirements-gpu.lock: the locked set satisfies setup.py and every dependency on both
Pythons, and nothing is missing from it. It holds the pinned vLLM/megatron-core/Transformer Engine and the CPU lock's
torch and transformers. A fresh resolution as of the lock's date is not compared: the registry offered different
files for the same date on different days (scripts/lock_gpu.sh), which failed CI with an intact lock. Needs only the
package registry (PyPI); skipped with the reason when uv is missing or PyPI cannot be reached. And te_importable():
a Transformer Engine whose torch extension does not load counts as absent."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU_LOCK = ROOT / "requirements-gpu.lock"
CPU_LOCK = ROOT / "requirements-cpu.lock"


def _pins(path: Path) -> dict[str, set[str]]:
    pins: dict[str, set[str]] = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if match:
            pins.setdefault(match.group(1).lower().replace("_", "-"), set()).add(match.group(2))
    return pins


def _uv() -> str:
    exe = Path(sys.executable).parent / "uv"
    found = str(exe) if exe.exists() else shutil.which("uv")
    if not found:
        pytest.skip("uv is not installed (pip install uv; it is in the test extra)")
    return found


def _registry_reachable() -> None:
    try:
        urllib.request.urlopen("https://pypi.org/simple/vllm/", timeout=10).close()
    except OSError as err:
        pytest.skip(f"PyPI cannot be reached ({err}); the GPU lock check needs the package registry")


def test_gpu_lock_pins_the_tested_versions():
    gpu, cpu = _pins(GPU_LOCK), _pins(CPU_LOCK)
    assert gpu["vllm"] == {"0.32.0"}
    assert gpu["megatron-core"] == {"0.16.1"} == cpu["megatron-core"]
    assert gpu["transformer-engine"] == {"2.11.0"} == gpu["transformer-engine-cu13"]
    assert gpu["torch"] == {"2.13.0"} and cpu["torch"] == {"2.13.0+cpu"}  # same release, CUDA vs CPU build
    assert gpu["transformers"] == cpu["transformers"] == {"5.19.0"}
    assert gpu["math-verify"] == cpu["math-verify"]
    # TE's CUDA 13 core matches torch's CUDA 13 runtime; no CUDA 12 runtime slips in.
    assert "nvidia-cuda-runtime-cu12" not in gpu
    assert gpu["nvidia-cuda-runtime"] and all(v.startswith("13.") for v in gpu["nvidia-cuda-runtime"])


def _resolve_with(lock: Path, out: Path) -> subprocess.CompletedProcess:
    uv = _uv()
    _registry_reachable()
    env = {**os.environ, "UV": uv, "CHECK": str(lock), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "lock_gpu.sh"), str(out)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


def _difference(fresh: Path, lock: Path) -> tuple[list[str], list[str]]:
    fresh_lines = {line for line in fresh.read_text().splitlines() if not line.startswith("#")}
    lock_lines = {line for line in lock.read_text().splitlines() if not line.startswith("#")}
    return sorted(fresh_lines - lock_lines), sorted(lock_lines - fresh_lines)


@pytest.mark.slow
def test_gpu_lock_resolves_for_the_gpu_platform(tmp_path):
    start = time.monotonic()
    run = _resolve_with(GPU_LOCK, tmp_path / "resolved.lock")
    assert run.returncode == 0, run.stderr[-3000:]
    print(f"GPU lock resolved in {time.monotonic() - start:.1f} s")
    added, removed = _difference(tmp_path / "resolved.lock", GPU_LOCK)
    assert not added and not removed, (
        f"the GPU requirements resolved with requirements-gpu.lock as constraints differ from it (setup.py "
        f"changed?): now {added}, lock {removed}; check the new set, then run scripts/lock_gpu.sh and commit the lock")


@pytest.mark.parametrize("damage", ["vllm 0.31.0", "filelock missing"])
def test_a_lock_that_does_not_fit_setup_py_is_caught(tmp_path, damage):
    lines = GPU_LOCK.read_text().splitlines()
    if damage == "vllm 0.31.0":  # setup.py pins vllm==0.32.0: no resolution exists
        bad = [line.replace("vllm==0.32.0", "vllm==0.31.0") for line in lines]
    else:  # a dependency the lock lacks is resolved freely: an extra line
        bad = [line for line in lines if not line.startswith("filelock==")]
    assert bad != lines
    lock = tmp_path / "bad.lock"
    lock.write_text("\n".join(bad) + "\n")
    run = _resolve_with(lock, tmp_path / "resolved.lock")
    if damage == "vllm 0.31.0":
        assert run.returncode != 0 and "vllm" in run.stderr
    else:
        assert run.returncode == 0, run.stderr[-3000:]
        added, removed = _difference(tmp_path / "resolved.lock", lock)
        assert [line.split("==")[0] for line in added] == ["filelock"] and not removed


_FAKE_TE = {
    # What a TE without its torch extension looks like: the package imports, its pytorch module loads the extension.
    "broken": "import transformer_engine_torch  # the extension, absent\n",
    "working": "VERSION = 'fake'\n",
}
_PROBE = ("import transformer_engine\n"  # the old check: this alone succeeds for both fakes
          "from megatron_dynamo.models.qwen import te_importable\n"
          "print(transformer_engine.__file__.startswith({root!r}), te_importable())\n")


@pytest.mark.parametrize("kind,expected", [("broken", "True False"), ("working", "True True")])
def test_te_counts_only_with_its_torch_extension(tmp_path, kind, expected):
    """A real import of a fake transformer_engine package put first on sys.path (in a fresh interpreter)."""
    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text(_FAKE_TE[kind])
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    run = subprocess.run([sys.executable, "-c", _PROBE.format(root=str(tmp_path))], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[-2] == expected
