"""Peak memory and speed of HF <-> Megatron checkpoint conversion on a Qwen2-shaped model of a few hundred MB.

    python benchmarks/bench_convert.py [--workdir DIR] [--keep]

Builds a random Qwen2 model with transformers (hidden 1024, 10 layers, intermediate 2048, 16 heads / 4 KV heads,
vocab 32000, untied embeddings, fp32: ~154M parameters, ~614 MB), saves it with ``save_pretrained`` in 200 MB
shards, converts it HF -> Megatron (TP=1, PP=1) and back, checks that the round trip is bit-identical, and prints
a table.

How memory is measured (the same way for the conversion and for its baseline):
- each conversion runs in a fresh child process (``python bench_convert.py --child ...``) that imports what the
  CLI imports and brings up the (single-process) distributed runtime; then it resets its peak-RSS counter
  (Linux: ``echo 5 > /proc/self/clear_refs`` sets VmHWM to the current RSS), records its RSS, calls
  ``checkpoints_convert.main``, and reports VmHWM from ``/proc/self/status``. The conversion's working memory is
  ``VmHWM - RSS at its start``; the *baseline* child does the same imports and set-up and converts nothing.
  RSS includes touched pages of memory-mapped safetensors files. (``ru_maxrss`` is not used: Linux carries it
  across ``exec`` from the forked parent, which here holds the freshly built HF model.) Without clear_refs the
  script falls back to ``VmHWM - baseline child's VmHWM``.
- ``RSS/size`` = that working memory / checkpoint bytes (the goal is <= 1.2).
- ``tree PSS/size``: the parent also samples the whole process tree every 20 ms (the child plus
  dist_checkpointing's forked writers and its spawn-context Manager process) and reports the peak of the summed
  PSS (proportional set size: pages shared with the forked writers are split, not double counted) minus the
  baseline child's, over the checkpoint size. Sampling can miss short spikes; VmHWM cannot.
Time: seconds inside the conversion (after imports) per GB (1 GB = 1e9 bytes) of checkpoint; the machine may be
shared, so times vary from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=32000, hidden_size=1024,
    intermediate_size=2048, num_hidden_layers=10, num_attention_heads=16, num_key_value_heads=4,
    max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
    tie_word_embeddings=False, use_sliding_window=False, initializer_range=0.02, bos_token_id=0, eos_token_id=0)


# ------------------------------------------------------------------------------------------------ child side
def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _child(argv: list[str]) -> None:
    """Runs in a fresh process: imports + runtime set-up, then (unless baseline) one CLI command."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as `python -m checkpoints_convert` does
    sys.path.insert(0, REPO)
    import megatron.core.dist_checkpointing  # noqa: F401
    import torch  # noqa: F401

    import checkpoints_convert.convert  # noqa: F401
    import megatron_dynamo.models.export  # noqa: F401
    import megatron_dynamo.models.megatron_model  # noqa: F401
    from checkpoints_convert.cli import main
    from megatron_dynamo.parallel import runtime

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    reset = _reset_peak()
    start_rss = _status_bytes("VmRSS")
    seconds, code = 0.0, 0
    if argv[0] != "baseline":
        # The conversion re-uses the process group set up above (run_ranks sees an initialised group).
        start = time.perf_counter()
        code = main(argv)
        seconds = time.perf_counter() - start
    result = {"code": code, "seconds": seconds, "start_rss": start_rss, "peak_rss": _status_bytes("VmHWM"),
              "peak_reset": reset}
    print("BENCH_RESULT " + json.dumps(result), flush=True)
    sys.exit(code)


# ------------------------------------------------------------------------------------------------ parent side
def _tree_pss(pid: int) -> int:
    import psutil

    total = 0
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    for proc in procs:
        try:
            total += proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def run_child(args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _tree_pss(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    done.set()
    sampler.join()
    wall = time.perf_counter() - start
    lines = [line for line in out.splitlines() if line.startswith("BENCH_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"child {' '.join(args)} failed ({proc.returncode}):\n{err[-4000:]}")
    result = json.loads(lines[-1].split(" ", 1)[1])
    result.update(tree_pss_peak=peak[0], wall=wall)
    return result


def make_model(directory: str) -> int:
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**CONFIG)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, max_shard_size="200MB")
    return sum(p.numel() for p in model.parameters())


def bit_identical(a_dir: str, b_dir: str) -> bool:
    import torch

    sys.path.insert(0, REPO)
    from megatron_dynamo.models.checkpoint_io import HFCheckpointReader

    a, b = HFCheckpointReader(a_dir), HFCheckpointReader(b_dir)
    if sorted(a.names()) != sorted(b.names()):
        return False
    for name in a.names():
        x, y = a.get(name), b.get(name)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.int32), y.view(torch.int32)):
            return False
    return True


def dir_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None, help="where to put the checkpoints (default: a temporary dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="bench_convert-")
    os.makedirs(work, exist_ok=True)
    hf_in, meg, hf_out = (os.path.join(work, n) for n in ("hf", "megatron", "hf_out"))
    try:
        for path in (hf_in, meg, hf_out):
            shutil.rmtree(path, ignore_errors=True)
        params = make_model(hf_in)
        base = run_child(["baseline"])
        h2m = run_child(["hf-to-megatron", "--hf", hf_in, "--out", meg, "--quiet"])
        m2h = run_child(["megatron-to-hf", "--megatron", meg, "--out", hf_out, "--quiet"])
        same = bit_identical(hf_in, hf_out)

        size = sum(os.path.getsize(os.path.join(hf_in, f)) for f in os.listdir(hf_in) if f.endswith(".safetensors"))
        rows = []
        for name, r in (("hf-to-megatron", h2m), ("megatron-to-hf", m2h)):
            # With the peak reset at the start of the conversion: peak during it minus RSS at its start.
            # Without (no clear_refs): the whole process's peak minus the baseline child's.
            rss = r["peak_rss"] - (r["start_rss"] if r["peak_reset"] else base["peak_rss"])
            pss = r["tree_pss_peak"] - base["tree_pss_peak"]
            rows.append((name, size / 1e6, rss / 1e6, rss / size, pss / size, r["seconds"], r["seconds"] / (size / 1e9),
                         r["wall"]))
        print(f"\nQwen2-shaped random model: {params / 1e6:.1f}M parameters, fp32, safetensors {size / 1e6:.1f} MB "
              f"(Megatron checkpoint on disk {dir_bytes(meg) / 1e6:.1f} MB); TP=1 PP=1, one process, "
              f"{os.cpu_count()} CPU cores")
        print(f"baseline (interpreter + imports + runtime, measured the same way): RSS {base['start_rss'] / 1e6:.0f} MB "
              f"(peak {base['peak_rss'] / 1e6:.0f} MB), process-tree PSS {base['tree_pss_peak'] / 1e6:.0f} MB; "
              f"peak reset at conversion start: {'yes' if h2m['peak_reset'] else 'no (peak - baseline peak)'}\n")
        header = ("direction", "ckpt MB", "peak-start RSS MB", "RSS/size", "tree PSS/size", "convert s", "s/GB",
                  "process wall s")
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("-" * (len(h) + 2) for h in header) + "|")
        for name, mb, rss_mb, ratio, pss_ratio, secs, spg, wall in rows:
            print(f"| {name} | {mb:.0f} | {rss_mb:.0f} | {ratio:.2f}x | {pss_ratio:.2f}x | {secs:.1f} | {spg:.1f} | "
                  f"{wall:.1f} |")
        print(f"\nround trip HF -> Megatron -> HF bit-identical: {'yes' if same else 'NO'}")
        print("goal: peak RSS over checkpoint size <= 1.2x: "
              + ", ".join(f"{name} {'met' if ratio <= 1.2 else 'NOT met'}" for name, _, _, ratio, *_ in rows))
        if not same:
            raise SystemExit(1)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
    else:
        main()
