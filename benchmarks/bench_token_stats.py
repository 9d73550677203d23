"""Time and peak memory of per-token log pi(target), entropy H and sum pi^2 Lambda, forward + backward.

Variants (one TP rank; the vocabulary given is this rank's shard, i.e. V/tp):
  plain    the usual PyTorch way: logits = hidden @ W^T; log_softmax(logits / T) + gather; under no_grad
           p = exp(log p), H = -sum p log p, sum p^2 (log p + H); backward of sum(g * log p) to hidden and W.
  chunked  logits = hidden @ W^T (the output layer materialises them), then vocab_parallel_token_stats; backward.
  fused    fused_vocab_parallel_token_stats(hidden, W, ...): the [tokens, vocab] logits never exist; backward.
With --no-output-layer the input is the logits tensor itself (allocated before the baseline) and only plain and
chunked run; backward goes to the logits.

Every (variant, vocab, tokens) runs in a fresh subprocess, so that one measurement cannot inherit another's heap.
Peak memory:
  CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() once the inputs exist (exact, allocator-level).
  CPU:  PyTorch's CPU allocator keeps no statistics, so the kernel's peak resident set size is used: once the
        inputs exist (and a tiny warm-up ran), the peak mark is reset to the current RSS (Linux: write 5 to
        /proc/self/clear_refs), the variant runs, and VmHWM (/proc/self/status) minus that RSS is the peak extra.
        Large tensors are mmapped and returned to the OS when freed, so this is the true peak of live memory plus
        allocator slack. Where the reset is not allowed, getrusage ru_maxrss (never reset) is used instead and a
        row whose process had already peaked higher before the baseline is marked '*' (a lower bound).
"peak extra" includes the gradients that every variant must return (grad wrt hidden and W, or wrt the logits);
"working" subtracts them, leaving what the computation itself needs on top.

Usage: python benchmarks/bench_token_stats.py [--tokens 1024,2048] [--vocab 32768,151936] [--hidden 256]
       [--dtype float32|bfloat16] [--chunk-size N] [--temperature 1.0] [--repeats 2] [--threads 2]
       [--device auto|cpu|cuda] [--no-output-layer]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dynamo.parallel.token_chunks import DEFAULT_CHUNK_ELEMENTS, resolve_chunk  # noqa: E402
from megatron_dynamo.parallel.token_stats import (fused_vocab_parallel_token_stats,  # noqa: E402
                                                  vocab_parallel_token_stats)

MiB = 1 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmHWM") is not None
    except OSError:
        return False


def _peak_rss_bytes(hwm: bool) -> int:
    if hwm:
        return _status_kib("VmHWM") * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux; never reset


def start_peak_window(cuda: bool) -> tuple[int, bool, int]:
    """Start measuring peak memory from now (module docstring): (base, hwm, peak so far). ``base`` is the memory in
    use (CUDA: allocated; CPU: resident); ``hwm`` whether the CPU peak mark could be reset to it; ``peak so far``
    above ``base`` means the CPU peak could not be reset and a later reading is only a lower bound."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        return base, False, base
    base = _rss_bytes()
    hwm = _reset_peak_rss()
    return base, hwm, _peak_rss_bytes(hwm)


def read_peak(cuda: bool, hwm: bool) -> int:
    """The peak since :func:`start_peak_window` (CUDA: allocated bytes; CPU: resident bytes)."""
    import torch

    return torch.cuda.max_memory_allocated() if cuda else _peak_rss_bytes(hwm)


def _plain_stats(logits: torch.Tensor, target: torch.Tensor, temperature: float):
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        p = logp_all.exp()
        entropy = -(p * logp_all).sum(-1)
        sum_pi2_lambda = (p * p * (logp_all + entropy.unsqueeze(-1))).sum(-1)
    return logp, entropy, sum_pi2_lambda


def _make_step(variant: str, inputs: dict, temperature: float, chunk_size):
    target, g = inputs["target"], inputs["grad"]
    if "logits" in inputs:  # --no-output-layer
        logits = inputs["logits"]

        def step():
            if variant == "plain":
                logp, h, s = _plain_stats(logits, target, temperature)
            else:
                logp, h, s = vocab_parallel_token_stats(logits, target, temperature, chunk_size=chunk_size)
            return torch.autograd.grad((logp * g).sum(), logits)[0], h, s
        return step

    hidden, weight = inputs["hidden"], inputs["weight"]

    def step():
        if variant == "fused":
            logp, h, s = fused_vocab_parallel_token_stats(hidden, weight, target, temperature, chunk_size=chunk_size)
        else:
            logits = hidden @ weight.t()
            if variant == "plain":
                logp, h, s = _plain_stats(logits, target, temperature)
            else:
                logp, h, s = vocab_parallel_token_stats(logits, target, temperature, chunk_size=chunk_size)
            del logits
        gh, gw = torch.autograd.grad((logp * g).sum(), (hidden, weight))
        return gh, gw, h, s
    return step


def _make_inputs(tokens: int, vocab: int, hidden_size: int, dtype, device, no_output_layer: bool, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    target = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    grad = torch.randn(tokens, generator=gen).to(device)
    if no_output_layer:
        logits = torch.randn(tokens, vocab, generator=gen).mul_(3).to(device=device, dtype=dtype).requires_grad_()
        return {"logits": logits, "target": target, "grad": grad}
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=gen).mul_(3 / hidden_size ** 0.5).to(device=device, dtype=dtype)
    return {"hidden": hidden, "weight": weight.requires_grad_(), "target": target, "grad": grad}


def _worker(cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    dtype = getattr(torch, cfg["dtype"])
    cuda = device.type == "cuda"
    chunk = cfg["chunk_size"]

    # warm-up on a tiny problem (kernels, thread pools, lazy inits), then the real inputs
    small = _make_inputs(8, 64, 16, dtype, device, cfg["no_output_layer"])
    _make_step(cfg["variant"], small, cfg["temperature"], chunk)()
    del small
    inputs = _make_inputs(cfg["tokens"], cfg["vocab"], cfg["hidden"], dtype, device, cfg["no_output_layer"])
    step = _make_step(cfg["variant"], inputs, cfg["temperature"], chunk)
    gc.collect()
    base, hwm, peak_before = start_peak_window(cuda)

    times = []
    out = None
    for _ in range(cfg["repeats"]):
        del out
        out = None
        t0 = time.perf_counter()
        out = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = read_peak(cuda, hwm)
    # checked only after the peak was read: isfinite on a [tokens, vocab] gradient allocates temporaries
    if not all(bool(torch.isfinite(t).all()) for t in out):
        raise RuntimeError("non-finite output")
    grads = out[:-2]
    grad_bytes = sum(t.numel() * t.element_size() for t in grads)
    return {"time": min(times), "extra": peak - base, "grad_bytes": grad_bytes,
            "inexact": (not cuda) and peak_before > base + 16 * MiB}


def _run_subprocess(cfg: dict) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(cfg)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed for {cfg}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=_ints, default=[1024, 2048], help="comma-separated token counts")
    ap.add_argument("--vocab", type=_ints, default=[32768, 151936], help="comma-separated vocab sizes (per TP rank)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the output layer")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--chunk-size", type=int, default=None,
                    help=f"tokens per chunk (default: ~{DEFAULT_CHUNK_ELEMENTS} / vocab)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2, help="runs per measurement (time: the fastest)")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--no-output-layer", action="store_true", help="input = logits; variants plain and chunked")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._worker:
        print(json.dumps(_worker(json.loads(args._worker))))
        return

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    variants = ["plain", "chunked"] + ([] if args.no_output_layer else ["fused"])
    what = "peak CUDA memory allocated (exact)" if device == "cuda" else \
        "peak RSS (VmHWM, reset once inputs exist) minus RSS then, one fresh process per row"
    print(f"# token stats fwd+bwd  device={device}  dtype={args.dtype}  hidden={args.hidden}  "
          f"T={args.temperature}  threads={args.threads}  repeats={args.repeats}  "
          f"input={'logits' if args.no_output_layer else 'hidden + output weight'}")
    print(f"# memory: {what}; 'working' = peak extra - the returned gradients")
    header = (f"{'vocab':>7} {'tokens':>6} {'variant':>8} {'chunk':>6} {'time s':>8} {'x plain':>7} "
              f"{'peak extra MiB':>14} {'x plain':>7} {'working MiB':>11} {'x plain':>7} {'logits MiB':>10}")
    print(header)
    print("-" * len(header))
    fused_extra = {}
    start = time.perf_counter()
    for vocab in args.vocab:
        for tokens in args.tokens:
            rows = {}
            for variant in variants:
                cfg = dict(variant=variant, tokens=tokens, vocab=vocab, hidden=args.hidden, dtype=args.dtype,
                           chunk_size=args.chunk_size, temperature=args.temperature, repeats=args.repeats,
                           threads=args.threads, device=device, no_output_layer=args.no_output_layer)
                rows[variant] = r = _run_subprocess(cfg)
                p = rows["plain"]
                work, pwork = r["extra"] - r["grad_bytes"], p["extra"] - p["grad_bytes"]
                chunk = "-" if variant == "plain" else str(resolve_chunk(args.chunk_size, tokens, vocab))
                print(f"{vocab:>7} {tokens:>6} {variant:>8} {chunk:>6} {r['time']:>8.3f} {r['time'] / p['time']:>7.2f} "
                      f"{r['extra'] / MiB:>13.0f}{'*' if r['inexact'] else ' '} "
                      f"{r['extra'] / max(p['extra'], 1):>7.2f} "
                      f"{work / MiB:>11.0f} {work / max(pwork, 1):>7.2f} {tokens * vocab * 4 / MiB:>10.0f}",
                      flush=True)
                if variant == "fused":
                    fused_extra.setdefault(vocab, []).append((tokens, r["extra"], work))
    if any(r for r in fused_extra.values()):
        print("\n# fused path, peak extra (working) memory by token count, per vocab:")
        for vocab, rs in fused_extra.items():
            print(f"#   vocab {vocab}: " + ", ".join(f"{t} tokens: {e / MiB:.0f} MiB ({w / MiB:.0f} MiB)"
                                                    for t, e, w in rs))
    print(f"# '*' (if any) = the peak mark could not be reset and was already higher: a lower bound.  "
          f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
