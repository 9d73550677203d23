"""The samples of ``bench_update.py``: a DRA-like batch (prompts with 4..12 responses each, log-normal response
lengths scaled to a token total; its module docstring says more)."""

from __future__ import annotations


def dra_like_batch(tokens: int, responses: int, prompt_tokens: tuple[int, int], max_response: int, vocab: int,
                   seed: int = 0):
    """(prompts, responses): ``prompts`` a list of (prompt id, prompt token ids); ``responses`` a list of (prompt
    id, response token ids, advantage), 4..12 per prompt, at least ``responses`` of them, about ``tokens`` response
    tokens in all (see the module docstring). Deterministic in ``seed``. Token ids avoid 0 (the pad/EOS id)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    counts, total = [], 0
    while total < max(1, responses, -(-tokens // max_response)):
        counts.append(4 + (7 * len(counts)) % 9)  # 4..12, uneven like the allocator's counts
        total += counts[-1]
    n = sum(counts)
    raw = rng.lognormal(0.0, 0.9, n)
    lengths = np.ones(n)
    scale = tokens / raw.sum()
    for _ in range(50):  # scale so that the capped lengths add up to ``tokens`` (or all are capped)
        lengths = np.clip(np.round(raw * scale), 8, max_response)
        if abs(lengths.sum() - tokens) <= 1 or lengths.min() >= max_response:
            break
        scale *= tokens / max(1.0, lengths.sum())
    lengths = [int(x) for x in lengths]
    prompts, responses, k = [], [], 0
    for p, count in enumerate(counts):
        pid = f"p{p}"
        plen = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))
        prompts.append((pid, tuple(int(t) for t in rng.integers(1, vocab, plen))))
        adv = rng.standard_normal(count)
        adv = (adv - adv.mean()) / (adv.std() + 1e-6)
        for j in range(count):
            responses.append((pid, tuple(int(t) for t in rng.integers(1, vocab, lengths[k])), float(adv[j])))
            k += 1
    return prompts, responses
